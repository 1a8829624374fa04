// The small operations of a CPU decode step, fused: RMSNorm (with the residual
// add before it), RoPE on q and k in place, SiLU(gate) * up, and paged decode
// attention that writes the new token's K/V and then reads the context straight
// out of the cache through the block table. In torch each of these is 5 to 20
// operator calls of a few microseconds each on tensors of a few hundred
// elements; at batch 1 those calls, not arithmetic, were half of a step.
//
// Numerics follow the torch code in engine/model.py operation by operation,
// including every intermediate rounding to the model's dtype, so that the
// elementwise kernels reproduce it bit for bit; the exceptions, each within
// one bf16 ulp, are the order of RMSNorm's sum of squares and exp() inside
// SiLU. Attention keeps scores, probabilities and the weighted sum of V in
// fp32 (torch's flash SDPA rounds probabilities to bf16 before P @ V).
//
// Element types: T = uint16_t holds bf16 bits, T = float is fp32. Vector code
// comes from the compiler: each per-row function is one plain, always-inline
// loop body compiled three times with `target` attributes (AVX-512, AVX2+FMA,
// baseline x86-64) and picked at run time from the CPU, or by the caller's
// `isa` argument so that tests can run every path; the binary runs on any
// x86-64 and nothing depends on the build host's -march. OpenMP loops live in
// single-version drivers that call those functions.
//
// Like linear.cpp, the module is plain CPython over raw pointers. The Python
// front (decode.py) checks dtypes, shapes, contiguity and devices; the indices
// that come from the scheduler (block tables, slots, context lengths) are
// checked here, before any memory is touched, because a wrong one would
// otherwise read or write outside the cache.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Float compares may be turned into selects: without no-trapping-math GCC
// keeps every branch of a clamp or a select (a compare could trap) and
// vectorizes none of them below AVX-512; only exception flags could differ.
// No contraction of a * b + c into one FMA: torch rounds the product first,
// and so must we, to give its bits (and the same bits on every ISA path).
#pragma GCC optimize("no-trapping-math", "fp-contract=off")

#define SS_INLINE inline __attribute__((always_inline))
#define SS_V4 __attribute__((target("arch=x86-64-v4")))  // AVX-512 F/BW/DQ/VL
#define SS_V3 __attribute__((target("arch=x86-64-v3")))  // AVX2, FMA

// Three compilations of one always-inline body `name##_impl<T>`: name##_v4
// (AVX-512), name##_v3 (AVX2+FMA) and name##_v1 (baseline x86-64, SSE2).
#define SS_VARIANTS(name, params, args)               \
  template <class T>                                  \
  SS_V4 void name##_v4 params { name##_impl<T> args; } \
  template <class T>                                  \
  SS_V3 void name##_v3 params { name##_impl<T> args; } \
  template <class T>                                  \
  void name##_v1 params { name##_impl<T> args; }

namespace {

// ------------------------------------------------------------ element access

SS_INLINE float to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
SS_INLINE float to_f32(float v) { return v; }

// Round to nearest even as c10::BFloat16 does; NaN becomes torch's quiet NaN.
SS_INLINE uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

SS_INLINE void store(uint16_t* p, int64_t i, float v) { p[i] = bf16_bits(v); }
SS_INLINE void store(float* p, int64_t i, float v) { p[i] = v; }

// v rounded to T and widened back: what a torch op with a T result hands the next one.
SS_INLINE float round_to(uint16_t*, float v) { return to_f32(bf16_bits(v)); }
SS_INLINE float round_to(float*, float v) { return v; }
template <class T>
SS_INLINE float rnd(float v) {
  return round_to(static_cast<T*>(nullptr), v);
}

// exp for fp32, 1-2 ulp (Cephes' polynomial), written so that it vectorizes
// on every ISA: no calls, one clamp, no special cases. Scaling by 2^n in two
// halves lets the product itself overflow to inf, underflow through the
// subnormals to 0, and keep NaN.
SS_INLINE float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;  // beyond these exp(x) is 0 or inf anyway
  xc = xc > 89.0f ? 89.0f : xc;            // (ternaries: std::min's references defeat omp simd)
  // round(xc / ln 2) by the 1.5 * 2^23 trick (exact for |v| < 2^22)
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);  // in [-150, 128]; NaN gives junk, and y is NaN
  const int32_t n1 = ni / 2, n2 = ni - n1;
  const uint32_t e1 = static_cast<uint32_t>(n1 + 127) << 23, e2 = static_cast<uint32_t>(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &e1, sizeof(s1));
  std::memcpy(&s2, &e2, sizeof(s2));
  return y * s1 * s2;
}

// ------------------------------------------------------------------ RMSNorm

// h <- h + y (if y), then out <- weight * T(h * rsqrt(mean(h^2) + eps)): model.py's
// rms_norm after `h = h + y`, one row.
template <class T>
SS_INLINE void rms_norm_row_impl(T* out, T* h, const T* y, const T* w, int64_t dim, float eps) {
  if (y != nullptr) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) store(h, d, to_f32(h[d]) + to_f32(y[d]));
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < dim; ++d) {
    float v = to_f32(h[d]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) store(out, d, to_f32(w[d]) * rnd<T>(to_f32(h[d]) * r));
}

template <class T>
using RmsNormRow = void (*)(T*, T*, const T*, const T*, int64_t, float);
SS_VARIANTS(rms_norm_row, (T * out, T* h, const T* y, const T* w, int64_t dim, float eps), (out, h, y, w, dim, eps))

// --------------------------------------------------------------------- RoPE

constexpr int kMaxHalf = 512;  // head_dim up to 1024

// x <- T(T(x * cos) + T(rotate_half(x) * sin)) for `heads` heads of one row, in place.
template <class T>
SS_INLINE void rope_row_impl(T* x, int64_t heads, int64_t dim, const T* cos, const T* sin) {
  const int64_t half = dim / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    T* v = x + hd * dim;
    // the first half's results need the second half's inputs, and the other way round
    float lo[kMaxHalf], hi[kMaxHalf];
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      float a = to_f32(v[d]), b = to_f32(v[d + half]);
      lo[d] = rnd<T>(rnd<T>(a * to_f32(cos[d])) + rnd<T>(-b * to_f32(sin[d])));
      hi[d] = rnd<T>(rnd<T>(b * to_f32(cos[d + half])) + rnd<T>(a * to_f32(sin[d + half])));
    }
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      store(v, d, lo[d]);
      store(v, d + half, hi[d]);
    }
  }
}

template <class T>
using RopeRow = void (*)(T*, int64_t, int64_t, const T*, const T*);
SS_VARIANTS(rope_row, (T * x, int64_t heads, int64_t dim, const T* cos, const T* sin), (x, heads, dim, cos, sin))

// ------------------------------------------------------------ SiLU(g) * up

template <class T>
SS_INLINE void silu_mul_row_impl(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float g = to_f32(gate[j]);
    store(out, j, rnd<T>(g / (1.0f + exp_f32(-g))) * to_f32(up[j]));
  }
}

template <class T>
using SiluMulRow = void (*)(T*, const T*, const T*, int64_t);
SS_VARIANTS(silu_mul_row, (T * out, const T* gate, const T* up, int64_t n), (out, gate, up, n))

// ----------------------------------------------------------------- sampling

// sampler.py's draw for a row whose token depends on its temperature alone: y = x * (1 / t), with
// NaN and -inf made the lowest float and +inf the largest (sampler._finite); p = softmax(y); the
// first token where p's running sum passes u (in [0, 1)). One pass finds max(y), a second sums
// exp(y - max) by blocks of kDrawBlock (in fp32 lanes, the blocks' sums in double), and only the
// block where u * total falls is scanned, in order.
constexpr int64_t kDrawBlock = 1024;

SS_INLINE float finite_logit(float x, float inv_t) {
  float y = x * inv_t;
  y = y != y ? -3.4028234663852886e38f : y;  // NaN
  y = y > 3.4028234663852886e38f ? 3.4028234663852886e38f : y;
  return y < -3.4028234663852886e38f ? -3.4028234663852886e38f : y;
}

template <class T>
SS_INLINE void logit_max_impl(const float* x, int64_t n, float inv_t, float* out) {
  float m = -3.4028234663852886e38f;
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < n; ++v) {
    const float y = finite_logit(x[v], inv_t);
    m = y > m ? y : m;
  }
  *out = m;
}

template <class T>
SS_INLINE void exp_sum_impl(const float* x, int64_t n, float inv_t, float m, double* out) {
  float s = 0.0f;  // a block's at most 1,024 terms in 16 lanes: each lane sums 64, in fp32
#pragma omp simd reduction(+ : s)
  for (int64_t v = 0; v < n; ++v) s += exp_f32(finite_logit(x[v], inv_t) - m);
  *out = s;
}

using LogitMax = void (*)(const float*, int64_t, float, float*);
using ExpSum = void (*)(const float*, int64_t, float, float, double*);
SS_VARIANTS(logit_max, (const float* x, int64_t n, float inv_t, float* out), (x, n, inv_t, out))
SS_VARIANTS(exp_sum, (const float* x, int64_t n, float inv_t, float m, double* out), (x, n, inv_t, m, out))

// --------------------------------------------------------- decode attention

constexpr int kMaxGroup = 64;  // query heads per kv head

// One step's paged decode attention; element pointers are T* behind void*.
struct Attn {
  void* out;                 // [B, heads, dim]
  void* q;                   // row b at q + b * q_stride: [heads, dim] (RoPE rotates it in place)
  int64_t q_stride;
  void* k_new;               // row b at k_new + b * kv_stride: [kv_heads, dim] (and this)
  const void* v_new;
  int64_t kv_stride;
  const int64_t* slot_blocks;   // [B]
  const int64_t* slot_offsets;  // [B]
  void* cache;               // one layer: [num_blocks, 2, block_size, kv_heads, dim]
  int64_t num_blocks;
  const int64_t* tables;     // [B, width]
  int64_t width;
  const int64_t* context_lens;  // [B]
  const void* cos;           // [B, dim] or null: RoPE for q and k_new before the write
  const void* sin;
  int64_t b, heads, kv_heads, dim, block_size;
  float scale;
  int kv_kind;               // kKvNative (cache of T), kKvInt8 or kKvFp8 (the quantized format)
};

// Floats of scratch one call of an attend function needs (either path).
int64_t attn_buf_len(const Attn& a, int64_t max_ctx) { return a.heads * (2 * a.dim + max_ctx + 1) + a.dim; }

// Scratch per thread, grown as needed and kept across calls (one per layer and step).
float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Sequence b, kv head kh and the `group` query heads that share it. Two passes

// ------------------------------------------------------------- the KV formats
//
// One layer of the cache is either blocks of the model's own T, [num_blocks,
// 2, block_size, kv_heads, dim] (kKvNative), or int8 / fp8 (e4m3) blocks
// (engine/kv_cache.py has the format): [num_blocks, block_bytes] bytes, each
// block its values [2, block_size, kv_heads, dim] (one byte each) and then
// its fp32 scales [2, block_size, kv_heads], one per token and kv head: x =
// value * scale. One block walk per ISA reads all three, templated on C, the
// cache's element (uint16_t bf16 bits or float: T itself; int8_t; uint8_t
// holding e4m3 bits). With a scale, a score is scale_t * (q . k_t) and a
// token's V is weighted by p_t * scale_t, so the inner loops only widen
// values to fp32. The write quantizes each new row as engine/kv_cache.py's
// quantize_rows does, bit for bit.

constexpr int kKvNative = 0, kKvInt8 = 1, kKvFp8 = 2;

template <class C>
constexpr bool kScaled = sizeof(C) == 1;  // one-byte values carry a scale per token and kv head

SS_INLINE float kv_f32(uint16_t v) { return to_f32(v); }
SS_INLINE float kv_f32(float v) { return v; }
SS_INLINE float kv_f32(int8_t v) { return static_cast<float>(v); }
// e4m3fn bits to fp32, exactly, with no fp32 subnormal on the way (an operand
// that slows a multiply a hundredfold): a normal's exponent rebased by 127 - 7;
// a subnormal m * 2^-9 as 2^-6 * (1 + m/8) - 2^-6.
SS_INLINE float kv_f32(uint8_t v) {
  const uint32_t mag = static_cast<uint32_t>(v & 0x7fu) << 20;
  const bool sub = (v & 0x78u) == 0;
  const uint32_t u = sub ? (mag | (UINT32_C(121) << 23)) : (mag + (UINT32_C(120) << 23));
  float f;
  std::memcpy(&f, &u, sizeof(f));
  f = sub ? f - 0x1p-6f : f;
  uint32_t r;
  std::memcpy(&r, &f, sizeof(r));
  r |= static_cast<uint32_t>(v & 0x80u) << 24;
  std::memcpy(&f, &r, sizeof(f));
  return f;
}

// Bytes of one quantized block of one layer: values, then scales.
SS_INLINE int64_t q_block_bytes(const Attn& a) { return 2 * a.block_size * a.kv_heads * (a.dim + 4); }

// Where one layer's K and V rows, and their scales, sit in block `blk`.
template <class C>
struct Blocks {
  const uint8_t* cache;
  int64_t row;    // elements between one token's row and the next: kv_heads * dim
  int64_t v_off;  // elements from a block's K to its V
  int64_t block_bytes;
  int64_t v_scales_off;  // floats from a block's K scales to its V scales
  explicit Blocks(const Attn& a)
      : cache(static_cast<const uint8_t*>(a.cache)),
        row(a.kv_heads * a.dim),
        v_off(a.block_size * a.kv_heads * a.dim),
        block_bytes(kScaled<C> ? q_block_bytes(a) : 2 * v_off * static_cast<int64_t>(sizeof(C))),
        v_scales_off(a.block_size * a.kv_heads) {}
  SS_INLINE const C* k(int64_t blk) const { return reinterpret_cast<const C*>(cache + blk * block_bytes); }
  SS_INLINE const C* v(int64_t blk) const { return k(blk) + v_off; }
  // token t's scale of kv head h at [t * kv_heads + h] (quantized blocks only)
  SS_INLINE const float* k_scales(int64_t blk) const {
    return reinterpret_cast<const float*>(cache + blk * block_bytes + 2 * v_off);
  }
  SS_INLINE const float* v_scales(int64_t blk) const { return k_scales(blk) + v_scales_off; }
};

// ---------------------------------------------------- decode attention, portable

// Sequence b, kv head kh and the `group` query heads that share it. Two passes
// over the context: scores (q . k) with a softmax over them, then the
// probability-weighted sum of V, both reading K/V in place through the block
// table. D is head_dim when it is one of the common sizes (the loops then
// compile to straight vector code), else 0 and a.dim is read at run time.
template <class T, class C, int D>
SS_INLINE void attend_dim(const Attn& a, int64_t b, int64_t kh, float* buf) {
  const int64_t dim = D > 0 ? D : a.dim, group = a.heads / a.kv_heads, ctx = a.context_lens[b];
  const Blocks<C> blocks(a);
  const int64_t row = blocks.row, kvh = a.kv_heads;
  const int64_t* table = a.tables + b * a.width;
  float* qf = buf;
  float* acc = qf + group * dim;
  float* kv = acc + group * dim;
  float* s = kv + dim;  // [group, ctx]
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride + kh * group * dim;
#pragma omp simd
  for (int64_t i = 0; i < group * dim; ++i) {
    qf[i] = to_f32(q[i]) * a.scale;
    acc[i] = 0.0f;
  }
  for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += a.block_size, ++blk) {
    const C* k = blocks.k(table[blk]) + kh * dim;
    const float* sc = blocks.k_scales(table[blk]) + kh;
    const int64_t n = std::min(a.block_size, ctx - t0);
    for (int64_t t = 0; t < n; ++t, k += row) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) kv[d] = kv_f32(k[d]);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kv[d];
        s[g * ctx + t0 + t] = kScaled<C> ? dot * sc[t * kvh] : dot;
      }
    }
  }
  float sums[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * ctx;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < ctx; ++t) m = sg[t] > m ? sg[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      float e = exp_f32(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    sums[g] = sum;
  }
  for (int64_t t0 = 0, blk = 0; t0 < ctx; t0 += a.block_size, ++blk) {
    const C* v = blocks.v(table[blk]) + kh * dim;
    const float* sc = blocks.v_scales(table[blk]) + kh;
    const int64_t n = std::min(a.block_size, ctx - t0);
    for (int64_t t = 0; t < n; ++t, v += row) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) kv[d] = kv_f32(v[d]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = kScaled<C> ? s[g * ctx + t0 + t] * sc[t * kvh] : s[g * ctx + t0 + t];
        float* ag = acc + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) ag[d] += p * kv[d];
      }
    }
  }
  T* out = static_cast<T*>(a.out) + (b * a.heads + kh * group) * dim;
  for (int64_t g = 0; g < group; ++g) {
    const float sum = sums[g];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) store(out, g * dim + d, acc[g * dim + d] / sum);
  }
}

// T: the model's dtype (q and out); C: the cache's element (T itself, int8_t, or uint8_t for e4m3 bits).
template <class T, class C>
SS_INLINE void attend_impl(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    switch (a.dim) {
      case 64: attend_dim<T, C, 64>(a, b, kh, buf); break;
      case 128: attend_dim<T, C, 128>(a, b, kh, buf); break;
      default: attend_dim<T, C, 0>(a, b, kh, buf); break;
    }
  }
}

template <class T>
using Attend = void (*)(const Attn&, int64_t, int64_t, int64_t, float*);
template <class T, class C>
SS_V4 void attend_v4(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  attend_impl<T, C>(a, b, kh0, kh1, buf);
}
template <class T, class C>
SS_V3 void attend_v3(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  attend_impl<T, C>(a, b, kh0, kh1, buf);
}
template <class T, class C>
void attend_v1(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  attend_impl<T, C>(a, b, kh0, kh1, buf);
}

// --------------------------------------------------------- the quantized write

// fp32 to e4m3fn bits, round to nearest even: c10's fp8e4m3fn_from_fp32_value,
// its three cases computed side by side and selected (so that a row vectorizes).
SS_INLINE uint8_t fp8_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t denorm = UINT32_C(141) << 23;
  float x, d;
  std::memcpy(&x, &u, sizeof(x));
  std::memcpy(&d, &denorm, sizeof(d));
  x += d;
  uint32_t ud;
  std::memcpy(&ud, &x, sizeof(ud));
  const uint32_t r_denorm = ud - denorm;
  const uint32_t r_normal = (u + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u)) >> 20;
  uint32_t r = u < (UINT32_C(121) << 23) ? r_denorm : r_normal;
  r = u >= (UINT32_C(1087) << 20) ? 0x7fu : r;
  return static_cast<uint8_t>((r | (sign >> 24)) & 0xffu);
}

SS_INLINE void quantize_to(int8_t* p, float y) {
  // round half to even as torch.round, for |y| <= 127: the 1.5 * 2^23 trick (no libm call)
  float r = (y + 12582912.0f) - 12582912.0f;
  r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
  *p = static_cast<int8_t>(r);
}
SS_INLINE void quantize_to(uint8_t* p, float y) {
  y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
  *p = fp8_bits(y);
}
constexpr float qmax(int8_t*) { return 127.0f; }
constexpr float qmax(uint8_t*) { return 448.0f; }


// One head's row x (dim elements) quantized: scale = max|x| / qmax (0 for a zero
// row, whose values are 0) and value = round(x / scale), as quantize_rows in
// engine/kv_cache.py; compiled per ISA so that both loops vectorize.
template <class T, class C>
SS_INLINE void quantize_row_q(const T* x, C* dst, float* scale_out, int64_t dim) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < dim; ++d) {
    // the builtin, not std::fabs: under this file's optimize pragma GCC calls libm's for each element
    const float v = __builtin_fabsf(to_f32(x[d]));
    amax = v > amax ? v : amax;
  }
  const float scale = amax / qmax(static_cast<C*>(nullptr));
  const float safe = scale > 0.0f ? scale : 1.0f;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) quantize_to(dst + d, to_f32(x[d]) / safe);
  *scale_out = scale;
}
template <class T>
SS_INLINE void quantize_i8_row_impl(const T* x, void* dst, float* scale_out, int64_t dim) {
  quantize_row_q<T, int8_t>(x, static_cast<int8_t*>(dst), scale_out, dim);
}
template <class T>
SS_INLINE void quantize_f8_row_impl(const T* x, void* dst, float* scale_out, int64_t dim) {
  quantize_row_q<T, uint8_t>(x, static_cast<uint8_t*>(dst), scale_out, dim);
}
template <class T>
using QuantizeRow = void (*)(const T*, void*, float*, int64_t);
SS_VARIANTS(quantize_i8_row, (const T* x, void* dst, float* scale_out, int64_t dim), (x, dst, scale_out, dim))
SS_VARIANTS(quantize_f8_row, (const T* x, void* dst, float* scale_out, int64_t dim), (x, dst, scale_out, dim))

// Each new row's K and V (after RoPE) quantized into its slot, head by head.
template <class T, class C>
void write_new_kv_q(const Attn& a, QuantizeRow<T> quantize_row) {
  const int64_t row = a.kv_heads * a.dim, v_off = a.block_size * row, block_bytes = q_block_bytes(a);
  uint8_t* cache = static_cast<uint8_t*>(a.cache);
  for (int64_t b = 0; b < a.b; ++b) {
    uint8_t* base = cache + a.slot_blocks[b] * block_bytes;
    for (int kv = 0; kv < 2; ++kv) {
      const T* src = static_cast<const T*>(kv == 0 ? a.k_new : a.v_new) + b * a.kv_stride;
      C* dst = reinterpret_cast<C*>(base) + kv * v_off + a.slot_offsets[b] * row;
      float* sc = reinterpret_cast<float*>(base + 2 * v_off) + (kv * a.block_size + a.slot_offsets[b]) * a.kv_heads;
      for (int64_t h = 0; h < a.kv_heads; ++h) quantize_row(src + h * a.dim, dst + h * a.dim, sc + h, a.dim);
    }
  }
}

// ---------------------------------------------- decode attention, AVX-512
//
// The portable loops above leave the compiler a horizontal sum per token and
// head (16 lanes added one by one: fp addition does not reassociate) and the
// V accumulators in memory, and they read one kv head's short rows at a time.
// Here a sequence is walked block by block for all its kv heads at once, so
// K (then V) is read in address order with the next block prefetched; q and
// the accumulators of a few heads sit in registers, and four tokens' dot
// products are summed across lanes together. For head_dim 32, 64 and 128
// (NV = 2, 4, 8 vectors of 16); other sizes take the portable code.

// One row of D = 16 * NV elements as NV fp32 vectors. bf16 rows come in
// permuted lane order: 32 elements load as one vector, and a shift and a mask
// make the even elements one fp32 vector and the odd ones the next (instead of
// two widening loads). q, K and V all use the same order, so dot products
// and weighted sums are unaffected; the output is put back in order at the end.
template <int NV>
SS_V4 SS_INLINE void load_row(const uint16_t* p, __m512* v) {
  static_assert(NV % 2 == 0, "bf16 rows are loaded 32 elements at a time");
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int c = 0; c < NV / 2; ++c) {
    const __m512i x = _mm512_loadu_si512(p + 32 * c);
    v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
}
template <int NV>
SS_V4 SS_INLINE void load_row(const float* p, __m512* v) {
  for (int c = 0; c < NV; ++c) v[c] = _mm512_loadu_ps(p + 16 * c);
}
// load_row's inverse: v * scale stored as one row, rounded to bf16 as
// bf16_bits does (round to nearest even, NaN to 0x7fc0).
template <int NV>
SS_V4 SS_INLINE void store_row(uint16_t* p, const __m512* v, __m512 scale) {
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i nan = _mm512_set1_epi32(0x7fc00000), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512i r[2];
  for (int c = 0; c < NV / 2; ++c) {
    for (int j = 0; j < 2; ++j) {
      const __m512 x = _mm512_mul_ps(v[2 * c + j], scale);
      const __m512i u = _mm512_castps_si512(x);
      const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
      r[j] = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    }
    // even elements from the high halves of r[0], odd ones from those of r[1]
    _mm512_storeu_si512(p + 32 * c, _mm512_or_si512(_mm512_srli_epi32(r[0], 16), _mm512_and_si512(r[1], high)));
  }
}
template <int NV>
SS_V4 SS_INLINE void store_row(float* p, const __m512* v, __m512 scale) {
  for (int c = 0; c < NV; ++c) _mm512_storeu_ps(p + 16 * c, _mm512_mul_ps(v[c], scale));
}

// The next block's rows for this head, requested while this block is computed:
// a head's rows are short strided runs (head_dim elements every kv_heads *
// head_dim) that the hardware prefetchers pick up late, and at large batch the
// cache is far bigger than L2.
template <class T>
SS_INLINE void prefetch_rows(const T* p, int64_t row, int64_t rows, int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + r * row) + off, 0, 1);
}

// out[0..3] = the sums of a, b, c and d (linear.cpp's reduce4).
SS_V4 SS_INLINE void sum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, q);
}

// q . k as 16 partial sums, both in registers.
template <int NV>
SS_V4 SS_INLINE __m512 dot(const __m512* q, const __m512* k) {
  __m512 p = _mm512_mul_ps(q[0], k[0]);
  for (int c = 1; c < NV; ++c) p = _mm512_fmadd_ps(q[c], k[c], p);
  return p;
}

// bf16 q and output rows in natural order, beside one-byte K/V rows (which
// widen 16 at a time in order): bf16 bits shifted into an fp32's high half;
// and back, rounded as store_row rounds.
template <int NV>
SS_V4 SS_INLINE void load_row_natural(const uint16_t* p, __m512* v) {
  for (int c = 0; c < NV; ++c) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
    v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  }
}
template <int NV>
SS_V4 SS_INLINE void store_row_natural(uint16_t* p, const __m512* v, __m512 scale) {
  const __m512i half = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7fc00000);
  for (int c = 0; c < NV; ++c) {
    const __m512 x = _mm512_mul_ps(v[c], scale);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    const __m512i r = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
}

// K and V rows as NV fp32 vectors. The cache's own bf16 or fp32: load_row.
template <int NV>
SS_V4 SS_INLINE void load_kv(const uint16_t* p, __m512* v) {
  load_row<NV>(p, v);
}
template <int NV>
SS_V4 SS_INLINE void load_kv(const float* p, __m512* v) {
  load_row<NV>(p, v);
}
// int8: 16 bytes sign-extended to 16 int32 lanes, converted (exact).
template <int NV>
SS_V4 SS_INLINE void load_kv(const int8_t* p, __m512* v) {
  for (int c = 0; c < NV; ++c)
    v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c))));
}
// e4m3 through fp16, whose format has e4m3's mantissa and one more exponent
// bit: the sign-extended byte shifted left by 7, its second bit (a copy of the
// sign) cleared, is the fp16 of value / 256 exactly, subnormals included (fp16
// subnormals are e4m3's, scaled), and vcvtph2ps widens 16 of them at once, to
// fp32 normals. Three integer operations per 32 values instead of kv_f32's
// dozen per 16; the 2^8 goes into each token's scale (kKvUnit), exactly.
template <int NV>
SS_V4 SS_INLINE void load_kv(const uint8_t* p, __m512* v) {
  static_assert(NV % 2 == 0, "e4m3 rows are widened 32 values at a time");
  const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0xbfff));
  for (int c = 0; c < NV / 2; ++c) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c)));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(w, 7), keep);
    v[2 * c] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    v[2 * c + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
}
// What load_kv's values must be multiplied by (with the token's scale): 2^8 for e4m3 (above).
template <class C>
constexpr float kKvUnit = sizeof(C) == 1 && !std::is_signed_v<C> ? 256.0f : 1.0f;

// q's and the output's lane order follows the K/V rows': load_row's permuted
// order beside bf16 K/V, natural beside fp32 or one-byte rows.
template <class T, class C>
constexpr bool kNaturalBf16 = sizeof(T) == 2 && sizeof(C) == 1;
template <class T, class C, int NV>
SS_V4 SS_INLINE void load_q(const T* p, __m512* v) {
  if constexpr (kNaturalBf16<T, C>) load_row_natural<NV>(p, v);
  else load_row<NV>(p, v);
}
template <class T, class C, int NV>
SS_V4 SS_INLINE void store_out(T* p, const __m512* v, __m512 scale) {
  if constexpr (kNaturalBf16<T, C>) store_row_natural<NV>(p, v, scale);
  else store_row<NV>(p, v, scale);
}

// Scores for query heads g0 .. g0 + GC - 1 (q, prescaled, in qf) of kv head
// kh against the n tokens of one block; k points at the block's row 0 of kh,
// sc at its token 0's scale of kh (quantized rows; sc_stride floats apart).
template <class C, int NV, int GC>
SS_V4 SS_INLINE void block_scores(const float* qf, const C* k, int64_t row, int64_t n, float* s, int64_t ctx,
                                  const float* sc, int64_t sc_stride) {
  __m512 q[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV; ++c) q[g][c] = _mm512_loadu_ps(qf + (g * NV + c) * 16);
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {  // each K row is loaded and widened once for all GC heads
    __m512 p[4][GC];
    for (int j = 0; j < 4; ++j) {
      __m512 kv[NV];
      load_kv<NV>(k + (t + j) * row, kv);
      for (int g = 0; g < GC; ++g) p[j][g] = dot<NV>(q[g], kv);
    }
    for (int g = 0; g < GC; ++g) sum4(p[0][g], p[1][g], p[2][g], p[3][g], s + g * ctx + t);
  }
  for (; t < n; ++t) {
    __m512 kv[NV];
    load_kv<NV>(k + t * row, kv);
    for (int g = 0; g < GC; ++g) s[g * ctx + t] = _mm512_reduce_add_ps(dot<NV>(q[g], kv));
  }
  if constexpr (kScaled<C>) {
    for (int g = 0; g < GC; ++g)
      for (int64_t j = 0; j < n; ++j) s[g * ctx + j] *= sc[j * sc_stride] * kKvUnit<C>;
  }
}

// acc (GC heads x head_dim, fp32, in memory between blocks) += p . V over the
// n tokens of one block; v points at the block's V row 0 of the kv head, sc
// as in block_scores.
template <class C, int NV, int GC>
SS_V4 SS_INLINE void block_values(const float* p, int64_t ctx, const C* v, int64_t row, int64_t n, float* acc,
                                  const float* sc, int64_t sc_stride) {
  __m512 a[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * NV + c) * 16);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[NV];
    load_kv<NV>(v + t * row, vv);
    const float st = kScaled<C> ? sc[t * sc_stride] * kKvUnit<C> : 1.0f;
    for (int g = 0; g < GC; ++g) {
      const __m512 pg = _mm512_set1_ps(kScaled<C> ? p[g * ctx + t] * st : p[g * ctx + t]);
      for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(pg, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (g * NV + c) * 16, a[g][c]);
}

// A group's query heads in chunks of at most kChunk, so that a chunk's q
// (scores) or accumulators (values) fit in registers with room to spare.
template <int NV>
constexpr int64_t kChunk = NV <= 4 ? 4 : 2;

#define SS_FOR_HEAD_CHUNKS(NV, group, CALL)                        \
  for (int64_t g0 = 0; g0 < (group); g0 += kChunk<NV>) {           \
    switch (std::min(kChunk<NV>, (group) - g0)) {                  \
      case 1: CALL(1); break;                                      \
      case 2: CALL(2); break;                                      \
      case 3: if constexpr (kChunk<NV> >= 3) CALL(3); break;       \
      default: if constexpr (kChunk<NV> >= 4) CALL(4); break;      \
    }                                                              \
  }

// Sequence b, kv heads kh0 .. kh1 - 1 and their query heads. Block by block,
// all those heads at once: a block's K (then V) rows are read in address
// order while the next block's are prefetched, which at large batch, when the
// cache lives in DRAM, is what sets the speed. buf: see attn_buf_len.
template <class T, class C, int NV>
SS_V4 void attend_seq_v4(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  constexpr int64_t D = 16 * NV;
  const int64_t group = a.heads / a.kv_heads, ctx = a.context_lens[b], bs = a.block_size, kvh = a.kv_heads;
  const Blocks<C> blocks(a);
  const int64_t row = blocks.row;
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;  // query heads h0 .. h0 + nh - 1
  const int64_t* table = a.tables + b * a.width;
  const int64_t last = (ctx - 1) / bs;
  // a block's rows of kv heads kh0 .. kh1 - 1: one run of (kh1 - kh0) * D elements per token
  const int64_t run_bytes = (kh1 - kh0) * D * static_cast<int64_t>(sizeof(C));
  float* qf = buf;             // [nh, D], scaled, in load_q's lane order
  float* acc = qf + nh * D;    // [nh, D], the same order
  float* s = acc + nh * D;     // [nh, ctx]
  float* sums = s + nh * ctx;  // [nh]
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride + h0 * D;
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t h = 0; h < nh; ++h) {
    __m512 qv[NV];
    load_q<T, C, NV>(q + h * D, qv);
    for (int c = 0; c < NV; ++c) {
      _mm512_storeu_ps(qf + h * D + 16 * c, _mm512_mul_ps(qv[c], scale));
      _mm512_storeu_ps(acc + h * D + 16 * c, _mm512_setzero_ps());
    }
  }

  for (int64_t blk = 0, t0 = 0; blk <= last; ++blk, t0 += bs) {
    const C* k = blocks.k(table[blk]) + kh0 * D;
    const float* sc = blocks.k_scales(table[blk]) + kh0;
    if (blk < last) prefetch_rows(blocks.k(table[blk + 1]) + kh0 * D, row, bs, run_bytes);
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
#define SS_SCORES(GC)                                                                                         \
  block_scores<C, NV, GC>(qf + (kh * group + g0) * D, k + kh * D, row, n, s + (kh * group + g0) * ctx + t0, ctx, \
                          sc + kh, kvh)
      SS_FOR_HEAD_CHUNKS(NV, group, SS_SCORES)
#undef SS_SCORES
    }
  }

  for (int64_t h = 0; h < nh; ++h) {
    float* sh = s + h * ctx;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= ctx; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sh + t));
    float m = _mm512_reduce_max_ps(mv);
    for (; t < ctx; ++t) m = sh[t] > m ? sh[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < ctx; ++i) {
      float e = exp_f32(sh[i] - m);
      sh[i] = e;
      sum += e;
    }
    sums[h] = sum;
  }

  for (int64_t blk = 0, t0 = 0; blk <= last; ++blk, t0 += bs) {
    const C* v = blocks.v(table[blk]) + kh0 * D;
    const float* sc = blocks.v_scales(table[blk]) + kh0;
    if (blk < last) prefetch_rows(blocks.v(table[blk + 1]) + kh0 * D, row, bs, run_bytes);
    const int64_t n = std::min(bs, ctx - t0);
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
#define SS_VALUES(GC)                                                                                          \
  block_values<C, NV, GC>(s + (kh * group + g0) * ctx + t0, ctx, v + kh * D, row, n, acc + (kh * group + g0) * D, \
                          sc + kh, kvh)
      SS_FOR_HEAD_CHUNKS(NV, group, SS_VALUES)
#undef SS_VALUES
    }
  }

  T* out = static_cast<T*>(a.out) + (b * a.heads + h0) * D;
  for (int64_t h = 0; h < nh; ++h) {
    __m512 o[NV];
    for (int c = 0; c < NV; ++c) o[c] = _mm512_loadu_ps(acc + h * D + 16 * c);
    store_out<T, C, NV>(out + h * D, o, _mm512_set1_ps(1.0f / sums[h]));
  }
}

template <class T, class C>
SS_V4 void attend_avx512(const Attn& a, int64_t b, int64_t kh0, int64_t kh1, float* buf) {
  switch (a.dim) {
    case 32: return attend_seq_v4<T, C, 2>(a, b, kh0, kh1, buf);
    case 64: return attend_seq_v4<T, C, 4>(a, b, kh0, kh1, buf);
    case 128: return attend_seq_v4<T, C, 8>(a, b, kh0, kh1, buf);
    default: return attend_v4<T, C>(a, b, kh0, kh1, buf);
  }
}

// ------------------------------------------------------------ ISA dispatch

constexpr int kIsaBaseline = 1;  // x86-64 (SSE2)
constexpr int kIsaAvx2 = 2;      // x86-64-v3
constexpr int kIsaAvx512 = 3;    // x86-64-v4

int detect_isa() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the ymm/zmm state.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2"))
    return kIsaAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
      __builtin_cpu_supports("f16c"))
    return kIsaAvx2;
  return kIsaBaseline;
}

const int g_isa = detect_isa();

template <class T>
struct Ops {
  RmsNormRow<T> rms_norm_row;
  RopeRow<T> rope_row;
  SiluMulRow<T> silu_mul_row;
  Attend<T> attend[3];  // by kv_kind: the cache's own T, int8, e4m3
  QuantizeRow<T> quantize_i8_row;
  QuantizeRow<T> quantize_f8_row;
  // draw's two passes read the fp32 logits whatever the model's T, so they are typed on float and
  // filled with the float variants for every T.
  LogitMax logit_max;
  ExpSum exp_sum;
};

template <class T>
Ops<T> ops_for(int isa) {
  switch (isa) {
    case kIsaAvx512:
      return {rms_norm_row_v4<T>,
              rope_row_v4<T>,
              silu_mul_row_v4<T>,
              {attend_avx512<T, T>, attend_avx512<T, int8_t>, attend_avx512<T, uint8_t>},
              quantize_i8_row_v4<T>,
              quantize_f8_row_v4<T>,
              logit_max_v4<float>,
              exp_sum_v4<float>};
    case kIsaAvx2:
      return {rms_norm_row_v3<T>,
              rope_row_v3<T>,
              silu_mul_row_v3<T>,
              {attend_v3<T, T>, attend_v3<T, int8_t>, attend_v3<T, uint8_t>},
              quantize_i8_row_v3<T>,
              quantize_f8_row_v3<T>,
              logit_max_v3<float>,
              exp_sum_v3<float>};
    default:
      return {rms_norm_row_v1<T>,
              rope_row_v1<T>,
              silu_mul_row_v1<T>,
              {attend_v1<T, T>, attend_v1<T, int8_t>, attend_v1<T, uint8_t>},
              quantize_i8_row_v1<T>,
              quantize_f8_row_v1<T>,
              logit_max_v1<float>,
              exp_sum_v1<float>};
  }
}

template <class T>
void write_new_kv(const Attn& a) {
  const int64_t row = a.kv_heads * a.dim, v_off = a.block_size * row, block_stride = 2 * v_off;
  T* cache = static_cast<T*>(a.cache);
  for (int64_t b = 0; b < a.b; ++b) {
    T* dst = cache + a.slot_blocks[b] * block_stride + a.slot_offsets[b] * row;
    std::memcpy(dst, static_cast<const T*>(a.k_new) + b * a.kv_stride, row * sizeof(T));
    std::memcpy(dst + v_off, static_cast<const T*>(a.v_new) + b * a.kv_stride, row * sizeof(T));
  }
}

// Below this many multiply-adds a step's attention runs on one thread: waking
// the team costs a few microseconds.
constexpr int64_t kParallelMinWork = 1 << 17;

// Items are whole sequences, on one thread or spread over `threads`; with
// fewer sequences than threads, sequences are cut into ranges of kv heads. A
// head's arithmetic is the same however the work is cut.
template <class T>
void attention(const Attn& a, const Ops<T>& ops, bool write, bool read, int64_t threads) {
  if (write) {
    if (a.cos != nullptr) {  // q and k rows are the caller's to rotate in place
      const T* cos = static_cast<const T*>(a.cos);
      const T* sin = static_cast<const T*>(a.sin);
      for (int64_t b = 0; b < a.b; ++b) {
        ops.rope_row(static_cast<T*>(a.q) + b * a.q_stride, a.heads, a.dim, cos + b * a.dim, sin + b * a.dim);
        ops.rope_row(static_cast<T*>(a.k_new) + b * a.kv_stride, a.kv_heads, a.dim, cos + b * a.dim, sin + b * a.dim);
      }
    }
    if (a.kv_kind == kKvInt8) write_new_kv_q<T, int8_t>(a, ops.quantize_i8_row);
    else if (a.kv_kind == kKvFp8) write_new_kv_q<T, uint8_t>(a, ops.quantize_f8_row);
    else write_new_kv<T>(a);
  }
  if (!read) return;
  const Attend<T> attend = ops.attend[a.kv_kind];
  int64_t work = 0, max_ctx = 0;
  for (int64_t b = 0; b < a.b; ++b) {
    work += a.context_lens[b];
    max_ctx = std::max(max_ctx, a.context_lens[b]);
  }
  work *= 2 * a.heads * a.dim;
  const int64_t buf_len = attn_buf_len(a, max_ctx);
  const bool parallel = threads > 1 && work >= kParallelMinWork && !omp_in_parallel();
  const int64_t splits = parallel && a.b < threads ? std::min(a.kv_heads, (threads + a.b - 1) / a.b) : 1;
  const int64_t items = a.b * splits;
  auto run = [&](int64_t i, float* buf) {
    const int64_t b = i / splits, j = i % splits;
    attend(a, b, j * a.kv_heads / splits, (j + 1) * a.kv_heads / splits, buf);
  };
  if (!parallel || items < 2) {
    float* buf = scratch(buf_len);
    for (int64_t i = 0; i < items; ++i) run(i, buf);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(std::min(threads, items)))
  {
    float* buf = scratch(buf_len);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) run(i, buf);
  }
}

// The indices a wrong scheduler could get wrong, checked before anything is read.
const char* check_indices(const Attn& a, bool write, bool read) {
  for (int64_t b = 0; b < a.b; ++b) {
    if (write) {
      if (a.slot_blocks[b] < 0 || a.slot_blocks[b] >= a.num_blocks) return "slot block outside the cache";
      if (a.slot_offsets[b] < 0 || a.slot_offsets[b] >= a.block_size) return "slot offset outside its block";
    }
    if (!read) continue;
    const int64_t ctx = a.context_lens[b];
    if (ctx < 1 || ctx > a.width * a.block_size) return "context length outside 1 .. block-table width x block size";
    const int64_t used = (ctx + a.block_size - 1) / a.block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = a.tables[b * a.width + j];
      if (blk < 0 || blk >= a.num_blocks) return "block table entry outside the cache";
    }
  }
  return nullptr;
}

// ---------------------------------------------------- row-parallel drivers

// Elementwise kernels go parallel over rows past this many elements.
constexpr int64_t kParallelMinElems = 1 << 16;

template <class F>
void for_rows(int64_t rows, int64_t elems_per_row, int64_t threads, F&& f) {
  if (threads <= 1 || rows < 2 || rows * elems_per_row < kParallelMinElems || omp_in_parallel()) {
    for (int64_t r = 0; r < rows; ++r) f(r);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(std::min(threads, rows))) schedule(static)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

template <class T>
void rms_norm(T* out, T* h, const T* y, const T* w, int64_t rows, int64_t dim, float eps, int isa, int64_t threads) {
  auto row = ops_for<T>(isa).rms_norm_row;
  for_rows(rows, dim, threads,
           [&](int64_t r) { row(out + r * dim, h + r * dim, y ? y + r * dim : nullptr, w, dim, eps); });
}

template <class T>
void rope(T* x, const T* cos, const T* sin, int64_t rows, int64_t stride, int64_t heads, int64_t dim, int isa) {
  auto row = ops_for<T>(isa).rope_row;
  for (int64_t r = 0; r < rows; ++r) row(x + r * stride, heads, dim, cos + r * dim, sin + r * dim);
}

template <class T>
void silu_mul(T* out, const T* gu, int64_t rows, int64_t n, int isa, int64_t threads) {
  auto row = ops_for<T>(isa).silu_mul_row;
  for_rows(rows, n, threads, [&](int64_t r) { row(out + r * n, gu + r * 2 * n, gu + r * 2 * n + n, n); });
}

// One row's token (see logit_max_impl). exp_f32 gives the same bits in the scan as in the vector
// sums (no contraction, the same operations), so a token of probability 0 adds nothing to the
// running sum and is never the one that passes the target; the block found holds mass, so the scan
// returns inside it, and where rounding keeps the running sum just short, the block's last token
// of nonzero probability is taken.
int64_t draw_row(const float* x, int64_t n, float t, double u, LogitMax logit_max, ExpSum exp_sum) {
  const float inv_t = 1.0f / t;  // a multiply per logit instead of a divide: a third of the pass
  float m = 0.0f;
  logit_max(x, n, inv_t, &m);
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  std::vector<double> upto(static_cast<size_t>(blocks));  // running sum at each block's end
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    double s = 0.0;
    exp_sum(x + b * kDrawBlock, std::min(kDrawBlock, n - b * kDrawBlock), inv_t, m, &s);
    upto[b] = total += s;
  }
  const double target = u * total;
  const int64_t b = std::min<int64_t>(std::upper_bound(upto.begin(), upto.end(), target) - upto.begin(), blocks - 1);
  double run = b ? upto[b - 1] : 0.0;
  int64_t last = -1;
  for (int64_t v = b * kDrawBlock, end = std::min(n, (b + 1) * kDrawBlock); v < end; ++v) {
    const float e = exp_f32(finite_logit(x[v], inv_t) - m);
    if (e > 0.0f) {
      last = v;
      if ((run += e) > target) return v;
    }
  }
  return last;
}

void draw(int64_t* out, const float* logits, const float* temps, const double* u, int64_t rows, int64_t n, int isa,
          int64_t threads) {
  const Ops<float> ops = ops_for<float>(isa);
  for_rows(rows, n, threads,
           [&](int64_t r) { out[r] = draw_row(logits + r * n, n, temps[r], u[r], ops.logit_max, ops.exp_sum); });
}

// ------------------------------------------------------------------ module

// Reads `nargs` == `want` arguments: ints, except a float at index `float_at` (if >= 0).
bool parse(const char* name, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want, long long* ints,
           Py_ssize_t float_at = -1, double* value = nullptr) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    ints[i] = 0;
    if (i == float_at) *value = PyFloat_AsDouble(args[i]);
    else ints[i] = PyLong_AsLongLong(args[i]);
    if (PyErr_Occurred()) return false;
  }
  return true;
}

// The ISA argument: 0 picks the best this CPU has; a level above it is refused.
bool resolve_isa(const char* name, long long want, int* isa) {
  if (want < 0 || want > g_isa) {
    PyErr_Format(PyExc_ValueError, "%s: ISA level %lld not available (this CPU: %d)", name, want, g_isa);
    return false;
  }
  *isa = want == 0 ? g_isa : static_cast<int>(want);
  return true;
}

template <class P>
P* ptr(long long v) {
  return reinterpret_cast<P*>(static_cast<intptr_t>(v));
}

PyObject* py_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[10];
  double eps = 0.0;
  int isa;
  if (!parse("rms_norm", args, nargs, 10, v, 6, &eps) || !resolve_isa("rms_norm", v[9], &isa)) return nullptr;
  const int64_t rows = v[4], dim = v[5], threads = v[8];
  if (rows <= 0 || dim <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  if (v[7])
    rms_norm(ptr<uint16_t>(v[0]), ptr<uint16_t>(v[1]), ptr<const uint16_t>(v[2]), ptr<const uint16_t>(v[3]), rows,
             dim, static_cast<float>(eps), isa, threads);
  else
    rms_norm(ptr<float>(v[0]), ptr<float>(v[1]), ptr<const float>(v[2]), ptr<const float>(v[3]), rows, dim,
             static_cast<float>(eps), isa, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_rope(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[9];
  int isa;
  if (!parse("rope", args, nargs, 9, v) || !resolve_isa("rope", v[8], &isa)) return nullptr;
  const int64_t rows = v[3], stride = v[4], heads = v[5], dim = v[6];
  if (dim % 2 != 0 || dim > 2 * kMaxHalf) {
    PyErr_Format(PyExc_ValueError, "rope: head_dim must be even and at most %d", 2 * kMaxHalf);
    return nullptr;
  }
  if (rows <= 0 || heads <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  if (v[7])
    rope(ptr<uint16_t>(v[0]), ptr<const uint16_t>(v[1]), ptr<const uint16_t>(v[2]), rows, stride, heads, dim, isa);
  else
    rope(ptr<float>(v[0]), ptr<const float>(v[1]), ptr<const float>(v[2]), rows, stride, heads, dim, isa);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_silu_mul(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[7];
  int isa;
  if (!parse("silu_mul", args, nargs, 7, v) || !resolve_isa("silu_mul", v[6], &isa)) return nullptr;
  const int64_t rows = v[2], n = v[3], threads = v[5];
  if (rows <= 0 || n <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  if (v[4]) silu_mul(ptr<uint16_t>(v[0]), ptr<const uint16_t>(v[1]), rows, n, isa, threads);
  else silu_mul(ptr<float>(v[0]), ptr<const float>(v[1]), rows, n, isa, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_decode_attention(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[27];
  double scale = 0.0;
  int isa;
  if (!parse("decode_attention", args, nargs, 27, v, 21, &scale) || !resolve_isa("decode_attention", v[25], &isa))
    return nullptr;
  Attn a{};
  a.out = ptr<void>(v[0]);
  a.q = ptr<void>(v[1]);
  a.q_stride = v[2];
  a.k_new = ptr<void>(v[3]);
  a.v_new = ptr<const void>(v[4]);
  a.kv_stride = v[5];
  a.slot_blocks = ptr<const int64_t>(v[6]);
  a.slot_offsets = ptr<const int64_t>(v[7]);
  a.cache = ptr<void>(v[8]);
  a.num_blocks = v[9];
  a.tables = ptr<const int64_t>(v[10]);
  a.width = v[11];
  a.context_lens = ptr<const int64_t>(v[12]);
  a.cos = ptr<const void>(v[13]);
  a.sin = ptr<const void>(v[14]);
  a.b = v[15];
  a.heads = v[16];
  a.kv_heads = v[17];
  a.dim = v[18];
  a.block_size = v[19];
  const bool bf16 = v[20] != 0;
  a.scale = static_cast<float>(scale);
  const bool write = v[22] != 0, read = v[23] != 0;
  const int64_t threads = v[24];
  if (v[26] < kKvNative || v[26] > kKvFp8) {
    PyErr_Format(PyExc_ValueError, "decode_attention: kv_kind %lld is not 0 (native), 1 (int8) or 2 (fp8)", v[26]);
    return nullptr;
  }
  a.kv_kind = static_cast<int>(v[26]);
  if ((a.cos == nullptr) != (a.sin == nullptr) || (a.cos != nullptr && (a.dim % 2 != 0 || a.dim > 2 * kMaxHalf))) {
    PyErr_Format(PyExc_ValueError, "decode_attention: cos and sin go together, head_dim even and at most %d",
                 2 * kMaxHalf);
    return nullptr;
  }
  if (a.kv_heads <= 0 || a.heads % a.kv_heads != 0 || a.heads / a.kv_heads > kMaxGroup || a.dim <= 0 ||
      a.block_size <= 0) {
    PyErr_Format(PyExc_ValueError, "decode_attention: heads must be a multiple (at most %dx) of kv_heads",
                 kMaxGroup);
    return nullptr;
  }
  if (a.b <= 0) Py_RETURN_NONE;
  if (const char* bad = check_indices(a, write, read)) {
    PyErr_Format(PyExc_IndexError, "decode_attention: %s", bad);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  if (bf16) attention<uint16_t>(a, ops_for<uint16_t>(isa), write, read, threads);
  else attention<float>(a, ops_for<float>(isa), write, read, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_draw(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long v[8];
  int isa;
  if (!parse("draw", args, nargs, 8, v) || !resolve_isa("draw", v[7], &isa)) return nullptr;
  const int64_t rows = v[4], n = v[5], threads = v[6];
  if (rows <= 0 || n <= 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  draw(ptr<int64_t>(v[0]), ptr<const float>(v[1]), ptr<const float>(v[2]), ptr<const double>(v[3]), rows, n, isa,
       threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyLong_FromLong(g_isa); }

#define SS_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))

// Pointers are ints (0 for none), bf16 is 1 for bf16 tensors and 0 for fp32, threads is
// torch's thread count, isa 0 picks the best level the CPU has (1 x86-64, 2 AVX2, 3 AVX-512).
PyMethodDef kMethods[] = {
    {"rms_norm", SS_FASTCALL(py_rms_norm), METH_FASTCALL,
     "rms_norm(out, h, y, weight, rows, dim, eps, bf16, threads, isa): if y, h += y in place;\n"
     "then out = weight * rms_norm(h), row by row. eps is a float."},
    {"rope", SS_FASTCALL(py_rope), METH_FASTCALL,
     "rope(x, cos, sin, rows, row_stride, heads, head_dim, bf16, isa): rotate_half RoPE in place on\n"
     "the first `heads` heads of each row; cos and sin are [rows, head_dim]."},
    {"silu_mul", SS_FASTCALL(py_silu_mul), METH_FASTCALL,
     "silu_mul(out, gate_up, rows, n, bf16, threads, isa): out[r] = silu(gate_up[r, :n]) * gate_up[r, n:]."},
    {"decode_attention", SS_FASTCALL(py_decode_attention), METH_FASTCALL,
     "decode_attention(out, q, q_stride, k_new, v_new, kv_stride, slot_blocks, slot_offsets, cache,\n"
     "num_blocks, block_tables, width, context_lens, cos, sin, batch, heads, kv_heads, head_dim,\n"
     "block_size, bf16, scale, write, read, threads, isa, kv_kind): one query token per sequence. If\n"
     "write: RoPE on q and k_new in place (if cos), then the new K/V into their slots (kv_kind 1 int8,\n"
     "2 fp8 e4m3: quantized, the cache in engine/kv_cache.py's format). If read: out[b] =\n"
     "attention of q[b] over its context. scale is a float. Indices are checked (IndexError);\n"
     "everything else is trusted."},
    {"draw", SS_FASTCALL(py_draw), METH_FASTCALL,
     "draw(out, logits, temps, u, rows, vocab, threads, isa): out[r] (int64) = the token where the CDF of\n"
     "softmax(logits[r] / temps[r]) (fp32; NaN and infinities clamped to finite) passes u[r] (fp64, [0, 1))."},
    {"isa", py_isa, METH_NOARGS, "best ISA level of this CPU: 1 x86-64, 2 AVX2+FMA, 3 AVX-512"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "splitserve_decode",
                       "fused RMSNorm, RoPE, SiLU*mul and paged decode attention (splitserve.engine.kernels)", -1,
                       kMethods};

}  // namespace

#define SPLITSERVE_CONCAT2(a, b) a##b
#define SPLITSERVE_CONCAT(a, b) SPLITSERVE_CONCAT2(a, b)
PyMODINIT_FUNC SPLITSERVE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
