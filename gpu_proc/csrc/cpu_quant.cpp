// Linear layers with GGUF-quantized weights, read as they are stored (no dequantized copy).
//
// A weight is its GGUF blocks, uint8 [N, K / 32, block_bytes]: the last size names the format
// (Q4_0: 18 bytes, Q4_1: 20, Q8_0: 34; every block holds 32 weights of one output row). As in
// llama.cpp, the activations are quantized too, per 32 elements to int8 with a float scale (its
// Q8_0/Q8_1), so each block's dot is an integer one (AVX-512 VNNI / AVX-VNNI `dpbusd`, else AVX2
// `maddubs`; the integer sums are exact either way), scaled and summed in float:
//
//   Q8_0  w = d q             dot = d dx sum(q qx)
//   Q4_0  w = d (n - 8)       dot = d dx (sum(n qx) - 8 sum(qx))
//   Q4_1  w = d n + m         dot = d dx sum(n qx) + m dx sum(qx)
//
// Each output element depends on its own row of x and of the weight only, in a fixed order, so a
// row's result is the same whatever else is in the step (batch invariance, as the float path
// keeps it). Rows of x are taken four at a time so each unpacked weight block serves four dots
// (a prefill step's rows); a decode step's one row reads every weight byte once, which is what
// bounds decode. Spec: gpu_proc/quant.py (`qlinear_reference`, the same arithmetic in torch);
// test: tests/gpu_proc/test_quant.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace ringserve_cpu {
namespace {

constexpr int kBlock = 32;
constexpr int64_t kQ4_0 = 18, kQ4_1 = 20, kQ8_0 = 34;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RS_QUANT_512 1  // the grouped layout and its kernel; elsewhere the blocks as stored
#endif
constexpr int64_t kGroup = 16;    // blocks per run of the grouped layout
template <int64_t kBytes> constexpr int64_t kValueBytes = kBytes == kQ8_0 ? 512 : 256;  // a run's values
constexpr int kRows = 4;          // rows of x per pass over a weight row's blocks
constexpr int64_t kNGrain = 16;   // weight rows per parallel task

RS_INLINE float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The activations of one call: per row and 32-element block, int8 values, their scale and their sum.
struct XQuant {
  std::vector<int8_t> q;    // [T, K]
  std::vector<float> d;     // [T, K / 32]
  std::vector<int32_t> s;   // [T, K / 32]: sum of q
  std::vector<float> ds;    // [T, K / 32]: d * sum of q (the Q4 formats' offset term)
  std::vector<float> dv;    // [T, K / 32 * 8]: d repeated over the 8 int32 lanes of its block's dot
  std::vector<int8_t> xg;   // [T, groups, 8, 64]: q in the grouped layout's order (AVX-512 only)
};

template <typename T>
void quantize_rows(const at::Tensor& x, XQuant& out) {
  const int64_t t = x.size(0), k = x.size(1), nb = k / kBlock;
  out.q.resize(t * k);
  out.d.resize(t * nb);
  out.s.resize(t * nb);
  out.ds.resize(t * nb);
  out.dv.resize(t * nb * 8);
#if defined(RS_QUANT_512)
  const int64_t groups = nb / kGroup;
  out.xg.resize(t * groups * 512);
#endif
  const T* base = x.data_ptr<T>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = base + r * stride;
      for (int64_t b = 0; b < nb; ++b) {
        float v[kBlock];
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) {
          v[i] = static_cast<float>(row[b * kBlock + i]);
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int8_t* q = out.q.data() + r * k + b * kBlock;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
          sum += q[i];
        }
        out.d[r * nb + b] = d;
        out.s[r * nb + b] = sum;
#if defined(RS_QUANT_512)
        if (b < groups * kGroup) {  // element 4j+e of block 16g+l goes to byte 4l+e of chunk j
          int8_t* xg = out.xg.data() + r * groups * 512 + (b / kGroup) * 512 + (b % kGroup) * 4;
          for (int i = 0; i < kBlock; ++i) xg[(i / 4) * 64 + i % 4] = q[i];
        }
#endif
        out.ds[r * nb + b] = d * static_cast<float>(sum);
        for (int l = 0; l < 8; ++l) out.dv[(r * nb + b) * 8 + l] = d;
      }
    }
  });
}

#if defined(__AVX2__)
// 8 int32 lanes summing u[i] * s[i] over 32 unsigned x signed bytes (no saturation for the ranges
// here: u <= 128, |s| <= 127).
RS_INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

RS_INLINE float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

RS_INLINE __m256i unpack_nibbles(const uint8_t* p) {  // weights 0-15 low nibbles, 16-31 high
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
#endif

#if defined(RS_QUANT_512)
// The grouped layout (`qrepack`, at load): each run of 16 whole blocks of a weight row is stored
// so that one 512-bit dot covers 4 elements of every block, one int32 lane per block; 8 such dots
// (Q4: 4 loads of two nibbles a byte) sum whole blocks in integers, and then one convert, one
// scale and one offset per 16 blocks finish them, where the per-block layout needs them per 2.
// Same bytes as the blocks: values (Q8_0: 8 x 64 bytes of q + 128; Q4: 4 x 64 bytes, byte 4l+e
// of chunk c holding element 8c+e of block l low and 8c+4+e high), then the 16 scales d (fp16),
// then for Q4_1 the 16 offsets m (fp16). A row's last nb % 16 blocks stay as they are.
// Per weight row, for its last (ungrouped) blocks: each block's scale over the 8 lanes of its
// dot, and the offset coefficient (Q4_1: m; Q4_0: -8 d).
template <int64_t kBytes>
RS_INLINE void weight_scales(const uint8_t* w, int64_t nb, float* dwv, float* off) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    const float d = half(blk);
    for (int l = 0; l < 8; ++l) dwv[b * 8 + l] = d;
    off[b] = kBytes == kQ4_1 ? half(blk + 2) : -8.f * d;
  }
}

// Two blocks' weights as 64 unsigned bytes (Q4: the nibbles; Q8_0: |q|), and for Q8_0 the signs.
template <int64_t kBytes>
RS_INLINE __m512i pair_values(const uint8_t* b0, __m512i* q) {
  if constexpr (kBytes == kQ8_0) {
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
    const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kBytes + 2));
    *q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
    return _mm512_abs_epi8(*q);
  } else {
    constexpr int at = kBytes == kQ4_1 ? 4 : 2;
    return _mm512_inserti64x4(_mm512_castsi256_si512(unpack_nibbles(b0 + at)), unpack_nibbles(b0 + kBytes + at), 1);
  }
}

// Rows r0..r0+rows of x against the grouped blocks of one weight row (`groups` runs of 16), added
// into acc. Every output gets the same sequence of float operations whatever `rows` and r0 are
// (batch invariance).
template <int64_t kBytes>
RS_INLINE void dot_groups(const uint8_t* w, int64_t groups, int64_t nb, const XQuant& xq, int64_t r0, int rows,
                          __m512* acc) {
  const int64_t xg_row = groups * 8 * 64;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroup * kBytes;
    __m512i isum[kRows];
    for (int j = 0; j < kRows; ++j) isum[j] = _mm512_setzero_si512();
    if constexpr (kBytes == kQ8_0) {
      for (int c = 0; c < 8; ++c) {
        const __m512i u = _mm512_loadu_si512(wg + 64 * c);
        for (int j = 0; j < rows; ++j) {
          const int8_t* xg = xq.xg.data() + (r0 + j) * xg_row + g * 512;
          isum[j] = _mm512_dpbusd_epi32(isum[j], u, _mm512_loadu_si512(xg + 64 * c));
        }
      }
    } else {
      const __m512i m = _mm512_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const __m512i p = _mm512_loadu_si512(wg + 64 * c);
        const __m512i lo = _mm512_and_si512(p, m), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), m);
        for (int j = 0; j < rows; ++j) {
          const int8_t* xg = xq.xg.data() + (r0 + j) * xg_row + g * 512 + 128 * c;
          isum[j] = _mm512_dpbusd_epi32(isum[j], lo, _mm512_loadu_si512(xg));
          isum[j] = _mm512_dpbusd_epi32(isum[j], hi, _mm512_loadu_si512(xg + 64));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + kValueBytes<kBytes>)));
    __m512 off;
    if constexpr (kBytes == kQ4_1)
      off = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + kValueBytes<kBytes> + 32)));
    else  // Q4_0: w = d (n - 8); Q8_0 stored as q + 128
      off = _mm512_mul_ps(dw, _mm512_set1_ps(kBytes == kQ8_0 ? -128.f : -8.f));
    for (int j = 0; j < rows; ++j) {
      const int64_t at = (r0 + j) * nb + g * kGroup;
      acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_loadu_ps(xq.d.data() + at)), dw, acc[j]);
      acc[j] = _mm512_fmadd_ps(off, _mm512_loadu_ps(xq.ds.data() + at), acc[j]);
    }
  }
}

// The same for a row's last blocks in their own layout (b0: the first one's index, rb of them),
// two blocks per 512-bit dot.
template <int64_t kBytes>
RS_INLINE void dot_rest(const uint8_t* w, int64_t b0, int64_t rb, int64_t nb, const float* dwv, const float* off,
                        const XQuant& xq, int64_t k, int64_t r0, int rows, __m512* acc) {
  __m256 tail[kRows];
  for (int j = 0; j < kRows; ++j) tail[j] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < rb; b += 2) {
    __m512i q = _mm512_setzero_si512();
    const __m512i u = pair_values<kBytes>(w + b * kBytes, &q);
    const __m512 dw = _mm512_loadu_ps(dwv + b * 8);
    for (int j = 0; j < rows; ++j) {
      const int64_t r = r0 + j;
      __m512i s = _mm512_loadu_si512(xq.q.data() + r * k + (b0 + b) * kBlock);
      if constexpr (kBytes == kQ8_0) s = _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(q), _mm512_setzero_si512(), s);
      const __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s));
      acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_loadu_ps(xq.dv.data() + (r * nb + b0 + b) * 8)), dw, acc[j]);
    }
  }
  if (b < rb) {  // an odd last block: the same arithmetic on 256 bits
    const uint8_t* blk = w + b * kBytes;
    __m256i u, q = _mm256_setzero_si256();
    if constexpr (kBytes == kQ8_0) {
      q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      u = _mm256_sign_epi8(q, q);
    } else {
      u = unpack_nibbles(blk + (kBytes == kQ4_1 ? 4 : 2));
    }
    const __m256 dw = _mm256_loadu_ps(dwv + b * 8);
    for (int j = 0; j < rows; ++j) {
      const int64_t r = r0 + j;
      __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * k + (b0 + b) * kBlock));
      if constexpr (kBytes == kQ8_0) s = _mm256_sign_epi8(s, q);
      const __m256 f = _mm256_cvtepi32_ps(dot_u8s8(u, s));
      tail[j] = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_loadu_ps(xq.dv.data() + (r * nb + b0 + b) * 8)), dw, tail[j]);
    }
  }
  for (int j = 0; j < rows; ++j) {
    acc[j] = _mm512_add_ps(acc[j], _mm512_zextps256_ps512(tail[j]));
    if constexpr (kBytes != kQ8_0) {  // the offset term: sum over blocks of off * d_x * sum(q_x)
      const float* ds = xq.ds.data() + (r0 + j) * nb + b0;
      for (int64_t c = 0; c < rb; c += 16) {
        const __mmask16 m = rb - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (rb - c)) - 1);
        acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, off + c), _mm512_maskz_loadu_ps(m, ds + c), acc[j]);
      }
    }
  }
}
#endif

// out[r, n] for rows r0..r0+rows (rows <= kRows) of x and weight row `w` (nb blocks of `bytes`).
template <int64_t kBytes>
RS_INLINE void dot_rows(const uint8_t* w, int64_t nb, const XQuant& xq, int64_t k, int64_t r0, int rows,
                        float* acc_out) {
#if defined(__AVX2__)
  __m256 acc[kRows];
  float extra[kRows];
  for (int j = 0; j < kRows; ++j) {
    acc[j] = _mm256_setzero_ps();
    extra[j] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    const float dw = half(blk);
    if constexpr (kBytes == kQ8_0) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i u = _mm256_sign_epi8(q, q);  // |q| (128 for -128, read as unsigned)
      for (int j = 0; j < rows; ++j) {
        const int64_t r = r0 + j;
        const __m256i s = _mm256_sign_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * k + b * kBlock)), q);
        const __m256 sum = _mm256_cvtepi32_ps(dot_u8s8(u, s));
        acc[j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dw * xq.d[r * nb + b]), acc[j]);
      }
    } else {
      const __m256i u = unpack_nibbles(blk + (kBytes == kQ4_1 ? 4 : 2));
      const float mw = kBytes == kQ4_1 ? half(blk + 2) : 0.f;
      for (int j = 0; j < rows; ++j) {
        const int64_t r = r0 + j;
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * k + b * kBlock));
        const float dx = xq.d[r * nb + b];
        const __m256 sum = _mm256_cvtepi32_ps(dot_u8s8(u, s));
        acc[j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dw * dx), acc[j]);
        const float sx = static_cast<float>(xq.s[r * nb + b]);
        extra[j] += kBytes == kQ4_1 ? mw * dx * sx : -8.f * dw * dx * sx;
      }
    }
  }
  for (int j = 0; j < rows; ++j) acc_out[j] = hsum(acc[j]) + extra[j];
#else
  for (int j = 0; j < rows; ++j) {
    const int64_t r = r0 + j;
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * kBytes;
      const int8_t* q = xq.q.data() + r * k + b * kBlock;
      const float dw = half(blk), dx = xq.d[r * nb + b];
      int32_t sum = 0;
      if constexpr (kBytes == kQ8_0) {
        for (int i = 0; i < kBlock; ++i) sum += static_cast<int8_t>(blk[2 + i]) * q[i];
        total += dw * dx * sum;
      } else {
        const uint8_t* n = blk + (kBytes == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) sum += (n[i] & 0x0F) * q[i] + (n[i] >> 4) * q[i + 16];
        const float sx = static_cast<float>(xq.s[r * nb + b]);
        total += dw * dx * sum + (kBytes == kQ4_1 ? half(blk + 2) * dx * sx : -8.f * dw * dx * sx);
      }
    }
    acc_out[j] = total;
  }
#endif
}

template <int64_t kBytes, typename T>
void qlinear_rows(const XQuant& xq, const at::Tensor& w, int64_t t, int64_t k, T* out) {
  const int64_t n = w.size(0), nb = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, n, kNGrain, [&](int64_t lo, int64_t hi) {
    float acc[kRows];
#if defined(RS_QUANT_512)
    // Tiles of kNGrain weight rows: the scales of their last blocks made once, then every row of
    // x against the tile while its blocks stay in cache.
    const int64_t groups = nb / kGroup, rb = nb - groups * kGroup;
    std::vector<float> dwv(kNGrain * rb * 8 + 1), off(kNGrain * rb + 1);
    for (int64_t c0 = lo; c0 < hi; c0 += kNGrain) {
      const int64_t c1 = std::min(hi, c0 + kNGrain);
      for (int64_t c = c0; c < c1; ++c)
        weight_scales<kBytes>(wp + (c * nb + groups * kGroup) * kBytes, rb, dwv.data() + (c - c0) * rb * 8,
                              off.data() + (c - c0) * rb);
      for (int64_t r0 = 0; r0 < t; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, t - r0));
        for (int64_t c = c0; c < c1; ++c) {
          __m512 sums[kRows];
          for (int j = 0; j < kRows; ++j) sums[j] = _mm512_setzero_ps();
          const uint8_t* wc = wp + c * nb * kBytes;
          dot_groups<kBytes>(wc, groups, nb, xq, r0, rows, sums);
          dot_rest<kBytes>(wc + groups * kGroup * kBytes, groups * kGroup, rb, nb, dwv.data() + (c - c0) * rb * 8,
                           off.data() + (c - c0) * rb, xq, k, r0, rows, sums);
          for (int j = 0; j < rows; ++j) out[(r0 + j) * n + c] = static_cast<T>(_mm512_reduce_add_ps(sums[j]));
        }
      }
    }
#else
    for (int64_t r0 = 0; r0 < t; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, t - r0));
      for (int64_t c = lo; c < hi; ++c) {
        dot_rows<kBytes>(wp + c * nb * kBytes, nb, xq, k, r0, rows, acc);
        for (int j = 0; j < rows; ++j) out[(r0 + j) * n + c] = static_cast<T>(acc[j]);
      }
    }
#endif
  });
}

// One block's 32 values as the reference dequantizes them (float32, no fused multiply-add: the
// barrier keeps the compiler from contracting d * n + m, so the values are torch's bit for bit).
RS_INLINE float value(float d, float m, int32_t n) {
  float p = d * static_cast<float>(n);
  asm("" : "+x"(p));
  return p + m;
}

// Element i of block l (of 16) of a group in the grouped layout, as its integer and scales.
template <int64_t kBytes>
RS_INLINE float grouped_value(const uint8_t* g, int l, int i) {
  const float d = half(g + kValueBytes<kBytes> + 2 * l);
  if constexpr (kBytes == kQ8_0) return value(d, 0.f, static_cast<int32_t>(g[(i / 4) * 64 + 4 * l + i % 4]) - 128);
  const uint8_t byte = g[(i / 8) * 64 + 4 * l + i % 4];
  const int32_t n = (i % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
  if constexpr (kBytes == kQ4_1) return value(d, half(g + kValueBytes<kBytes> + 32 + 2 * l), n);
  return value(d, 0.f, n - 8);
}

template <int64_t kBytes>
RS_INLINE float stored_value(const uint8_t* blk, int i) {
  const float d = half(blk);
  if constexpr (kBytes == kQ8_0) return value(d, 0.f, static_cast<int8_t>(blk[2 + i]));
  const uint8_t* nib = blk + (kBytes == kQ4_1 ? 4 : 2);
  const int32_t n = i < 16 ? (nib[i] & 0x0F) : (nib[i - 16] >> 4);
  if constexpr (kBytes == kQ4_1) return value(d, half(blk + 2), n);
  return value(d, 0.f, n - 8);
}

template <int64_t kBytes>
void repack_row(const uint8_t* src, uint8_t* dst, int64_t nb) {
  const int64_t groups = nb / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* in = src + g * kGroup * kBytes;
    uint8_t* out = dst + g * kGroup * kBytes;
    for (int l = 0; l < kGroup; ++l) {
      const uint8_t* blk = in + l * kBytes;
      for (int i = 0; i < kBlock; ++i) {
        if constexpr (kBytes == kQ8_0) {
          out[(i / 4) * 64 + 4 * l + i % 4] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + i]) + 128);
        } else {
          const uint8_t* nib = blk + (kBytes == kQ4_1 ? 4 : 2);
          const uint8_t n = i < 16 ? (nib[i] & 0x0F) : (nib[i - 16] >> 4);
          out[(i / 8) * 64 + 4 * l + i % 4] |= (i % 8) < 4 ? n : static_cast<uint8_t>(n << 4);
        }
      }
      std::memcpy(out + kValueBytes<kBytes> + 2 * l, blk, 2);                               // d
      if constexpr (kBytes == kQ4_1) std::memcpy(out + kValueBytes<kBytes> + 32 + 2 * l, blk + 2, 2);  // m
    }
  }
  std::memcpy(dst + groups * kGroup * kBytes, src + groups * kGroup * kBytes, (nb - groups * kGroup) * kBytes);
}

template <int64_t kBytes>
void embed_row(const uint8_t* row, int64_t nb, float* out) {
  const int64_t groups = nb / kGroup;
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < kBlock; ++i) {
      out[b * kBlock + i] = b < groups * kGroup
                                ? grouped_value<kBytes>(row + (b / kGroup) * kGroup * kBytes, static_cast<int>(b % kGroup), i)
                                : stored_value<kBytes>(row + b * kBytes, i);
    }
  }
}

template <typename F>
void by_format(int64_t bytes, F&& f) {
  if (bytes == kQ8_0) f(std::integral_constant<int64_t, kQ8_0>{});
  else if (bytes == kQ4_1) f(std::integral_constant<int64_t, kQ4_1>{});
  else if (bytes == kQ4_0) f(std::integral_constant<int64_t, kQ4_0>{});
  else TORCH_CHECK(false, "blocks of ", bytes, " bytes are no format this kernel reads (Q4_0: 18, Q4_1: 20, Q8_0: 34)");
}

}  // namespace

// The blocks in the layout qlinear reads (the grouped layout where the AVX-512 kernel runs; as
// they are elsewhere), same shape and bytes.
at::Tensor qrepack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte, "qrepack: expected contiguous uint8 [N, K/32, bytes]");
#if defined(RS_QUANT_512)
  at::Tensor out = at::zeros_like(w);
  const int64_t n = w.size(0), nb = w.size(1), bytes = w.size(2);
  by_format(bytes, [&](auto fmt) {
    constexpr int64_t kB = decltype(fmt)::value;
    at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        repack_row<kB>(w.data_ptr<uint8_t>() + r * nb * kB, out.data_ptr<uint8_t>() + r * nb * kB, nb);
    });
  });
  return out;
#else
  by_format(w.size(2), [](auto) {});
  return w.clone();
#endif
}

// Rows `ids` of repacked blocks (qrepack), dequantized: float32 [len(ids), K] (an embedding lookup).
at::Tensor qembed(const at::Tensor& w, const at::Tensor& ids) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte, "qembed: expected contiguous uint8 [N, K/32, bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembed: ids must be int64 [T]");
  const int64_t n = w.size(0), nb = w.size(1), bytes = w.size(2), t = ids.size(0);
  const at::Tensor idx = ids.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "qembed: id ", ip[i], " outside [0, ", n, ")");
  at::Tensor out = at::empty({t, nb * kBlock}, w.options().dtype(at::kFloat));
  by_format(bytes, [&](auto fmt) {
    constexpr int64_t kB = decltype(fmt)::value;
    at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
#if defined(RS_QUANT_512)
        embed_row<kB>(w.data_ptr<uint8_t>() + ip[i] * nb * kB, nb, out.data_ptr<float>() + i * nb * kBlock);
#else
        const uint8_t* row = w.data_ptr<uint8_t>() + ip[i] * nb * kB;
        for (int64_t b = 0; b < nb; ++b)
          for (int e = 0; e < kBlock; ++e) out.data_ptr<float>()[i * nb * kBlock + b * kBlock + e] = stored_value<kB>(row + b * kB, e);
#endif
      }
    });
  });
  return out;
}

bool is_quantized(const at::Tensor& w) { return w.scalar_type() == at::kByte; }

// x [T, K] float32 or bfloat16, contiguous rows; w uint8 [N, K / 32, block bytes]; -> [T, N] in x's dtype.
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && is_quantized(w), "qlinear: weight must be contiguous uint8 [N, K/32, bytes]");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == w.size(1) * kBlock,
              "qlinear: x must be [T, K] with contiguous rows and K = 32 * the weight's blocks");
  const int64_t t = x.size(0), k = x.size(1), bytes = w.size(2);
  TORCH_CHECK(bytes == kQ4_0 || bytes == kQ4_1 || bytes == kQ8_0, "qlinear: blocks of ", bytes,
              " bytes are no format this kernel reads (Q4_0: 18, Q4_1: 20, Q8_0: 34)");
  at::Tensor out = at::empty({t, w.size(0)}, x.options());
  if (t == 0) return out;
  XQuant xq;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(x, xq);
    T* o = out.data_ptr<T>();
    if (bytes == kQ8_0) qlinear_rows<kQ8_0, T>(xq, w, t, k, o);
    else if (bytes == kQ4_1) qlinear_rows<kQ4_1, T>(xq, w, t, k, o);
    else qlinear_rows<kQ4_0, T>(xq, w, t, k, o);
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else TORCH_CHECK(false, "qlinear: x must be float32 or bfloat16, got ", x.scalar_type());
  if (bias.has_value()) out.add_(*bias);
  return out;
}

TORCH_LIBRARY_FRAGMENT(ringserve_cpu, m) {
  m.def("qlinear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &qlinear);
  m.def("qrepack(Tensor blocks) -> Tensor", &qrepack);
  m.def("qembed(Tensor blocks, Tensor ids) -> Tensor", &qembed);
}

}  // namespace ringserve_cpu
