// y[B, N] = x[B, K] @ W[N, K]^T (+ bias) for small B, W in bf16 as nn.Linear
// stores it. Decode at small batch is bound by reading W, so the kernel's one
// job is to stream W once at close to memory bandwidth: each chunk of rows is
// read once and multiplied against every row of x while it sits in L1/L2.
//
// Access order matters more than anything else here. Reading several adjacent
// rows in lockstep (the textbook register tile) runs at under half of memory
// bandwidth on Zen 4: each row is a stream of only K*2 bytes and the hardware
// prefetchers never lock on. Instead a tile takes kRows rows that lie far
// apart, one from each quarter of the chunk, so the tile reads kRows long
// sequential streams, which the prefetchers follow at full speed, while x is
// still loaded once per kRows rows.
//
// Three code paths live in one binary, each compiled for its ISA with a
// `#pragma GCC target` region and picked at run time from the CPU:
//   3  AVX512-BF16: vdpbf16ps on bf16 x and bf16 W, fp32 accumulators
//   2  AVX512F:     W widened to fp32 by a 16-bit shift, fp32 FMA
//   1  AVX2+FMA:    the same, 8 lanes wide
// fp32 x always takes an FMA path (rounding x to bf16 would change the numbers).
// fp32 W (with fp32 x) takes the same FMA tiles, loading W as it is: the same
// far-apart streams and 256 KB chunks, twice the bytes per weight.
//
// Threads: an OpenMP team of the size the caller passes (torch's thread
// count). libgomp.so.1 resolves to the copy torch already loaded, so this is
// torch's runtime and pool, not a second one. Rows go out in chunks from an
// atomic counter, so a thread that starts late (its core busy) takes fewer.
//
// The module is plain CPython over raw pointers, no torch or pybind11 headers:
// it compiles in a few seconds rather than the 30-80 s that <torch/extension.h>
// costs on a small machine, and a call costs about a microsecond. The Python front (linear.py) owns every check of
// dtype, shape, contiguity and device before it hands pointers over.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace {

constexpr int kIsaNone = 0;
constexpr int kIsaAvx2 = 1;
constexpr int kIsaAvx512 = 2;
constexpr int kIsaAvx512Bf16 = 3;

int detect_isa() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the zmm/ymm state.
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kIsaAvx512Bf16;
  if (avx512) return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
  return kIsaNone;
}

// One problem, as raw pointers. x is bf16 bits on the dpbf16 path and fp32 on
// the FMA paths (bf16 x is widened once, up front: it is B*K, W is N*K).
struct Problem {
  const void* w;  // bf16 bits, or fp32 if w_f32
  bool w_f32;     // then x and y are fp32 too
  int64_t n, k;
  const void* x;
  int64_t b;
  const uint16_t* bias_bf16;  // at most one of the two biases is set
  const float* bias_f32;
  void* y;
  bool y_bf16;
  bool x_bf16;
};

inline float bf16_bits_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

// Adds the bias to one chunk's results, buf[b][0..rows) for W rows n0.., and
// writes them to y. y's rows are written here in one contiguous run each,
// never from inside the tiles: with N*2 bytes a multiple of 4 KB (lm_head),
// stores that hop between rows of y all land in one L1 set and thrash it.
inline void store_chunk(const Problem& p, int64_t n0, int64_t rows, float* buf) {
  for (int64_t b = 0; b < p.b; ++b) {
    float* src = buf + b * rows;  // scratch: the bias is added in place
    if (p.bias_f32)
      for (int64_t j = 0; j < rows; ++j) src[j] += p.bias_f32[n0 + j];
    if (p.bias_bf16)
      for (int64_t j = 0; j < rows; ++j) src[j] += bf16_bits_to_float(p.bias_bf16[n0 + j]);
    if (p.y_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(p.y) + b * p.n + n0;
      for (int64_t j = 0; j < rows; ++j) dst[j] = float_to_bf16_bits(src[j]);
    } else {
      float* dst = static_cast<float*>(p.y) + b * p.n + n0;
      for (int64_t j = 0; j < rows; ++j) dst[j] = src[j];
    }
  }
}

// Rows per tile (sequential streams read at once). Four streams keep the
// prefetchers on track and, with up to 6 rows of x, fit 24 zmm accumulators.
constexpr int kRows = 4;

}  // namespace

// Each ISA section defines tile<R, BT>(w, row_stride, k, x, out):
//   out[b * R + r] = dot(W row at w + r * row_stride, x row b), b < BT, r < R
// and run_tile(), which dispatches a runtime (rows, bt) pair to it.

// ------------------------------------------------------- AVX-512 reductions
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
namespace avx512_common {

// Sums each of a, b, c, d and stores the four totals to out[0..3]; cheaper
// than four _mm512_reduce_add_ps because the shuffles are shared.
inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: t0 = [a02 b02 a13 b13], t1 = [c02 d02 c13 d13]
  __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  // per lane: [a b c d]; now add the four lanes
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, q);
}

// Every row is reduced in reduce4's order, the leftover rows of a chunk too,
// so a row's bits never depend on how rows were cut into chunks and tiles.
template <int R>
inline void reduce_rows(const __m512* acc, float* out) {
  if constexpr (R % 4 == 0) {
    for (int r = 0; r < R; r += 4) reduce4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], out + r);
  } else {
    for (int r = 0; r < R; ++r) {
      float four[4];
      reduce4(acc[r], acc[r], acc[r], acc[r], four);
      out[r] = four[0];
    }
  }
}

}  // namespace avx512_common
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX512-BF16
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,avx2")
namespace isa_bf16 {

constexpr int kMaxBt = 6;

template <int R, int BT>
void tile(const uint16_t* w, int64_t row_stride, int64_t k_len, const uint16_t* x, float* out) {
  __m512 acc[BT][R];
  for (int b = 0; b < BT; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k_len; k += 32) {
    __m512i xv[BT];
    for (int b = 0; b < BT; ++b) xv[b] = _mm512_loadu_si512(x + b * k_len + k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * row_stride + k);
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)xv[b]);
    }
  }
  if (k < k_len) {  // masked tail: the missing lanes load as zero and add nothing
    __mmask32 m = _cvtu32_mask32((1u << (k_len - k)) - 1u);
    __m512i xv[BT];
    for (int b = 0; b < BT; ++b) xv[b] = _mm512_maskz_loadu_epi16(m, x + b * k_len + k);
    for (int r = 0; r < R; ++r) {
      __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * row_stride + k);
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)xv[b]);
    }
  }
  for (int b = 0; b < BT; ++b) avx512_common::reduce_rows<R>(acc[b], out + b * R);
}

template <int R>
void tile_bt(int bt, const uint16_t* w, int64_t stride, int64_t k, const uint16_t* x, float* out) {
  switch (bt) {
    case 1: return tile<R, 1>(w, stride, k, x, out);
    case 2: return tile<R, 2>(w, stride, k, x, out);
    case 3: return tile<R, 3>(w, stride, k, x, out);
    case 4: return tile<R, 4>(w, stride, k, x, out);
    case 5: return tile<R, 5>(w, stride, k, x, out);
    default: return tile<R, 6>(w, stride, k, x, out);
  }
}

void run_tile(const Problem& p, int64_t n0, int64_t row_step, int64_t b0, int rows, int bt, float* out) {
  const uint16_t* w = static_cast<const uint16_t*>(p.w) + n0 * p.k;
  const uint16_t* x = static_cast<const uint16_t*>(p.x) + b0 * p.k;
  if (rows == kRows) return tile_bt<kRows>(bt, w, row_step * p.k, p.k, x, out);
  return tile_bt<1>(bt, w, 0, p.k, x, out);
}

}  // namespace isa_bf16
#pragma GCC pop_options

// ------------------------------------------------------------- AVX512F fp32
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")
namespace isa_avx512 {

constexpr int kMaxBt = 6;

// 16 weights as fp32: bf16 widened by a 16-bit shift, fp32 loaded as they are.
inline __m512 load_w(const uint16_t* w) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_w(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load_w_masked(__mmask16 m, const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w)), 16));
}
inline __m512 load_w_masked(__mmask16 m, const float* w) { return _mm512_maskz_loadu_ps(m, w); }

// WT = uint16_t (bf16 W) or float (fp32 W). One accumulator per (x row, W
// row), 16 lanes each, reduced in reduce4's order: the same sequence of
// roundings for a row whatever BT and R, so batch composition never shows.
template <typename WT, int R, int BT>
void tile(const WT* w, int64_t row_stride, int64_t k_len, const float* x, float* out) {
  __m512 acc[BT][R];
  for (int b = 0; b < BT; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= k_len; k += 16) {
    __m512 xv[BT];
    for (int b = 0; b < BT; ++b) xv[b] = _mm512_loadu_ps(x + b * k_len + k);
    for (int r = 0; r < R; ++r) {
      __m512 wv = load_w(w + r * row_stride + k);
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm512_fmadd_ps(wv, xv[b], acc[b][r]);
    }
  }
  if (k < k_len) {
    __mmask16 m = _cvtu32_mask16((1u << (k_len - k)) - 1u);
    __m512 xv[BT];
    for (int b = 0; b < BT; ++b) xv[b] = _mm512_maskz_loadu_ps(m, x + b * k_len + k);
    for (int r = 0; r < R; ++r) {
      __m512 wv = load_w_masked(m, w + r * row_stride + k);
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm512_fmadd_ps(wv, xv[b], acc[b][r]);
    }
  }
  for (int b = 0; b < BT; ++b) avx512_common::reduce_rows<R>(acc[b], out + b * R);
}

template <int R, typename WT>
void tile_bt(int bt, const WT* w, int64_t stride, int64_t k, const float* x, float* out) {
  switch (bt) {
    case 1: return tile<WT, R, 1>(w, stride, k, x, out);
    case 2: return tile<WT, R, 2>(w, stride, k, x, out);
    case 3: return tile<WT, R, 3>(w, stride, k, x, out);
    case 4: return tile<WT, R, 4>(w, stride, k, x, out);
    case 5: return tile<WT, R, 5>(w, stride, k, x, out);
    default: return tile<WT, R, 6>(w, stride, k, x, out);
  }
}

template <typename WT>
void run_tile(const Problem& p, int64_t n0, int64_t row_step, int64_t b0, int rows, int bt, float* out) {
  const WT* w = static_cast<const WT*>(p.w) + n0 * p.k;
  const float* x = static_cast<const float*>(p.x) + b0 * p.k;
  if (rows == kRows) return tile_bt<kRows>(bt, w, row_step * p.k, p.k, x, out);
  return tile_bt<1>(bt, w, 0, p.k, x, out);
}

}  // namespace isa_avx512
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX2 fp32
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace isa_avx2 {

constexpr int kMaxBt = 2;  // 16 ymm registers: 4 rows x 2 rows of x in accumulators

inline __m256 load_w(const uint16_t* w) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load_w(const float* w) { return _mm256_loadu_ps(w); }
inline float w_at(const uint16_t* w) { return bf16_bits_to_float(*w); }
inline float w_at(const float* w) { return *w; }

inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

template <typename WT, int R, int BT>
void tile(const WT* w, int64_t row_stride, int64_t k_len, const float* x, float* out) {
  __m256 acc[BT][R];
  for (int b = 0; b < BT; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= k_len; k += 8) {
    __m256 xv[BT];
    for (int b = 0; b < BT; ++b) xv[b] = _mm256_loadu_ps(x + b * k_len + k);
    for (int r = 0; r < R; ++r) {
      __m256 wv = load_w(w + r * row_stride + k);
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm256_fmadd_ps(wv, xv[b], acc[b][r]);
    }
  }
  for (int b = 0; b < BT; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[b][r]);
      for (int64_t kk = k; kk < k_len; ++kk) s += w_at(w + r * row_stride + kk) * x[b * k_len + kk];
      out[b * R + r] = s;
    }
  }
}

template <int R, typename WT>
void tile_bt(int bt, const WT* w, int64_t stride, int64_t k, const float* x, float* out) {
  if (bt == 1) return tile<WT, R, 1>(w, stride, k, x, out);
  return tile<WT, R, 2>(w, stride, k, x, out);
}

template <typename WT>
void run_tile(const Problem& p, int64_t n0, int64_t row_step, int64_t b0, int rows, int bt, float* out) {
  const WT* w = static_cast<const WT*>(p.w) + n0 * p.k;
  const float* x = static_cast<const float*>(p.x) + b0 * p.k;
  if (rows == kRows) return tile_bt<kRows>(bt, w, row_step * p.k, p.k, x, out);
  return tile_bt<1>(bt, w, 0, p.k, x, out);
}

}  // namespace isa_avx2
#pragma GCC pop_options

// ------------------------------------------------------------------ driver
namespace {

using RunTile = void (*)(const Problem&, int64_t, int64_t, int64_t, int, int, float*);

struct IsaPlan {
  RunTile run_tile;
  int max_bt;
};

IsaPlan plan_for(int isa, bool w_f32) {
  if (w_f32)
    return isa >= kIsaAvx512 ? IsaPlan{isa_avx512::run_tile<float>, isa_avx512::kMaxBt}
                             : IsaPlan{isa_avx2::run_tile<float>, isa_avx2::kMaxBt};
  switch (isa) {
    case kIsaAvx512Bf16: return {isa_bf16::run_tile, isa_bf16::kMaxBt};
    case kIsaAvx512: return {isa_avx512::run_tile<uint16_t>, isa_avx512::kMaxBt};
    default: return {isa_avx2::run_tile<uint16_t>, isa_avx2::kMaxBt};
  }
}

// Rows [n0, n1) of W against every row of x, through buf (B * (n1 - n0)
// floats). The chunk is cut into kRows quarters read side by side (see the
// top of the file); the rows left over go one at a time. The chunk stays in
// L2, so batch tiles after the first re-read W from cache, not DRAM.
void run_rows(const Problem& p, const IsaPlan& plan, int64_t n0, int64_t n1, float* buf) {
  float out[kRows * 8];
  const int64_t rows = n1 - n0;
  const int64_t quarter = rows / kRows;
  const int64_t n_bt = (p.b + plan.max_bt - 1) / plan.max_bt;
  const int64_t bt_size = (p.b + n_bt - 1) / n_bt;  // balanced: 8 rows of x -> 4+4, not 6+2
  for (int64_t b0 = 0; b0 < p.b; b0 += bt_size) {
    int bt = static_cast<int>(std::min(bt_size, p.b - b0));
    for (int64_t i = 0; i < quarter; ++i) {
      plan.run_tile(p, n0 + i, quarter, b0, kRows, bt, out);
      for (int b = 0; b < bt; ++b)
        for (int r = 0; r < kRows; ++r) buf[(b0 + b) * rows + i + r * quarter] = out[b * kRows + r];
    }
    for (int64_t i = kRows * quarter; i < rows; ++i) {
      plan.run_tile(p, n0 + i, 0, b0, 1, bt, out);
      for (int b = 0; b < bt; ++b) buf[(b0 + b) * rows + i] = out[b];
    }
  }
  store_chunk(p, n0, rows, buf);
}

// Rows per chunk. Long chunks keep the prefetchers locked on: a 256 KB chunk
// is four 64 KB streams, and on Zen 4 one thread streams B=1 at ~23 GB/s with
// those against ~19 GB/s with 64 KB chunks. With several threads a matrix is
// cut finer, to at least 4 chunks per thread (down to 64 KB), so that the
// dynamic hand-out can balance it. A chunk also fits in L2 for batch tiles.
int64_t chunk_rows(int64_t n, int64_t k, int64_t elem_bytes, int64_t threads) {
  const int64_t row_bytes = std::max<int64_t>(1, elem_bytes * k);
  int64_t bytes = 256 * 1024;
  if (threads > 1) bytes = std::clamp<int64_t>(n * row_bytes / (4 * threads), 64 * 1024, bytes);
  const int64_t rows = (bytes / row_bytes + kRows - 1) / kRows * kRows;
  return std::clamp<int64_t>(rows, kRows, 4096);
}

// Below this much of W, waking a second thread costs more than it saves.
constexpr int64_t kParallelMinBytes = 256 * 1024;

const int g_isa = detect_isa();

void linear(Problem p, int isa, int64_t threads) {
  if (p.k == 0) {  // y = bias (or 0); the front sends these to F.linear, but stay correct
    std::unique_ptr<float[]> zeros(new float[p.b * p.n]());
    store_chunk(p, 0, p.n, zeros.get());
    return;
  }
  // dpbf16 wants bf16 x; the FMA paths want fp32 x. x is B*K: cheap to widen.
  std::unique_ptr<float[]> x_f32;
  if (p.x_bf16 && isa != kIsaAvx512Bf16) {
    x_f32.reset(new float[p.b * p.k]);
    const uint16_t* src = static_cast<const uint16_t*>(p.x);
    for (int64_t i = 0; i < p.b * p.k; ++i) x_f32[i] = bf16_bits_to_float(src[i]);
    p.x = x_f32.get();
  }
  const IsaPlan plan = plan_for(isa, p.w_f32);
  const int64_t elem_bytes = p.w_f32 ? 4 : 2;
  if (p.n * p.k * elem_bytes < kParallelMinBytes || omp_in_parallel()) threads = 1;
  threads = std::max<int64_t>(1, threads);
  const int64_t rows_per_chunk = chunk_rows(p.n, p.k, elem_bytes, threads);
  const int64_t n_chunks = (p.n + rows_per_chunk - 1) / rows_per_chunk;
  threads = std::min(threads, n_chunks);
  std::atomic<int64_t> next{0};
  auto work = [&]() {
    std::unique_ptr<float[]> buf(new float[p.b * rows_per_chunk]);
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < n_chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      int64_t r0 = c * rows_per_chunk;
      run_rows(p, plan, r0, std::min(p.n, r0 + rows_per_chunk), buf.get());
    }
  };
  if (threads == 1) {
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

}  // namespace

// ------------------------------------------------------------------ module
namespace {

constexpr const char* kLinearDoc =
    "linear(y, x, w, bias, b, n, k, x_fp32, bias_kind, threads, isa, w_fp32) -> None\\n"
    "y[b,n] = x[b,k] @ w[n,k]^T (+ bias), all arguments ints; the tensors are data pointers\\n"
    "of contiguous CPU tensors: w bf16, or fp32 if w_fp32 (then x_fp32 must be set too);\\n"
    "x and y bf16, or fp32 if x_fp32; bias_kind 0 none,\\n"
    "1 bf16, 2 fp32; isa 0 picks the best the CPU has. Nothing is checked: the caller does.";

PyObject* py_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "linear() takes 12 integer arguments");
    return nullptr;
  }
  long long v[12];
  for (int i = 0; i < 12; ++i) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  int isa = static_cast<int>(v[10]);
  if (g_isa == kIsaNone || isa < 0 || isa > g_isa) {
    PyErr_Format(PyExc_ValueError, "linear: ISA level %d not available (this CPU: %d)", isa, g_isa);
    return nullptr;
  }
  if (isa == 0) isa = g_isa;
  Problem p{};
  p.y = reinterpret_cast<void*>(v[0]);
  p.x = reinterpret_cast<const void*>(v[1]);
  p.w = reinterpret_cast<const void*>(v[2]);
  p.w_f32 = v[11] != 0;
  p.b = v[4];
  p.n = v[5];
  p.k = v[6];
  p.x_bf16 = v[7] == 0;
  if (p.w_f32 && p.x_bf16) {
    PyErr_SetString(PyExc_ValueError, "linear: fp32 w takes fp32 x");
    return nullptr;
  }
  p.y_bf16 = p.x_bf16;
  if (v[8] == 1) p.bias_bf16 = reinterpret_cast<const uint16_t*>(v[3]);
  if (v[8] == 2) p.bias_f32 = reinterpret_cast<const float*>(v[3]);
  if (!p.x_bf16) isa = std::min(isa, kIsaAvx512);
  if (p.b <= 0 || p.n <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  linear(p, isa, v[9]);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyLong_FromLong(g_isa); }

PyMethodDef kMethods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_linear)), METH_FASTCALL, kLinearDoc},
    {"isa", py_isa, METH_NOARGS, "ISA level of this CPU: 0 none, 1 AVX2+FMA, 2 AVX-512F, 3 AVX-512 BF16"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "splitserve_linear",
                       "bf16-weight matrix-vector kernel for small-batch decode (splitserve.engine.kernels)",
                       -1, kMethods};

}  // namespace

#define SPLITSERVE_CONCAT2(a, b) a##b
#define SPLITSERVE_CONCAT(a, b) SPLITSERVE_CONCAT2(a, b)
PyMODINIT_FUNC SPLITSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
