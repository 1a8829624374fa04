// Causal attention of one sequence's prefill chunk over its paged bf16 KV cache,
// on AVX-512 BF16 (vdpbf16ps): a flash-attention loop with the online softmax in
// fp32, both products in bf16 with fp32 accumulators.
//
// Why our own: torch's CPU flash attention runs a 1,000-token SmolLM2 prompt at
// about 50 GFLOP/s, a quarter of what the same core's bf16 GEMM reaches, and was
// 37% of a prefill (bench prefill-profile). At d = 64 its tiles are too small for
// the GEMM calls it makes to pay their overhead. Here the two products are one
// register-tiled loop:
//
//   for each (head, tile of R query rows), longest contexts first:
//     for each tile of 32 keys up to the tile's last visible key:
//       S[r]  = q_r . K_tile        (32 keys in two zmm; d vdpbf16ps, q pairs broadcast)
//       causal mask, running max, P = exp2(S * scale * log2 e - max), O *= alpha
//       O[r] += P_r . V_tile        (d/16 zmm per row; 16 vdpbf16ps per zmm, P pairs broadcast)
//     out_r = O[r] / l[r], rounded to bf16
//
// vdpbf16ps sums the products of adjacent pairs, so each operand is packed once per
// call so that a pair sits in one 32-bit lane: K as [kv_head][key tile][d/2][32 keys]
// (a lane holds k[key][2i], k[key][2i+1]) and V as [kv_head][key pair][d] (a lane holds
// v[2m][d], v[2m+1][d]). Packing reads the cache through the block table once; it is
// O(context * d), the attention O(context^2 * d).
//
// Rows of a tile: R = 16 / (d / 16) (d = 64: 4 rows, O is 16 zmm; d = 32: 4), so that O stays in
// registers for the whole key loop; the two halves of a row's scores are two accumulator chains
// each, 2R in flight, which hides the dependent vdpbf16ps latency.
//
// Threads: an OpenMP team of the caller's size (torch's thread count; libgomp is
// torch's copy), work items from an atomic counter, the most expensive (the last
// query rows, longest context) handed out first. A row's result depends neither
// on the thread count nor on the other rows.
//
// Plain CPython over raw pointers like linear.cpp: prefill.py checks dtypes,
// shapes, contiguity and device; this file checks the block table's indices.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int kIsaNone = 0;
constexpr int kIsaAvx512Bf16 = 3;  // linear.cpp's numbering

int detect_isa() {
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 && __builtin_cpu_supports("avx512bf16") ? kIsaAvx512Bf16 : kIsaNone;
}

const int g_isa = detect_isa();

constexpr int kKeys = 32;  // keys per tile: two zmm of fp32 scores per query row

struct Problem {
  uint16_t* out;          // [q_len, heads, dim] bf16
  const uint16_t* q;      // [q_len, heads, dim] bf16
  const uint16_t* cache;  // [num_blocks, 2, block_size, kv_heads, dim] bf16
  const int64_t* block_table;
  int64_t num_blocks, block_size;
  int64_t q_len, ctx_len;  // query j sits at position ctx_len - q_len + j and sees keys 0..that
  int64_t heads, kv_heads, dim;
  float scale;
};

// One key's row of K (kind 0) or V (kind 1) for a kv head, read through the block table.
inline const uint16_t* kv_row(const Problem& p, int kind, int64_t key, int64_t kvh) {
  const int64_t block = p.block_table[key / p.block_size];
  const int64_t off = key % p.block_size;
  return p.cache + (((block * 2 + kind) * p.block_size + off) * p.kv_heads + kvh) * p.dim;
}

// Packed operands of one kv head: K tiles [tiles][dim/2][16] and V pairs [pairs][dim] of
// 32-bit lanes (two bf16 each); keys past the context are zero (and masked out anyway).
void pack_head(const Problem& p, int64_t kvh, uint32_t* k_packed, uint32_t* v_packed) {
  const int64_t half = p.dim / 2;
  const int64_t tiles = (p.ctx_len + kKeys - 1) / kKeys;
  std::memset(k_packed, 0, sizeof(uint32_t) * tiles * half * kKeys);
  for (int64_t key = 0; key < p.ctx_len; ++key) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(kv_row(p, 0, key, kvh));
    uint32_t* dst = k_packed + (key / kKeys) * half * kKeys + key % kKeys;
    for (int64_t i = 0; i < half; ++i) dst[i * kKeys] = src[i];
  }
  const int64_t pairs = tiles * kKeys / 2;
  std::memset(v_packed, 0, sizeof(uint32_t) * pairs * p.dim);
  for (int64_t key = 0; key < p.ctx_len; ++key) {
    const uint16_t* src = kv_row(p, 1, key, kvh);
    uint16_t* dst = reinterpret_cast<uint16_t*>(v_packed + (key / 2) * p.dim) + key % 2;
    for (int64_t d = 0; d < p.dim; ++d) dst[2 * d] = src[d];
  }
}

}  // namespace

// ------------------------------------------------------------ AVX-512 BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")
namespace {

// 2^x for x <= 0 (a softmax's exponents), |relative error| < 2e-7; x below -126 gives 0.
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
  // minimax polynomial for 2^f on [-0.5, 0.5]
  __m512 r = _mm512_set1_ps(1.5353362e-4f);
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.3398874e-3f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(9.6181291e-3f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(5.5504109e-2f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(2.4022652e-1f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(6.9314718e-1f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.0f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), r, n);
}

inline __m512 bcast(const uint32_t* lanes, int64_t i) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(lanes[i])));
}

// The causal mask of one row over one half (16 keys from key0) of a tile: keys past the row's own
// position are out (the diagonal, and the pad past the context).
inline __mmask16 visible_mask(int64_t pos, int64_t key0) {
  const int64_t visible = std::min<int64_t>(pos - key0 + 1, 16);
  return visible <= 0 ? static_cast<__mmask16>(0)
                      : static_cast<__mmask16>(visible >= 16 ? 0xffffu : (1u << visible) - 1u);
}

// R query rows (positions pos0 .. pos0 + rows - 1 of one head) against keys 0 .. pos0 + rows - 1.
// DCH: dim / 16, zmm chunks per row of O. Rows past `rows` repeat the last one and are not stored.
// A tile is 32 keys, two zmm of scores per row: the running maximum, its rescale of O and the
// bf16 rounding of P are paid once per 32 keys.
template <int R, int DCH>
void row_tile(const Problem& p, const uint32_t* k_packed, const uint32_t* v_packed, const uint16_t* q0,
              int64_t q_stride, uint16_t* out0, int64_t pos0, int rows) {
  constexpr int kHalf = DCH * 8;  // dim / 2 pairs
  const uint32_t* q[R];
  int64_t pos[R];
  for (int r = 0; r < R; ++r) {
    q[r] = reinterpret_cast<const uint32_t*>(q0 + std::min(r, rows - 1) * q_stride);
    pos[r] = pos0 + std::min(r, rows - 1);
  }
  __m512 o[R][DCH];
  float m[R];
  __m512 lsum[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < DCH; ++c) o[r][c] = _mm512_setzero_ps();
    m[r] = -INFINITY;
    lsum[r] = _mm512_setzero_ps();
  }
  const __m512 c2 = _mm512_set1_ps(p.scale * 1.4426950408889634f);  // scores to base-2 exponents
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const int64_t tiles = (pos0 + rows - 1) / kKeys + 1;
  alignas(64) uint32_t pp[R][kKeys / 2];  // P of the tile in bf16, a key pair per lane
  for (int64_t t = 0; t < tiles; ++t) {
    const uint32_t* kt = k_packed + t * kHalf * kKeys;
    __m512 lo[R], hi[R];  // scores of keys key0 .. key0 + 15 and key0 + 16 .. key0 + 31
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int i = 0; i < kHalf; ++i) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + i * kKeys);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + i * kKeys + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)bcast(q[r], i);
        lo[r] = _mm512_dpbf16_ps(lo[r], k0, qv);
        hi[r] = _mm512_dpbf16_ps(hi[r], k1, qv);
      }
    }
    const int64_t key0 = t * kKeys;
    for (int r = 0; r < R; ++r) {
      const __mmask16 keep_lo = visible_mask(pos[r], key0), keep_hi = visible_mask(pos[r], key0 + 16);
      const __m512 s_lo = _mm512_mask_blend_ps(keep_lo, neg_inf, _mm512_mul_ps(lo[r], c2));
      const __m512 s_hi = _mm512_mask_blend_ps(keep_hi, neg_inf, _mm512_mul_ps(hi[r], c2));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi)));
      if (m_new != m[r]) {  // rescale what was summed under the old maximum
        const __m512 a = _mm512_set1_ps(m[r] == -INFINITY ? 0.0f : std::exp2(m[r] - m_new));
        for (int c = 0; c < DCH; ++c) o[r][c] = _mm512_mul_ps(o[r][c], a);
        lsum[r] = _mm512_mul_ps(lsum[r], a);
        m[r] = m_new;
      }
      const __m512 mv = _mm512_set1_ps(m_new);
      const __m512 p_lo = _mm512_maskz_mov_ps(keep_lo, exp2_neg(_mm512_sub_ps(s_lo, mv)));
      const __m512 p_hi = _mm512_maskz_mov_ps(keep_hi, exp2_neg(_mm512_sub_ps(s_hi, mv)));
      // 32 bf16 in key order; the sum takes P as the PV product sees it: rounded to bf16
      const __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p_hi, p_lo);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pb, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pb, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(even, odd));
      _mm512_store_si512(reinterpret_cast<__m512i*>(pp[r]), pb);
    }
    const uint32_t* vt = v_packed + (key0 / 2) * (DCH * 16);
    for (int j = 0; j < kKeys / 2; ++j) {
      for (int c = 0; c < DCH; ++c) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + j * DCH * 16 + c * 16);
        for (int r = 0; r < R; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], v, (__m512bh)bcast(pp[r], j));
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));
    uint16_t* dst = out0 + r * q_stride;
    for (int c = 0; c < DCH; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], inv)));
  }
}

template <int DCH>
void attend(const Problem& p, int64_t threads) {
  constexpr int R = DCH >= 4 ? 16 / DCH : 4;  // O in 16 zmm at most, scores in 8
  const int64_t half = p.dim / 2;
  const int64_t tiles = (p.ctx_len + kKeys - 1) / kKeys;
  const int64_t k_lanes = tiles * half * kKeys;
  const int64_t v_lanes = tiles * kKeys / 2 * p.dim;
  std::unique_ptr<uint32_t[]> packed(new uint32_t[p.kv_heads * (k_lanes + v_lanes)]);
  const int64_t group = p.heads / p.kv_heads;
  const int64_t row_tiles = (p.q_len + R - 1) / R;
  const int64_t items = row_tiles * p.heads;
  const int64_t pos_base = p.ctx_len - p.q_len;
  const int64_t q_stride = p.heads * p.dim;
  threads = std::max<int64_t>(1, std::min(threads, items));
  std::atomic<int64_t> next_head{0}, next_item{0};
  auto work = [&]() {
    for (int64_t h = next_head.fetch_add(1); h < p.kv_heads; h = next_head.fetch_add(1))
      pack_head(p, h, packed.get() + h * (k_lanes + v_lanes), packed.get() + h * (k_lanes + v_lanes) + k_lanes);
#pragma omp barrier
    for (int64_t it = next_item.fetch_add(1); it < items; it = next_item.fetch_add(1)) {
      const int64_t tile = row_tiles - 1 - it / p.heads;  // the longest contexts first
      const int64_t head = it % p.heads;
      const int64_t kvh = head / group;
      const int64_t j0 = tile * R;
      const int rows = static_cast<int>(std::min<int64_t>(R, p.q_len - j0));
      const uint32_t* kp = packed.get() + kvh * (k_lanes + v_lanes);
      row_tile<R, DCH>(p, kp, kp + k_lanes, p.q + j0 * q_stride + head * p.dim, q_stride,
                       p.out + j0 * q_stride + head * p.dim, pos_base + j0, rows);
    }
  };
  if (threads == 1) {
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

void attend_any(const Problem& p, int64_t threads) {
  switch (p.dim) {
    case 32: attend<2>(p, threads); break;
    case 64: attend<4>(p, threads); break;
    case 128: attend<8>(p, threads); break;
    default: break;  // the front never sends another
  }
}

}  // namespace
#pragma GCC pop_options

// ------------------------------------------------------------------ module
namespace {

constexpr const char* kDoc =
    "prefill_attention(out, q, cache, block_table, num_blocks, block_size, q_len, ctx_len, heads,\\n"
    "kv_heads, dim, scale_bits, threads) -> None\\n"
    "Causal attention of q [q_len, heads, dim] over the first ctx_len keys of a paged bf16 cache\\n"
    "[num_blocks, 2, block_size, kv_heads, dim] read through block_table (int64), into out. Tensors\\n"
    "are data pointers; scale_bits is the fp32 scale's bit pattern. The block table is checked.";

PyObject* py_prefill_attention(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  constexpr int kArgs = 13;
  if (nargs != kArgs) {
    PyErr_SetString(PyExc_TypeError, "prefill_attention() takes 13 integer arguments");
    return nullptr;
  }
  long long v[kArgs];
  for (int i = 0; i < kArgs; ++i) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  if (g_isa != kIsaAvx512Bf16) {
    PyErr_SetString(PyExc_ValueError, "prefill_attention: this CPU has no AVX-512 BF16");
    return nullptr;
  }
  Problem p{};
  p.out = reinterpret_cast<uint16_t*>(v[0]);
  p.q = reinterpret_cast<const uint16_t*>(v[1]);
  p.cache = reinterpret_cast<const uint16_t*>(v[2]);
  p.block_table = reinterpret_cast<const int64_t*>(v[3]);
  p.num_blocks = v[4];
  p.block_size = v[5];
  p.q_len = v[6];
  p.ctx_len = v[7];
  p.heads = v[8];
  p.kv_heads = v[9];
  p.dim = v[10];
  uint32_t bits = static_cast<uint32_t>(v[11]);
  std::memcpy(&p.scale, &bits, sizeof(bits));
  const bool shape_ok = p.block_size > 0 && p.q_len > 0 && p.ctx_len >= p.q_len && p.kv_heads > 0 &&
                        p.heads % p.kv_heads == 0 && (p.dim == 32 || p.dim == 64 || p.dim == 128);
  if (!shape_ok) {
    PyErr_SetString(PyExc_ValueError, "prefill_attention: bad shape");
    return nullptr;
  }
  const int64_t nb = (p.ctx_len + p.block_size - 1) / p.block_size;
  for (int64_t i = 0; i < nb; ++i) {
    if (p.block_table[i] < 0 || p.block_table[i] >= p.num_blocks) {
      PyErr_Format(PyExc_IndexError, "prefill_attention: block %lld out of range", (long long)p.block_table[i]);
      return nullptr;
    }
  }
  Py_BEGIN_ALLOW_THREADS
  attend_any(p, v[12]);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyLong_FromLong(g_isa); }

PyMethodDef kMethods[] = {
    {"prefill_attention",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_prefill_attention)), METH_FASTCALL, kDoc},
    {"isa", py_isa, METH_NOARGS, "3 where the CPU has AVX-512 BF16 (the kernel's one path), else 0"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "splitserve_prefill",
                       "causal prefill attention over a paged bf16 KV cache (splitserve.engine.kernels)", -1,
                       kMethods};

}  // namespace

#define SPLITSERVE_CONCAT2(a, b) a##b
#define SPLITSERVE_CONCAT(a, b) SPLITSERVE_CONCAT2(a, b)
PyMODINIT_FUNC SPLITSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
