// Shared by the CPU kernels: 16-lane float vectors, element conversion, exp, dtype dispatch.
//
// Vectors are GCC/Clang vector extensions, not intrinsics: the extension is compiled with
// -march=native on the machine that runs it (gpu_proc/cpu_ext.py), so a 16-float vector is one
// AVX-512 register there and two AVX2 or four SSE registers elsewhere, from the same source.
// bfloat16 is widened by a shift and narrowed with round-to-nearest-even, as torch does.
#pragma once

#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ringserve_cpu {

// The helpers below are a handful of instructions each and sit in the innermost loops; GCC left
// `vexp` out of line (a call per 16 keys, 2-3 % of a step), so inlining is not left to it.
#define RS_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));

RS_INLINE vf splat(float x) { return vf{} + x; }

// Loads and stores of 16 elements at any alignment (memcpy compiles to one unaligned move).
RS_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

RS_INLINE vf load(const c10::BFloat16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  vf v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

RS_INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

RS_INLINE void store(c10::BFloat16* p, vf v) {
  vu32 b;
  std::memcpy(&b, &v, sizeof b);
  const vu32 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;  // round to nearest even
  const vu32 nan = (vu32)(v != v);
  const vu16 h = __builtin_convertvector((rounded & ~nan) | (0x7FC0u & nan), vu16);
  std::memcpy(p, &h, sizeof h);
}

// Rounds every lane through T and back: the values torch would hold after storing to a T tensor.
template <typename T> RS_INLINE vf round_to(vf v);
template <> RS_INLINE vf round_to<float>(vf v) { return v; }
template <> RS_INLINE vf round_to<c10::BFloat16>(vf v) {
  vu32 b;
  std::memcpy(&b, &v, sizeof b);
  const vu32 nan = (vu32)(v != v);
  const vu32 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;  // round to nearest even
  const vu32 r = (rounded & ~nan) | (0x7FC00000u & nan);
  vf out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

// Lane shuffles of two vectors (indices 0-31 pick from a then b), in each compiler's spelling.
#if defined(__clang__)
#define RS_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define RS_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// Horizontal sum and max as trees (4 shuffle steps), not a chain of 15 dependent operations.
RS_INLINE float hsum(vf v) {
  v += RS_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += RS_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += RS_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += RS_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

RS_INLINE vf vmax(vf a, vf b) { return a > b ? a : b; }

RS_INLINE float hmax(vf v) {
  v = vmax(v, RS_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, RS_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, RS_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, RS_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// out[j] = hsum(a[j]) for 16 vectors at once: a transpose-and-add butterfly (15 adds, 30 shuffles
// instead of 16 trees of 4 steps each). a is overwritten.
RS_INLINE vf hsum16(vf* a) {
  for (int k = 0; k < 8; ++k)  // lanes 0-7 <- a[2k], 8-15 <- a[2k+1]
    a[k] = RS_SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           RS_SHUFFLE(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)  // four lanes per key
    a[k] = RS_SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           RS_SHUFFLE(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)  // two lanes per key
    a[k] = RS_SHUFFLE(a[2 * k], a[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           RS_SHUFFLE(a[2 * k], a[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return RS_SHUFFLE(a[0], a[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         RS_SHUFFLE(a[0], a[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

RS_INLINE vi lane_index() { return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// exp(x) for x <= 88 within 2 ulp: 2^n from the exponent bits times a degree-6 polynomial for
// e^f, |f| <= 0.347. Lanes below -87 give exp(-87) (about 1.6e-38): softmax and SiLU never need
// the difference from 0.
RS_INLINE vf vexp(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  const vf y = x * 1.4426950408889634f;  // log2(e)
  const vf n = (y + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 drops the fraction
  const vf f = (y - n) * 0.6931471805599453f;
  vf p = splat(1.0f / 720.0f);
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// Scalar forms for loop tails (sizes that are not a multiple of 16).
RS_INLINE float to_f(float x) { return x; }
RS_INLINE float to_f(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T> inline T from_f(float f) { return T(f); }  // c10::BFloat16(float) rounds to nearest even
template <typename T> inline float round_to(float f) { return to_f(from_f<T>(f)); }
RS_INLINE float sexp(float x) { return vexp(splat(x))[0]; }

// sum a[i] * b[i]; a float32, b of type T.
template <typename T> inline float dot(const float* a, const T* b, int64_t n) {
  vf acc = splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * to_f(b[i]);
  return s;
}

// Runs the lambda with `scalar_t` bound to the C++ type of `dtype` (float32 or bfloat16).
#define RS_DISPATCH(dtype, name, ...)                                                        \
  [&] {                                                                                      \
    if ((dtype) == at::kFloat) {                                                             \
      using scalar_t = float;                                                                \
      return __VA_ARGS__();                                                                  \
    }                                                                                        \
    if ((dtype) == at::kBFloat16) {                                                          \
      using scalar_t = c10::BFloat16;                                                        \
      return __VA_ARGS__();                                                                  \
    }                                                                                        \
    TORCH_CHECK(false, name, ": dtype ", dtype, " is not supported (float32 and bfloat16 are)"); \
  }()

}  // namespace ringserve_cpu
