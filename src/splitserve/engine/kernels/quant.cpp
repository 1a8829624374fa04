// y[B, N] = x[B, K] @ W[N, K]^T where W stays in a GGUF block format (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): the bytes the user's file holds, never a
// dequantized copy. Decode on a CPU is bound by reading W, and a Q4 block is a
// quarter of bf16's bytes and an eighth of fp32's.
//
// Two ways to multiply, chosen per call (`exact`):
//
// - exact (what the engine runs): each weight block is unpacked in registers to 32 small
//   integers, w = d * (q - off) + m in fp32, and multiplied into x as it is with FMAs. The
//   result is the float matmul's on the dequantized weights, to fp32 rounding.
// - int8 (llama.cpp's vec_dot): each row of x is quantized once per call to int8 in blocks of 32
//   (one scale per block, and d times the integer sum of each half), and a block's dot is
//   integer products (vpmaddubsw + vpmaddwd on AVX2, one vpdpbusd with AVX-512 VNNI), scaled once:
//       sum(w * x) = dx * (d_lo * I_lo + d_hi * I_hi) + (m - off * d) * dx * S
//   with I the int dot of each 16-byte half and S the half's sum of x's ints.
//   Side by side on the embedded model (AVX-512 VNNI, 2 cores), it was no faster at batch 1
//   (15.9 against 15.8 ms a token), slower at 4 and 8 (each further row costs ~6 vector
//   instructions a block here against exact's 2 FMAs), and rounding x cost a few points of
//   teacher-forced top-1 agreement with the float model. It stays, tested, for the comparison.
//
// Every format's block is a unit of 32 (a K-quant super-block of 256 is eight), with per-16
// scales d_lo/d_hi (Q6_K's; every other format has d_lo == d_hi), an offset and a min.
//
// Batched decode shares each weight block across the rows of x: a block is
// unpacked once and used by up to 16 rows at a time, so W is read once per
// call whatever B is. With bf16 x on AVX-512 BF16, past kFusedRows rows a chunk of W is
// unpacked once into bf16 scratch and multiplied by linear.cpp's register tiles (path_bf16), up
// to a decode worker's 512-row chunk (quant.py's TILE_MAX_ROWS).
//
// Determinism: a row's result is one thread's sum over the blocks in order, in fixed lanes
// (int8: x's rows quantized each on its own), whatever the thread count or the other rows of x, so a seed gives
// the same tokens on a quiet and a busy machine and alone or in a batch. On the bf16 path both
// ways (in registers, through scratch) give a row the same bits, and they are the dense bf16
// kernel's (linear.cpp) on the dequantized weights: the same values, lanes and reduction order.
// Different paths (scalar, AVX2, AVX-512) round differently.
//
// Paths, picked by the CPU's flags at run time: 0 scalar (any x86-64; the
// reference the SIMD paths are tested against), 1 AVX2+FMA+F16C (8 lanes), 2 AVX-512 with
// VNNI (16 lanes in the exact mode; the 256-bit vpdpbusd of AVX512VL in the int8 mode). The two SIMD paths are one body compiled twice under
// `#pragma GCC target` (this file includes itself), so the binary runs on every
// x86-64 machine. AMX is not used: at decode's few rows its tiles are mostly
// empty, and prefill dequantizes a matrix into oneDNN's GEMM instead.
//
// Plain CPython over raw pointers, as linear.cpp: the Python front (quant.py)
// checks every dtype, shape and length before handing pointers over.

#ifndef SPLITSERVE_QUANT_BODY

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// GGML's type numbers, as GGUF files write them
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

// (elements, bytes) per block of each format
inline int block_elems(int fmt) { return fmt >= kQ4_K ? 256 : 32; }
inline int block_bytes(int fmt) {
  switch (fmt) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      u = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float rd_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

inline float bf16_to_float(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)rounded;
}

// A K-quant's 6-bit scale and min of sub-block j (0..7), ggml's get_scale_min_k4
inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// What one 32-element block of a weight row means: w = d * (q - off) + m, with
// d and m per 16-element half (d_lo for elements 0..15, d_hi for 16..31).
struct BlockScale {
  float d_lo, d_hi, m_lo, m_hi;
  int off;
};

// The scales of 32-block `kb` of a row in format FMT (row: the row's first byte).
template <int FMT>
inline BlockScale block_scale(const uint8_t* row, int64_t kb) {
  if constexpr (FMT == kQ4_0 || FMT == kQ5_0 || FMT == kQ8_0) {
    float d = rd_half(row + kb * block_bytes(FMT));
    return {d, d, 0.f, 0.f, FMT == kQ4_0 ? 8 : (FMT == kQ5_0 ? 16 : 0)};
  } else if constexpr (FMT == kQ4_1 || FMT == kQ5_1) {
    const uint8_t* b = row + kb * block_bytes(FMT);
    float d = rd_half(b), m = rd_half(b + 2);
    return {d, d, m, m, 0};
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int sc, mn;
    scale_min_k4((int)(kb & 7), b + 4, &sc, &mn);
    float d = rd_half(b) * (float)sc, m = -rd_half(b + 2) * (float)mn;
    return {d, d, m, m, 0};
  } else {  // Q6_K: ql[128] qh[64] scales[16] (int8) d
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    float d = rd_half(b + 208);
    int c = (int)(kb & 7), half = c >> 2, cc = c & 3;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * cc;
    return {d * (float)sc[0], d * (float)sc[1], 0.f, 0.f, 32};
  }
}

// The 32 unsigned values q of block `kb` (Q8_0: the signed int8 values), scalar.
template <int FMT>
inline void block_values(const uint8_t* row, int64_t kb, uint8_t* q) {
  if constexpr (FMT == kQ4_0 || FMT == kQ4_1) {
    const uint8_t* qs = row + kb * block_bytes(FMT) + (FMT == kQ4_0 ? 2 : 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = qs[j] & 0xF;
      q[j + 16] = qs[j] >> 4;
    }
  } else if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {
    const uint8_t* b = row + kb * block_bytes(FMT) + (FMT == kQ5_0 ? 2 : 4);
    uint32_t qh;
    std::memcpy(&qh, b, 4);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      q[j] = (uint8_t)((qs[j] & 0xF) | (((qh >> j) & 1u) << 4));
      q[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    }
  } else if constexpr (FMT == kQ8_0) {
    std::memcpy(q, row + kb * block_bytes(FMT) + 2, 32);
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int c = (int)(kb & 7);
    const uint8_t* ql = b + (FMT == kQ4_K ? 16 : 48) + 32 * (c >> 1);
    int shift = (c & 1) * 4;
    for (int l = 0; l < 32; ++l) {
      uint8_t v = (uint8_t)((ql[l] >> shift) & 0xF);
      if constexpr (FMT == kQ5_K) v |= (uint8_t)(((b[16 + l] >> c) & 1) << 4);
      q[l] = v;
    }
  } else {  // Q6_K
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int c = (int)(kb & 7), half = c >> 2, cc = c & 3;
    const uint8_t* ql = b + 64 * half + 32 * (cc & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    int shift = (cc >> 1) * 4;
    for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * cc)) & 3) << 4));
  }
}

// One row of x quantized to int8 in blocks of 32: q = round(x / d), d = amax / 127,
// with d times the integer sum of each half and of the whole (for offsets and mins).
struct XBlock {
  int8_t q[32];
  float d, s_lo, s_hi, s;
};

void quantize_row_scalar(const float* x, int64_t k, XBlock* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    const float* v = x + kb * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    XBlock& xb = out[kb];
    float d = amax / 127.f, inv = d > 0.f ? 127.f / amax : 0.f;
    int s_lo = 0, s_hi = 0;
    for (int j = 0; j < 32; ++j) {
      int qv = (int)std::nearbyint(v[j] * inv);
      xb.q[j] = (int8_t)qv;
      (j < 16 ? s_lo : s_hi) += qv;
    }
    xb.d = d;
    xb.s_lo = d * (float)s_lo;
    xb.s_hi = d * (float)s_hi;
    xb.s = d * (float)(s_lo + s_hi);
  }
}

// The scalar reference: out[r] = dot(W row, x row r) for `rows` rows of x.
template <int FMT>
void row_dot_scalar(const uint8_t* row, int64_t nb, const XBlock* const* xs, int rows, float* out) {
  for (int r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t kb = 0; kb < nb; ++kb) {
      uint8_t q[32];
      block_values<FMT>(row, kb, q);
      BlockScale s = block_scale<FMT>(row, kb);
      const XBlock& xb = xs[r][kb];
      int i_lo = 0, i_hi = 0;
      for (int j = 0; j < 16; ++j) {
        int w0 = FMT == kQ8_0 ? (int)(int8_t)q[j] : (int)q[j];
        int w1 = FMT == kQ8_0 ? (int)(int8_t)q[j + 16] : (int)q[j + 16];
        i_lo += w0 * xb.q[j];
        i_hi += w1 * xb.q[j + 16];
      }
      acc += xb.d * (s.d_lo * (float)i_lo + s.d_hi * (float)i_hi) + (s.m_lo - (float)s.off * s.d_lo) * xb.s_lo +
             (s.m_hi - (float)s.off * s.d_hi) * xb.s_hi;
    }
    out[r] = acc;
  }
}

// The scalar reference of the exact mode: x as it is, each block dequantized and multiplied in fp32.
template <int FMT>
void row_dot_f32_scalar(const uint8_t* row, int64_t nb, const float* const* xs, int rows, float* out) {
  for (int r = 0; r < rows; ++r) out[r] = 0.f;
  for (int64_t kb = 0; kb < nb; ++kb) {
    uint8_t q[32];
    block_values<FMT>(row, kb, q);
    BlockScale s = block_scale<FMT>(row, kb);
    float w[32];
    for (int j = 0; j < 32; ++j) {
      int v = FMT == kQ8_0 ? (int)(int8_t)q[j] : (int)q[j] - s.off;
      w[j] = (j < 16 ? s.d_lo : s.d_hi) * (float)v + (j < 16 ? s.m_lo : s.m_hi);
    }
    for (int r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int j = 0; j < 32; ++j) acc += w[j] * xs[r][kb * 32 + j];
      out[r] += acc;
    }
  }
}

// w = d * (q - off) + m, exactly as ggml's dequantize_row computes it
template <int FMT>
void dequantize_row(const uint8_t* row, int64_t k, float* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    uint8_t q[32];
    block_values<FMT>(row, kb, q);
    BlockScale s = block_scale<FMT>(row, kb);
    for (int j = 0; j < 32; ++j) {
      int v = FMT == kQ8_0 ? (int)(int8_t)q[j] : (int)q[j] - s.off;
      float d = j < 16 ? s.d_lo : s.d_hi, m = j < 16 ? s.m_lo : s.m_hi;
      // a format without a min is d * q alone, as ggml computes it: + 0.0 would turn its -0.0 to +0.0
      constexpr bool has_min = FMT == kQ4_1 || FMT == kQ5_1 || FMT == kQ4_K || FMT == kQ5_K;
      out[kb * 32 + j] = has_min ? d * (float)v + m : d * (float)v;
    }
  }
}

// W rows [0, rows) against every one of b rows of x in register tiles: R rows of W by up to BT rows
// of x, the rows of x cut evenly (8 rows -> 4 + 4, not 6 + 2), the rows of W left over one at a time.
// tile(r_n, bt, i, b0, out) fills out[bb * r_n + r] for W row i + r and x row b0 + bb; put(x row, W
// row, value) stores each. Inlined into each SIMD path's caller, whose target the tiles need.
template <int R, int BT, typename Tile, typename Put>
__attribute__((always_inline)) inline void over_tiles(int64_t rows, int64_t b, Tile tile, Put put) {
  const int64_t n_bt = (b + BT - 1) / BT;
  const int64_t bt_size = (b + n_bt - 1) / n_bt;
  float out[R * BT];
  for (int64_t i = 0; i < rows;) {
    const int r_n = rows - i >= R ? R : 1;
    for (int64_t b0 = 0; b0 < b; b0 += bt_size) {
      const int bt = (int)std::min(bt_size, b - b0);
      tile(r_n, bt, i, b0, out);
      for (int bb = 0; bb < bt; ++bb)
        for (int r = 0; r < r_n; ++r) put(b0 + bb, i + r, out[bb * r_n + r]);
    }
    i += r_n;
  }
}

constexpr int kIsaScalar = 0, kIsaAvx2 = 1, kIsaVnni = 2;

int detect_isa() {
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
    return kIsaVnni;
  return avx2 ? kIsaAvx2 : kIsaScalar;
}

}  // namespace

// The SIMD body, compiled once per target.
#define SPLITSERVE_QUANT_BODY
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace path_avx2 {
#define SPLITSERVE_VNNI 0
#include __FILE__
#undef SPLITSERVE_VNNI
}  // namespace path_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace path_vnni {
#define SPLITSERVE_VNNI 1
#include __FILE__
#undef SPLITSERVE_VNNI
}  // namespace path_vnni
#pragma GCC pop_options
#undef SPLITSERVE_QUANT_BODY

// bf16 x on a CPU with AVX-512 BF16: each block dequantized in registers (path_vnni::block_w),
// rounded to bf16 once and multiplied into every row with vdpbf16ps, 32 products an instruction
// (twice the fp32 FMA's). A bf16 model's x is bf16 already and its dense weights are the same
// values rounded to bf16, so this is the dense bf16 model's arithmetic on a quarter of its bytes.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx512bf16")
namespace path_bf16 {

// The sums of a, b, c and d into out[0..3] (linear.cpp's reduce4: the same adds in the same order)
inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, q);
}

// out[b * R + r] = W row r (packed blocks, rows row_bytes apart) . x row b (ldx apart), b < BT: each
// block unpacked in registers once for the BT rows of x. R rows of W side by side give R independent
// chains of vdpbf16ps (one row alone waited on each product's latency: 12 cycles a block where the
// unpacking takes 4), and the sums are the tiles' (tile below): the same values, order and reduce4.
template <int FMT, int R, int BT>
void packed_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const uint16_t* x, int64_t ldx, float* out) {
  __m512 acc[BT][R];
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = w + r * row_bytes;
      _mm_prefetch(reinterpret_cast<const char*>(row + kb * block_bytes(FMT) * 32 / block_elems(FMT)) + 1024,
                   _MM_HINT_T0);
      __m512 w0, w1;
      path_vnni::block_w<FMT, true>(row, kb, w0, w1);  // the dequantized model's values
      const __m512bh wv = _mm512_cvtne2ps_pbh(w1, w0);  // elements 0..15 from w0, 16..31 from w1: x's order
#pragma GCC unroll 8
      for (int b = 0; b < BT; ++b)
        acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)_mm512_loadu_si512(x + b * ldx + kb * 32));
    }
  }
  float four[4];
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b) {
    if constexpr (R == 4) {
      reduce4(acc[b][0], acc[b][1], acc[b][2], acc[b][3], out + b * R);
    } else {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        reduce4(acc[b][r], acc[b][r], acc[b][r], acc[b][r], four);
        out[b * R + r] = four[0];
      }
    }
  }
}

template <int FMT, int R>
void packed_tile_bt(int bt, const uint8_t* w, int64_t row_bytes, int64_t nb, const uint16_t* x, int64_t ldx,
                    float* out) {
  switch (bt) {
    case 1: return packed_tile<FMT, R, 1>(w, row_bytes, nb, x, ldx, out);
    case 2: return packed_tile<FMT, R, 2>(w, row_bytes, nb, x, ldx, out);
    case 3: return packed_tile<FMT, R, 3>(w, row_bytes, nb, x, ldx, out);
    case 4: return packed_tile<FMT, R, 4>(w, row_bytes, nb, x, ldx, out);
    case 5: return packed_tile<FMT, R, 5>(w, row_bytes, nb, x, ldx, out);
    case 6: return packed_tile<FMT, R, 6>(w, row_bytes, nb, x, ldx, out);
    case 7: return packed_tile<FMT, R, 7>(w, row_bytes, nb, x, ldx, out);
    default: return packed_tile<FMT, R, 8>(w, row_bytes, nb, x, ldx, out);
  }
}

// y[b * ldy + j] (bf16) for packed W rows j < rows and every row of x (b <= 8: kFusedRows): four rows
// of W at a time up to 4 rows of x, two past that (16 accumulators), the rows left one at a time.
template <int FMT>
void packed_rows(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t k, const uint16_t* x, int64_t b,
                 uint16_t* y, int64_t ldy) {
  const int wide = b <= 4 ? 4 : 2;
  const int bt = (int)std::min<int64_t>(b, 8);
  float out[4 * 8];
  for (int64_t i = 0; i < rows;) {
    const int r_n = rows - i >= wide ? wide : 1;
    const uint8_t* wi = w + i * row_bytes;
    if (r_n == 4) {
      packed_tile_bt<FMT, 4>(bt, wi, row_bytes, k / 32, x, k, out);
    } else if (r_n == 2) {
      packed_tile_bt<FMT, 2>(bt, wi, row_bytes, k / 32, x, k, out);
    } else {
      packed_tile_bt<FMT, 1>(bt, wi, row_bytes, k / 32, x, k, out);
    }
    for (int bb = 0; bb < bt; ++bb)
      for (int r = 0; r < r_n; ++r) y[bb * ldy + i + r] = float_to_bf16(out[bb * r_n + r]);
    i += r_n;
  }
}

// A row dequantized to bf16: ggml's values (block_w's GGML rounding), rounded to nearest even by
// vcvtne2ps2bf16 in one instruction (dequantize_row_simd_bf16's bits: the values are finite, and
// normal or zero, so its implied flush of denormals never applies).
template <int FMT>
void dequantize_row_bf16(const uint8_t* row, int64_t k, uint16_t* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    __m512 w0, w1;
    path_vnni::block_w<FMT, true>(row, kb, w0, w1);
    _mm512_storeu_si512(out + kb * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

// Past a few rows of x, unpacking every block again for each tile of 16 rows costs more than the
// blocks save (0.64x the dense bf16 kernel at 8 rows, 0.45x at 256). So a chunk of W's rows is
// unpacked once, into the thread's scratch in bf16 (the dense model's very weights: the same
// expression, rounded to nearest even as the inflating load rounds), and multiplied into every row
// of x by linear.cpp's tile: 4 rows of W against up to 6 rows of x, 24 accumulators, each W vector
// loaded once for the 6 rows and each x vector once for the 4, reduced in linear.cpp's reduce4 order.
// A row's result is then the dense bf16 kernel's to the bit, whatever rows share the call.

// out[b * R + r] = W row r (bf16, rows k apart) . x row b (ldx apart), b < BT, r < R; k % 32 == 0
template <int R, int BT>
void tile(const uint16_t* w, int64_t k, const uint16_t* x, int64_t ldx, float* out) {
  __m512 acc[BT][R];
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 32) {
    __m512i xv[BT];
#pragma GCC unroll 8
    for (int b = 0; b < BT; ++b) xv[b] = _mm512_loadu_si512(x + b * ldx + kk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * k + kk);
#pragma GCC unroll 8
      for (int b = 0; b < BT; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv, (__m512bh)xv[b]);
    }
  }
  float four[4];
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b) {
    if constexpr (R == 4) {
      reduce4(acc[b][0], acc[b][1], acc[b][2], acc[b][3], out + b * R);
    } else {
      reduce4(acc[b][0], acc[b][0], acc[b][0], acc[b][0], four);
      out[b] = four[0];
    }
  }
}

constexpr int kTileRows = 4, kTileX = 6;

template <int R>
void tile_bt(int bt, const uint16_t* w, int64_t k, const uint16_t* x, int64_t ldx, float* out) {
  switch (bt) {
    case 1: return tile<R, 1>(w, k, x, ldx, out);
    case 2: return tile<R, 2>(w, k, x, ldx, out);
    case 3: return tile<R, 3>(w, k, x, ldx, out);
    case 4: return tile<R, 4>(w, k, x, ldx, out);
    case 5: return tile<R, 5>(w, k, x, ldx, out);
    default: return tile<R, 6>(w, k, x, ldx, out);
  }
}

// y[b * ldy + j] (bf16) for W rows j < rows, dequantized in `w` (bf16, k apart), and every row of x.
// (Taking x in groups that stay in L1 while W passes them changed nothing at 16 to 256 rows: the
// tiles are bound by vdpbf16ps, not by reading x from L2.)
void rows_times_x(const uint16_t* w, int64_t rows, int64_t k, const uint16_t* x, int64_t b, uint16_t* y,
                  int64_t ldy) {
  over_tiles<kTileRows, kTileX>(
      rows, b,
      [&](int r_n, int bt, int64_t i, int64_t b0, float* out) {
        if (r_n == kTileRows) {
          tile_bt<kTileRows>(bt, w + i * k, k, x + b0 * k, k, out);
        } else {
          tile_bt<1>(bt, w + i * k, k, x + b0 * k, k, out);
        }
      },
      [&](int64_t bx, int64_t j, float v) { y[bx * ldy + j] = float_to_bf16(v); });
}

}  // namespace path_bf16
#pragma GCC pop_options

namespace {

using RowDot = void (*)(const uint8_t*, int64_t, const XBlock* const*, int, float*);
using RowDotF32 = void (*)(const uint8_t*, int64_t, const float* const*, int, float*);
using PackedRowsBf16 = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*,
                                 int64_t);

using RowDequant = void (*)(const uint8_t*, int64_t, float*);
using RowDequantBf16 = void (*)(const uint8_t*, int64_t, uint16_t*);

const int g_isa = detect_isa();
const bool g_bf16 =
    g_isa == kIsaVnni && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");

// Rows of x dotted with one unpacked weight block (the most a tile takes): 8 in the fp32 exact mode
// on AVX-512 (two accumulators a row), else 4 (AVX2 has 16 registers; the int8 mode keeps two a row).
constexpr int kTile = 8;
// Bytes of W a thread takes at a time: long enough that the hardware prefetchers lock on to the
// stream (chunks of 8 rows, 3 KB, read the embedded model's blocks at a third of the bandwidth),
// short enough that a thread whose core is busy takes fewer.
constexpr int64_t kChunkBytes = 64 << 10;

// One run of a weight's rows in one format: a fused slot (q, k and v; gate and up) is several,
// each where the file holds it, and one call covers them all (one parallel region, not three).
struct Segment {
  int fmt;
  const uint8_t* w;
  int64_t rows;
  int64_t first;  // the segment's first row in y
  int64_t row_bytes;
  int64_t chunk_rows;
  int64_t first_chunk;
  RowDot dot;
  RowDotF32 dot_f32;
  PackedRowsBf16 dot_bf16;
  RowDequantBf16 dequant_bf16;
  RowDequant dequant_scratch;
};

// Rows of x up to which the bf16 path unpacks each block in registers for every tile of rows
// (path_bf16::packed_rows); past it, a chunk is unpacked once into scratch (path_bf16::rows_times_x).
// SmolLM2's 120 matrices in Q4_1, weights from memory (AMD EPYC, AVX-512 BF16, 2 threads), against
// the dense bf16 kernel: in registers 1.16-1.30x at 1 row, 1.0x at 8; through scratch 0.91x at 8,
// 0.93x at 16. Both give a row the same bits, so where the line falls changes no result.
constexpr int kFusedRows = 8;
// The same line for fp32 x (the exact mode without bf16 arithmetic). The AVX2 path, SmolLM2's 120
// matrices against the dense fp32 kernel: in registers 1.20x at 8 rows, 1.06x at 12, 0.96x at 16;
// through scratch 1.01x, 1.02x, 1.03x.
constexpr int kFusedRowsF32 = 12;

// y[b * ldy + n] for b < B and every row n of every segment; x fp32 or bf16 (then y bf16)
// `exact`: x as it is (fp32 products of the dequantized blocks), else x rounded to int8 blocks
void qlinear(void* y, const void* x, std::vector<Segment>& segs, int64_t k, int64_t b, int64_t ldy, bool x_bf16,
             int threads, int isa, bool exact) {
  const int64_t nb = k / 32;
  // bf16 x in the exact mode where the CPU multiplies bf16: as it is, on vdpbf16ps (path_bf16)
  const bool bf16_dot = exact && x_bf16 && g_bf16 && isa == kIsaVnni;
  std::vector<float> widened;  // else bf16 x widened once: it is B*K, W is N*K
  const float* xf = static_cast<const float*>(x);
  if (x_bf16 && !bf16_dot) {
    widened.resize((size_t)(b * k));
    for (int64_t i = 0; i < b * k; ++i) widened[(size_t)i] = bf16_to_float(static_cast<const uint16_t*>(x)[i]);
    xf = widened.data();
  }
  std::vector<XBlock> xq((size_t)(exact ? 0 : b * nb));
  for (int64_t r = 0; r < b && !exact; ++r) {
    if (isa == kIsaScalar) {
      quantize_row_scalar(xf + r * k, k, xq.data() + r * nb);
    } else {  // the same rounding (to nearest even), vectorised
      path_avx2::quantize_row(xf + r * k, k, xq.data() + r * nb);
    }
  }
  int64_t n = 0, chunks = 0;
  for (const Segment& sg : segs) n += sg.rows;
  // at least four chunks a thread, so that a small matrix (k: 192 rows) still keeps every thread busy
  const int64_t per_thread = (n + 4 * threads - 1) / (4 * threads);
  for (Segment& sg : segs) {
    sg.chunk_rows = std::max<int64_t>(8, std::min(kChunkBytes / sg.row_bytes, per_thread));
    sg.first_chunk = chunks;
    chunks += (sg.rows + sg.chunk_rows - 1) / sg.chunk_rows;
  }
  auto work = [&](int64_t c) {
    size_t si = 0;
    while (si + 1 < segs.size() && segs[si + 1].first_chunk <= c) ++si;
    const Segment& sg = segs[si];
    const int64_t lo = (c - sg.first_chunk) * sg.chunk_rows, hi = std::min(sg.rows, lo + sg.chunk_rows);
    if (bf16_dot) {
      uint16_t* yc = static_cast<uint16_t*>(y) + sg.first + lo;
      const uint16_t* xh = static_cast<const uint16_t*>(x);
      if (b <= kFusedRows) {  // each block unpacked in registers for every row of x
        sg.dot_bf16(sg.w + lo * sg.row_bytes, hi - lo, sg.row_bytes, k, xh, b, yc, ldy);
        return;
      }
      // the chunk's rows unpacked once, into this thread's scratch (kept: a chunk is ~200 KB, and a
      // fresh one per call would be a mapping and its page faults)
      thread_local std::vector<uint16_t> scratch;
      scratch.resize((size_t)((hi - lo) * k));
      for (int64_t i = lo; i < hi; ++i) sg.dequant_bf16(sg.w + i * sg.row_bytes, k, scratch.data() + (i - lo) * k);
      path_bf16::rows_times_x(scratch.data(), hi - lo, k, xh, b, yc, ldy);
      return;
    }
    if (exact && b > kFusedRowsF32 && sg.dequant_scratch != nullptr) {
      thread_local std::vector<float> scratch_f32;
      scratch_f32.resize((size_t)((hi - lo) * k));
      for (int64_t i = lo; i < hi; ++i) sg.dequant_scratch(sg.w + i * sg.row_bytes, k, scratch_f32.data() + (i - lo) * k);
      void* yc = x_bf16 ? static_cast<void*>(static_cast<uint16_t*>(y) + sg.first + lo)
                        : static_cast<void*>(static_cast<float*>(y) + sg.first + lo);
      if (isa == kIsaVnni) {
        path_vnni::rows_times_x_f32(scratch_f32.data(), hi - lo, k, xf, b, yc, ldy, x_bf16);
      } else {
        path_avx2::rows_times_x_f32(scratch_f32.data(), hi - lo, k, xf, b, yc, ldy, x_bf16);
      }
      return;
    }
    float out[kTile];
    const XBlock* xs[kTile];
    const float* xr[kTile];
    const int64_t tile = exact && isa == kIsaVnni ? 8 : 4;
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* row = sg.w + i * sg.row_bytes;
      for (int64_t r0 = 0; r0 < b; r0 += tile) {
        int rows = (int)std::min<int64_t>(tile, b - r0);
        if (exact) {
          for (int r = 0; r < rows; ++r) xr[r] = xf + (r0 + r) * k;
          sg.dot_f32(row, nb, xr, rows, out);
        } else {
          for (int r = 0; r < rows; ++r) xs[r] = xq.data() + (r0 + r) * nb;
          sg.dot(row, nb, xs, rows, out);
        }
        for (int r = 0; r < rows; ++r) {
          if (x_bf16) {
            static_cast<uint16_t*>(y)[(r0 + r) * ldy + sg.first + i] = float_to_bf16(out[r]);
          } else {
            static_cast<float*>(y)[(r0 + r) * ldy + sg.first + i] = out[r];
          }
        }
      }
    }
  };
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, chunks));
  if (threads == 1) {
    for (int64_t c = 0; c < chunks; ++c) work(c);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) work(c);
}

// A format's functions on one path, picked once per call from the format's number. Dequantizing
// takes the AVX-512 rows where the CPU has them (a prefill dequantizes every matrix it multiplies:
// the scalar loop cost a 1,000-token prompt a third more than the dense model's), else the scalar
// ones; both compute ggml's expression, so the values are the same bits. `dot_bf16` runs only
// where the CPU has AVX-512 BF16 (g_bf16).
struct FormatKernels {
  RowDot dot;  // the int8 mode
  RowDotF32 dot_f32;
  PackedRowsBf16 dot_bf16;
  RowDequant dequant_f32;
  RowDequantBf16 dequant_bf16;  // null: dequantize to fp32 and round
  RowDequant dequant_scratch;   // fp32 x's scratch: the SIMD paths' own (null on the scalar one)
};

template <int FMT>
FormatKernels kernels_of(int isa) {
  if (isa == kIsaVnni)
    return {path_vnni::row_dot<FMT>, path_vnni::row_dot_f32<FMT>, path_bf16::packed_rows<FMT>,
            path_vnni::dequantize_row_simd<FMT>,
            g_bf16 ? path_bf16::dequantize_row_bf16<FMT> : path_vnni::dequantize_row_simd_bf16<FMT>,
            path_vnni::dequant_row_f32<FMT>};
  if (isa == kIsaAvx2)
    return {path_avx2::row_dot<FMT>, path_avx2::row_dot_f32<FMT>, nullptr, dequantize_row<FMT>, nullptr,
            path_avx2::dequant_row_f32<FMT>};
  return {row_dot_scalar<FMT>, row_dot_f32_scalar<FMT>, nullptr, dequantize_row<FMT>, nullptr, nullptr};
}

FormatKernels kernels_for(int fmt, int isa) {
  switch (fmt) {
    case kQ4_0: return kernels_of<kQ4_0>(isa);
    case kQ4_1: return kernels_of<kQ4_1>(isa);
    case kQ5_0: return kernels_of<kQ5_0>(isa);
    case kQ5_1: return kernels_of<kQ5_1>(isa);
    case kQ8_0: return kernels_of<kQ8_0>(isa);
    case kQ4_K: return kernels_of<kQ4_K>(isa);
    case kQ5_K: return kernels_of<kQ5_K>(isa);
    case kQ6_K: return kernels_of<kQ6_K>(isa);
    default: return {};
  }
}

// out[r] = W row idx[r] dequantized (fp32 or bf16), r < count; idx null: rows 0..count
void dequantize(void* out, const uint8_t* w, int fmt, const int64_t* idx, int64_t count, int64_t k, bool out_bf16,
                int threads) {
  const int64_t row_bytes = k / block_elems(fmt) * block_bytes(fmt);
  const FormatKernels deq = kernels_for(fmt, g_isa);
  auto one = [&](int64_t r) {
    const uint8_t* row = w + (idx ? idx[r] : r) * row_bytes;
    if (!out_bf16) {
      deq.dequant_f32(row, k, static_cast<float*>(out) + r * k);
      return;
    }
    uint16_t* dst = static_cast<uint16_t*>(out) + r * k;
    if (deq.dequant_bf16 != nullptr) {
      deq.dequant_bf16(row, k, dst);
      return;
    }
    std::vector<float> tmp((size_t)k);
    deq.dequant_f32(row, k, tmp.data());
    for (int64_t j = 0; j < k; ++j) dst[j] = float_to_bf16(tmp[j]);
  };
  threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, count / 16));
  if (threads == 1) {
    for (int64_t r = 0; r < count; ++r) one(r);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < count; ++r) one(r);
}

bool int_args(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, const char* name, long long* v) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s() takes %d integer arguments", name, (int)want);
    return false;
  }
  for (Py_ssize_t i = 0; i < want; ++i) {
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// linear(y, x, parts, k, b, ldy, x_bf16, threads, isa, exact); parts: a tuple of (fmt, address, rows) * m
PyObject* py_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) % 3 != 0) {
    PyErr_SetString(PyExc_TypeError, "linear() takes y, x, a tuple of (fmt, address, rows) triples, and 7 ints");
    return nullptr;
  }
  long long v[10];
  for (int i = 0; i < 10; ++i) {
    if (i == 2) continue;
    v[i] = PyLong_AsLongLong(args[i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const int64_t k = v[3];
  const int isa = (int)v[8];
  if (isa < 0 || isa > g_isa) {
    PyErr_Format(PyExc_ValueError, "linear: path %d not available (this CPU: 0..%d)", isa, g_isa);
    return nullptr;
  }
  std::vector<Segment> segs;
  int64_t first = 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[2]); i += 3) {
    long long fmt = PyLong_AsLongLong(PyTuple_GET_ITEM(args[2], i));
    long long ptr = PyLong_AsLongLong(PyTuple_GET_ITEM(args[2], i + 1));
    long long rows = PyLong_AsLongLong(PyTuple_GET_ITEM(args[2], i + 2));
    if (PyErr_Occurred()) return nullptr;
    if (block_bytes((int)fmt) == 0 || k % block_elems((int)fmt) != 0) {
      PyErr_Format(PyExc_ValueError, "linear: format %lld with k=%lld is not a block format here", fmt, (long long)k);
      return nullptr;
    }
    if (rows <= 0) continue;
    Segment sg{};
    sg.fmt = (int)fmt;
    sg.w = reinterpret_cast<const uint8_t*>(ptr);
    sg.rows = rows;
    sg.first = first;
    sg.row_bytes = k / block_elems((int)fmt) * block_bytes((int)fmt);
    const FormatKernels kern = kernels_for((int)fmt, isa);
    sg.dot = kern.dot;
    sg.dot_f32 = kern.dot_f32;
    sg.dot_bf16 = g_bf16 ? kern.dot_bf16 : nullptr;
    sg.dequant_bf16 = kern.dequant_bf16;
    sg.dequant_scratch = kern.dequant_scratch;
    segs.push_back(sg);
    first += rows;
  }
  if (segs.empty() || v[4] <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  qlinear(reinterpret_cast<void*>(v[0]), reinterpret_cast<const void*>(v[1]), segs, k, v[4], v[5], v[6] != 0,
          (int)v[7], isa, v[9] != 0);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_dequantize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[8];
  if (!int_args(args, nargs, 8, "dequantize", v)) return nullptr;
  int fmt = (int)v[2];
  if (block_bytes(fmt) == 0 || v[5] % block_elems(fmt) != 0) {
    PyErr_Format(PyExc_ValueError, "dequantize: format %d with k=%lld is not a block format here", fmt, v[5]);
    return nullptr;
  }
  if (v[4] <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  dequantize(reinterpret_cast<void*>(v[0]), reinterpret_cast<const uint8_t*>(v[1]), fmt,
             reinterpret_cast<const int64_t*>(v[3]), v[4], v[5], v[6] != 0, (int)v[7]);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyLong_FromLong(g_isa); }

PyObject* py_bf16(PyObject*, PyObject*) { return PyBool_FromLong(g_bf16); }

PyMethodDef kMethods[] = {
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_linear)), METH_FASTCALL,
     "linear(y, x, parts, k, b, ldy, x_bf16, threads, isa, exact): y[b*ldy+n] = x[b,k] @ W[n,k]^T, W's rows "
     "the parts' (fmt, address, rows) in order, each in GGML format fmt; exact: x in fp32, else rounded to int8 "
     "blocks; pointers as ints, nothing checked"},
    {"dequantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_dequantize)), METH_FASTCALL,
     "dequantize(out, w, fmt, idx, count, k, out_bf16, threads): out[r] = W row idx[r] (idx 0: row r)"},
    {"bf16", py_bf16, METH_NOARGS, "whether bf16 x multiplies on vdpbf16ps here (AVX-512 BF16)"},
    {"isa", py_isa, METH_NOARGS, "this CPU's best path: 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512 VNNI"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "splitserve_quant",
                       "GGUF block-format weights computed in place (splitserve.engine.kernels)", -1, kMethods};

}  // namespace

#define SPLITSERVE_CONCAT2(a, b) a##b
#define SPLITSERVE_CONCAT(a, b) SPLITSERVE_CONCAT2(a, b)
PyMODINIT_FUNC SPLITSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }

#else  // SPLITSERVE_QUANT_BODY: the SIMD row dot, once per target

inline float half_fast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// block_scale with the hardware's fp16 conversion (the scalar one is most of a block's cost)
template <int FMT>
inline BlockScale scale_fast(const uint8_t* row, int64_t kb) {
  if constexpr (FMT == kQ4_0 || FMT == kQ5_0 || FMT == kQ8_0) {
    float d = half_fast(row + kb * block_bytes(FMT));
    return {d, d, 0.f, 0.f, FMT == kQ4_0 ? 8 : (FMT == kQ5_0 ? 16 : 0)};
  } else if constexpr (FMT == kQ4_1 || FMT == kQ5_1) {
    const uint8_t* b = row + kb * block_bytes(FMT);
    float d = half_fast(b), m = half_fast(b + 2);
    return {d, d, m, m, 0};
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int sc, mn;
    scale_min_k4((int)(kb & 7), b + 4, &sc, &mn);
    float d = half_fast(b) * (float)sc, m = -half_fast(b + 2) * (float)mn;
    return {d, d, m, m, 0};
  } else {
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    float d = half_fast(b + 208);
    int c = (int)(kb & 7), half = c >> 2, cc = c & 3;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * cc;
    return {d * (float)sc[0], d * (float)sc[1], 0.f, 0.f, 32};
  }
}

// 32 values of block kb as signed bytes q - off (every format's fit in int8)
template <int FMT>
inline __m256i block_vec(const uint8_t* row, int64_t kb, int off) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i q;
  if constexpr (FMT == kQ4_0 || FMT == kQ4_1 || FMT == kQ5_0 || FMT == kQ5_1) {
    constexpr int head = (FMT == kQ4_0) ? 2 : (FMT == kQ4_1 ? 4 : (FMT == kQ5_0 ? 6 : 8));
    const uint8_t* b = row + kb * block_bytes(FMT);
    __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + head));
    q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low4);
    if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {  // the fifth bit of element j is bit j of qh
      uint32_t qh;
      std::memcpy(&qh, b + head - 4, 4);
      const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
      __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
      bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
      __m256i set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
      q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
  } else if constexpr (FMT == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kb * block_bytes(FMT) + 2));
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int c = (int)(kb & 7);
    __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (FMT == kQ4_K ? 16 : 48) + 32 * (c >> 1)));
    q = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((c & 1) * 4)), low4);
    if constexpr (FMT == kQ5_K) {
      __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
  } else {  // Q6_K
    const uint8_t* b = row + (kb >> 3) * block_bytes(FMT);
    int c = (int)(kb & 7), half = c >> 2, cc = c & 3;
    __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (cc & 1)));
    __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((cc >> 1) * 4)), low4);
    __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * cc)), _mm256_set1_epi8(3));
    q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  return off ? _mm256_sub_epi8(q, _mm256_set1_epi8((char)off)) : q;
}

// 8 int32 lanes of u8 q times s8 x: lanes 0..3 sum bytes 0..15, lanes 4..7 bytes 16..31
inline __m256i dot_u8s8(__m256i q, __m256i x) {
#if SPLITSERVE_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
  // q <= 63 (Q8_0: |w| <= 128), so a pair's sum (<= 2 * 128 * 127) fits vpmaddubsw's int16
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// quantize_row_scalar, vectorised: the same d, the same rounding (to nearest even)
inline void quantize_row(const float* x, int64_t k, XBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + kb * 32 + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float am = _mm_cvtss_f32(m4);
    float d = am / 127.f, inv = d > 0.f ? 127.f / am : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    int s_lo = hsum_i(_mm256_add_epi32(qi[0], qi[1])), s_hi = hsum_i(_mm256_add_epi32(qi[2], qi[3]));
    __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    // the packs interleave 128-bit lanes: put the 32-bit groups back in order
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    XBlock& xb = out[kb];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.q), p8);
    xb.d = d;
    xb.s_lo = d * (float)s_lo;
    xb.s_hi = d * (float)s_hi;
    xb.s = d * (float)(s_lo + s_hi);
  }
}

template <int FMT, int R>
void row_dot_r(const uint8_t* row, int64_t nb, const XBlock* const* xs, float* out) {
  // R a constant and every loop over it unrolled, so that the accumulators live in registers; the
  // mins' products go to vector accumulators too (a float array is packed into general registers)
  __m256 acc[R], macc[R];
  const XBlock* x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = macc[r] = _mm256_setzero_ps();
    x[r] = xs[r];
  }
  for (int64_t kb = 0; kb < nb; ++kb) {
    // a few blocks ahead: the next rows follow this one, so this runs ahead of the row too
    _mm_prefetch(reinterpret_cast<const char*>(row + kb * block_bytes(FMT) * 32 / block_elems(FMT)) + 1024,
                 _MM_HINT_T0);
    BlockScale s = scale_fast<FMT>(row, kb);
    __m256i q = block_vec<FMT>(row, kb, 0);
    __m256 dv = FMT == kQ6_K ? _mm256_set_m128(_mm_set1_ps(s.d_hi), _mm_set1_ps(s.d_lo)) : _mm256_set1_ps(s.d_lo);
    const __m256 m_lo = _mm256_set1_ps(s.m_lo - (float)s.off * s.d_lo);
    const __m256 m_hi = _mm256_set1_ps(s.m_hi - (float)s.off * s.d_hi);
    __m256i qa = q;
    if constexpr (FMT == kQ8_0) qa = _mm256_sign_epi8(q, q);  // |w|; x takes w's sign below
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const XBlock& xb = x[r][kb];
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      if constexpr (FMT == kQ8_0) xv = _mm256_sign_epi8(xv, q);
      __m256 scale = _mm256_mul_ps(dv, _mm256_broadcast_ss(&xb.d));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(qa, xv)), scale, acc[r]);
      if constexpr (FMT == kQ6_K) {
        macc[r] = _mm256_fmadd_ps(m_lo, _mm256_broadcast_ss(&xb.s_lo), macc[r]);
        macc[r] = _mm256_fmadd_ps(m_hi, _mm256_broadcast_ss(&xb.s_hi), macc[r]);
      } else if constexpr (FMT != kQ8_0) {
        macc[r] = _mm256_fmadd_ps(m_lo, _mm256_broadcast_ss(&xb.s), macc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + _mm256_cvtss_f32(macc[r]);
}

template <int FMT>
void row_dot(const uint8_t* row, int64_t nb, const XBlock* const* xs, int rows, float* out) {
  switch (rows) {
    case 1: return row_dot_r<FMT, 1>(row, nb, xs, out);
    case 2: return row_dot_r<FMT, 2>(row, nb, xs, out);
    case 3: return row_dot_r<FMT, 3>(row, nb, xs, out);
    default: return row_dot_r<FMT, 4>(row, nb, xs, out);
  }
}

// ---- the exact mode: each block dequantized to fp32 in registers, FMAs with x as it is

#if SPLITSERVE_VNNI  // the AVX-512 target: 16 lanes

inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

inline __m128 halves(const uint8_t* p) {  // the fp16 pair at p (d, then m) as floats
  uint32_t v;
  std::memcpy(&v, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
}

// Block kb's 32 weights as floats: w0 elements 0..15 (the d_lo half), w1 16..31. The 32-element
// formats go straight to int32 lanes (one load-and-widen, a mask, a shift), their scales with one
// fp16 conversion; the K-quants through block_vec's bytes. GGML: rounded as ggml's dequantize
// rounds, d * q and then + m (two roundings) where the format has a min, so that the values are the
// dequantized model's bits; else d * q + m in one fma.
template <int FMT, bool GGML = false>
inline void block_w(const uint8_t* row, int64_t kb, __m512& w0, __m512& w1) {
  if constexpr (FMT == kQ4_0 || FMT == kQ4_1 || FMT == kQ5_0 || FMT == kQ5_1) {
    constexpr int head = (FMT == kQ4_0) ? 2 : (FMT == kQ4_1 ? 4 : (FMT == kQ5_0 ? 6 : 8));
    const uint8_t* b = row + kb * block_bytes(FMT);
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + head)));
    __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(bytes, 4);
    if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {  // element j's fifth bit is bit j of qh
      uint32_t qh;
      std::memcpy(&qh, b + head - 4, 4);
      const __m512i bit4 = _mm512_set1_epi32(0x10);
      lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xFFFF), lo, bit4);
      hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, bit4);
    }
    __m128 dm = halves(b);
    __m512 d = _mm512_broadcastss_ps(dm);
    __m512 m;
    if constexpr (FMT == kQ4_1 || FMT == kQ5_1) {
      m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    } else {
      m = _mm512_mul_ps(d, _mm512_set1_ps(FMT == kQ4_0 ? -8.f : -16.f));
    }
    if constexpr (GGML && (FMT == kQ4_1 || FMT == kQ5_1)) {
      w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), m);
      w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), m);
    } else if constexpr (GGML) {  // d * (q - off): a zero keeps d's sign, as ggml's does
      const __m512i off = _mm512_set1_epi32(FMT == kQ4_0 ? 8 : 16);
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)), d);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)), d);
    } else {  // Q4_0, Q5_0: d * (q - off) as d * q - off * d, exact in one fma (off * d is exact)
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
    }
  } else if constexpr (FMT == kQ8_0) {
    const uint8_t* b = row + kb * block_bytes(FMT);
    __m512 d = _mm512_broadcastss_ps(halves(b));
    const __m128i* qs = reinterpret_cast<const __m128i*>(b + 2);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1))), d);
  } else {
    BlockScale s = scale_fast<FMT>(row, kb);
    __m256i q = block_vec<FMT>(row, kb, s.off);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    if constexpr (GGML) {
      w0 = _mm512_mul_ps(w0, _mm512_set1_ps(s.d_lo));
      w1 = _mm512_mul_ps(w1, _mm512_set1_ps(s.d_hi));
      if constexpr (FMT != kQ6_K) {  // Q6_K has no min (and + 0 would turn a -0 into +0)
        w0 = _mm512_add_ps(w0, _mm512_set1_ps(s.m_lo));
        w1 = _mm512_add_ps(w1, _mm512_set1_ps(s.m_hi));
      }
    } else {
      w0 = _mm512_fmadd_ps(w0, _mm512_set1_ps(s.d_lo), _mm512_set1_ps(s.m_lo));
      w1 = _mm512_fmadd_ps(w1, _mm512_set1_ps(s.d_hi), _mm512_set1_ps(s.m_hi));
    }
  }
}

template <int FMT, int R>
void row_dot_f32_r(const uint8_t* row, int64_t nb, const float* const* xs, float* out) {
  __m512 lo[R], hi[R];
  const float* x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = hi[r] = _mm512_setzero_ps();
    x[r] = xs[r];
  }
  for (int64_t kb = 0; kb < nb; ++kb) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kb * block_bytes(FMT) * 32 / block_elems(FMT)) + 1024,
                 _MM_HINT_T0);
    __m512 w0, w1;
    block_w<FMT>(row, kb, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + kb * 32), lo[r]);
      hi[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + kb * 32 + 16), hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum512(_mm512_add_ps(lo[r], hi[r]));
}

// A row dequantized with ggml's expression (d * (q - off), or d * q + m where the format has a
// min: the same roundings as the scalar dequantize_row, so the same bits), 32 values at a time.
template <int FMT>
void dequantize_row_simd(const uint8_t* row, int64_t k, float* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    __m512 w0, w1;
    block_w<FMT, true>(row, kb, w0, w1);
    _mm512_storeu_ps(out + kb * 32, w0);
    _mm512_storeu_ps(out + kb * 32 + 16, w1);
  }
}

inline __m256i to_bf16(__m512 v) {  // round to nearest even (weights are finite)
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_cvtepi32_epi16(u);
}

template <int FMT>
void dequantize_row_simd_bf16(const uint8_t* row, int64_t k, uint16_t* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    __m512 w0, w1;
    block_w<FMT, true>(row, kb, w0, w1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kb * 32), to_bf16(w0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kb * 32 + 16), to_bf16(w1));
  }
}

#else  // AVX2: 8 lanes, four ymm a block

template <int FMT, int R>
void row_dot_f32_r(const uint8_t* row, int64_t nb, const float* const* xs, float* out) {
  __m256 lo[R], hi[R];
  const float* x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = hi[r] = _mm256_setzero_ps();
    x[r] = xs[r];
  }
  for (int64_t kb = 0; kb < nb; ++kb) {
    _mm_prefetch(reinterpret_cast<const char*>(row + kb * block_bytes(FMT) * 32 / block_elems(FMT)) + 1024,
                 _MM_HINT_T0);
    BlockScale s = scale_fast<FMT>(row, kb);
    __m256i q = block_vec<FMT>(row, kb, s.off);
    __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    __m256 dl = _mm256_set1_ps(s.d_lo), ml = _mm256_set1_ps(s.m_lo);
    __m256 dh = _mm256_set1_ps(s.d_hi), mh = _mm256_set1_ps(s.m_hi);
    __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), dl, ml);
    __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), dl, ml);
    __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), dh, mh);
    __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), dh, mh);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xb = x[r] + kb * 32;
      lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), lo[r]);
      hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), hi[r]);
      lo[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), lo[r]);
      hi[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(lo[r], hi[r]));
}

#endif  // SPLITSERVE_VNNI

// ---- fp32 x past the in-register rows: a chunk of W unpacked once into fp32 scratch, then register
// tiles of FMAs (linear.cpp's fp32 tiles), as the bf16 path does (path_bf16 below). Dequantizing the
// whole matrix for oneDNN wrote and read 4 bytes a weight through memory: on the AVX2 path at 32 rows
// the blocks took 1.7x the dense fp32 kernel's time.

#if SPLITSERVE_VNNI
using VecF = __m512;
constexpr int kLanesF = 16, kTileWF = 4, kTileXF = 4;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return _mm512_reduce_add_ps(v); }
#else
using VecF = __m256;
constexpr int kLanesF = 8, kTileWF = 2, kTileXF = 4;  // 8 accumulators of AVX2's 16 registers
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(VecF v) { return hsum(v); }
#endif

// A row dequantized to fp32 with ggml's expression (d * (q - off), + m where the format has one)
template <int FMT>
void dequant_row_f32(const uint8_t* row, int64_t k, float* out) {
  for (int64_t kb = 0; kb < k / 32; ++kb) {
    BlockScale s = scale_fast<FMT>(row, kb);
    __m256i q = block_vec<FMT>(row, kb, s.off);
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_set1_ps(h ? s.d_hi : s.d_lo), m = _mm256_set1_ps(h ? s.m_hi : s.m_lo);
      for (int e = 0; e < 2; ++e) {
        __m128i bytes = e ? _mm_srli_si128(halves[h], 8) : halves[h];
        __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
        if constexpr (FMT == kQ4_1 || FMT == kQ5_1 || FMT == kQ4_K || FMT == kQ5_K) w = _mm256_add_ps(w, m);
        _mm256_storeu_ps(out + kb * 32 + 16 * h + 8 * e, w);
      }
    }
  }
}

// out[b * R + r] = W row r (fp32, k apart) . x row b (ldx apart); k % 32 == 0
template <int R, int BT>
void tile_f32(const float* w, int64_t k, const float* x, int64_t ldx, float* out) {
  VecF acc[BT][R];
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[b][r] = vzero();
  for (int64_t kk = 0; kk < k; kk += kLanesF) {
    VecF xv[BT];
#pragma GCC unroll 8
    for (int b = 0; b < BT; ++b) xv[b] = vload(x + b * ldx + kk);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const VecF wv = vload(w + r * k + kk);
#pragma GCC unroll 8
      for (int b = 0; b < BT; ++b) acc[b][r] = vfma(wv, xv[b], acc[b][r]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < BT; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) out[b * R + r] = vsum(acc[b][r]);
}

template <int R>
void tile_f32_bt(int bt, const float* w, int64_t k, const float* x, int64_t ldx, float* out) {
  switch (bt) {
    case 1: return tile_f32<R, 1>(w, k, x, ldx, out);
    case 2: return tile_f32<R, 2>(w, k, x, ldx, out);
    case 3: return tile_f32<R, 3>(w, k, x, ldx, out);
    default: return tile_f32<R, 4>(w, k, x, ldx, out);
  }
}

// y[b * ldy + j] for W rows j < rows, dequantized in `w` (fp32, k apart), and every row of x (fp32);
// y fp32, or bf16 where `y_bf16` (bf16 x widened for this path)
void rows_times_x_f32(const float* w, int64_t rows, int64_t k, const float* x, int64_t b, void* y, int64_t ldy,
                      bool y_bf16) {
  over_tiles<kTileWF, kTileXF>(
      rows, b,
      [&](int r_n, int bt, int64_t i, int64_t b0, float* out) {
        if (r_n == kTileWF) {
          tile_f32_bt<kTileWF>(bt, w + i * k, k, x + b0 * k, k, out);
        } else {
          tile_f32_bt<1>(bt, w + i * k, k, x + b0 * k, k, out);
        }
      },
      [&](int64_t bx, int64_t j, float v) {
        if (y_bf16) {
          static_cast<uint16_t*>(y)[bx * ldy + j] = float_to_bf16(v);
        } else {
          static_cast<float*>(y)[bx * ldy + j] = v;
        }
      });
}

template <int FMT>
void row_dot_f32(const uint8_t* row, int64_t nb, const float* const* xs, int rows, float* out) {
  switch (rows) {
    case 1: return row_dot_f32_r<FMT, 1>(row, nb, xs, out);
    case 2: return row_dot_f32_r<FMT, 2>(row, nb, xs, out);
    case 3: return row_dot_f32_r<FMT, 3>(row, nb, xs, out);
#if SPLITSERVE_VNNI
    case 4: return row_dot_f32_r<FMT, 4>(row, nb, xs, out);
    case 5: return row_dot_f32_r<FMT, 5>(row, nb, xs, out);
    case 6: return row_dot_f32_r<FMT, 6>(row, nb, xs, out);
    case 7: return row_dot_f32_r<FMT, 7>(row, nb, xs, out);
    default: return row_dot_f32_r<FMT, 8>(row, nb, xs, out);
#else
    default: return row_dot_f32_r<FMT, 4>(row, nb, xs, out);
#endif
  }
}

#endif  // SPLITSERVE_QUANT_BODY
