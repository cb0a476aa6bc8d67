// Linear layers with GGUF-quantized weights, read as they are stored (no dequantized copy).
//
// A weight is its GGUF blocks, uint8 [N, K / 32, block_bytes]: the last size names the format
// (Q4_0: 18 bytes, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34; every block holds 32 weights of one
// output row). As in
// llama.cpp, the activations are quantized too, per 32 elements to int8 with a float scale (its
// Q8_0/Q8_1), so each block's dot is an integer one (AVX-512 VNNI / AVX-VNNI `dpbusd`, else AVX2
// `maddubs`; the integer sums are exact either way), scaled and summed in float:
//
//   Q8_0  w = d q             dot = d dx sum(q qx)
//   Q4_0  w = d (n - 8)       dot = d dx (sum(n qx) - 8 sum(qx))
//   Q4_1  w = d n + m         dot = d dx sum(n qx) + m dx sum(qx)
//   Q5_0  w = d (n - 16)      dot = d dx (sum(n qx) - 16 sum(qx))     (n: 4 low bits + 1 high bit)
//   Q5_1  w = d n + m         as Q4_1
//
// Each output element depends on its own row of x and of the weight only, in a fixed order, so a
// row's result is the same whatever else is in the step (batch invariance, as the float path
// keeps it). On AVX-512 VNNI the weight is repacked at load into panels of 16 rows, whose lanes
// are 16 outputs (`dot_panel`), and rows of x are taken eight at a time so each unpacked weight
// block serves eight dots (a prefill step's rows); a decode step's one row reads every weight
// byte once. Spec: gpu_proc/quant.py (`qlinear_reference`, the same arithmetic in torch);
// test: tests/gpu_proc/test_quant.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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
constexpr int64_t kQ4_0 = 18, kQ4_1 = 20, kQ5_0 = 22, kQ5_1 = 24, kQ8_0 = 34;
// Where a block as stored keeps its parts: the offset m (Q4_1, Q5_1), the 32 high bits (Q5), the
// nibbles (Q4, Q5); and the zero point of the formats without m.
template <int64_t kB> constexpr bool kHasMin = kB == kQ4_1 || kB == kQ5_1;
template <int64_t kB> constexpr bool kFive = kB == kQ5_0 || kB == kQ5_1;
template <int64_t kB> constexpr int64_t kHighAt = kB == kQ5_0 ? 2 : 4;
template <int64_t kB> constexpr int64_t kNibblesAt = kB == kQ4_0 ? 2 : kB == kQ4_1 ? 4 : kB == kQ5_0 ? 6 : 8;
template <int64_t kB> constexpr float kZero = kB == kQ4_0 ? 8.f : kB == kQ5_0 ? 16.f : 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RS_QUANT_512 1  // the panel layout and its kernel; elsewhere the blocks as stored
#endif
// A panel block's values: Q8_0 8 x 64 bytes; Q4 4 x 64 bytes of nibbles; Q5 those and 8 x 64 high bits
template <int64_t kBytes> constexpr int64_t kValueBytes = kBytes == kQ8_0 ? 512 : kFive<kBytes> ? 320 : 256;
constexpr int kRows = 4;    // rows of x per pass over a weight row's blocks (rows as stored)
constexpr int kPanel = 16;  // weight rows per panel of the AVX-512 layout

RS_INLINE float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

RS_INLINE int32_t load_u32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Panels of 16 rows a weight has in the layout qlinear reads (none where the AVX-512 kernel does
// not run: the blocks as stored).
int64_t panel_count(int64_t n) {
#if defined(RS_QUANT_512)
  return n / kPanel;
#else
  (void)n;
  return 0;
#endif
}

// The activations of one call: per row and 32-element block, int8 values, their scale and their sum.
struct XQuant {
  std::vector<int8_t> q;    // [T, K]
  std::vector<float> d;     // [T, K / 32]
  std::vector<int32_t> s;   // [T, K / 32]: sum of q
  std::vector<float> ds;    // [T, K / 32]: d * sum of q (the offset term of Q4 and of Q8_0 stored + 128)
};

template <typename T>
void quantize_rows(const at::Tensor& x, XQuant& out) {
  const int64_t t = x.size(0), k = x.size(1), nb = k / kBlock;
  out.q.resize(t * k);
  out.d.resize(t * nb);
  out.s.resize(t * nb);
  out.ds.resize(t * nb);
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
        out.ds[r * nb + b] = d * static_cast<float>(sum);
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

// A stored block's 32 unsigned values (Q4: its nibbles; Q5: with bit i of its 32 high bits as
// bit 4 of value i: byte i of the 32 bits broadcast, each byte picking its bit).
template <int64_t kBytes>
RS_INLINE __m256i block_values(const uint8_t* blk) {
  __m256i u = unpack_nibbles(blk + kNibblesAt<kBytes>);
  if constexpr (kFive<kBytes>) {
    uint32_t high;
    std::memcpy(&high, blk + kHighAt<kBytes>, 4);
    const __m256i byte_of = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                             3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(high)), byte_of);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
  return u;
}
#endif

// Value i (0-31) of a stored Q4/Q5 block, unsigned.
template <int64_t kBytes>
RS_INLINE int32_t stored_int(const uint8_t* blk, int i) {
  const uint8_t* nib = blk + kNibblesAt<kBytes>;
  int32_t n = i < 16 ? (nib[i] & 0x0F) : (nib[i - 16] >> 4);
  if constexpr (kFive<kBytes>) {
    uint32_t high;
    std::memcpy(&high, blk + kHighAt<kBytes>, 4);
    n |= static_cast<int32_t>((high >> i) & 1u) << 4;
  }
  return n;
}

#if defined(RS_QUANT_512)
// The panel layout (`qrepack`, at load): each run of 16 weight rows (a panel) is stored block by
// block, so that one 512-bit dot takes 4 weights of the same block of all 16 rows, one int32 lane
// per row, against 4 values of x broadcast: the lanes are 16 outputs, and nothing is summed across
// lanes. Block b of a panel, same bytes as its 16 blocks: values (Q8_0: 8 x 64 bytes, byte 4l+e of
// chunk c holding element 4c+e of row l, as q + 128; Q4: 4 x 64 bytes, byte 4l+e of chunk c
// holding element 4c+e of row l low and 16+4c+e high; Q5: those, then 8 masks of 64 bits, mask
// 2c+h bit 4l+e the high bit of element 16h+4c+e of row l), then the 16 rows' scales d (fp16),
// then for Q4_1 / Q5_1 their offsets m (fp16). A weight's last N % 16 rows stay as stored
// (`dot_rows`).
//
// Rows r0..r0+rows (rows <= kPanelRows) of x against one panel (nb blocks), into out. Every output
// gets the same sequence of float operations whatever `rows` and r0 are (batch invariance).
constexpr int kPanelRows = 8;  // rows of x per pass over a panel's blocks, which stay in L1

template <int64_t kBytes, typename T>
RS_INLINE void dot_panel(const uint8_t* p, int64_t nb, const XQuant& xq, int64_t k, int64_t r0, int rows, T* out,
                         int64_t ldo) {
  __m512 acc[kPanelRows];
  for (int j = 0; j < kPanelRows; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = p + b * kPanel * kBytes;
    __m512i isum[kPanelRows];
    for (int j = 0; j < kPanelRows; ++j) isum[j] = _mm512_setzero_si512();
    if constexpr (kBytes == kQ8_0) {
      for (int c = 0; c < 8; ++c) {
        const __m512i u = _mm512_loadu_si512(blk + 64 * c);
        for (int j = 0; j < rows; ++j) {
          const int8_t* q = xq.q.data() + (r0 + j) * k + b * kBlock + 4 * c;
          isum[j] = _mm512_dpbusd_epi32(isum[j], u, _mm512_set1_epi32(load_u32(q)));
        }
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * c);
        __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        if constexpr (kFive<kBytes>) {  // bit 4 from the masks
          uint64_t bits[2];
          std::memcpy(bits, blk + 256 + 16 * c, 16);
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, _mm512_set1_epi8(16));
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, _mm512_set1_epi8(16));
        }
        for (int j = 0; j < rows; ++j) {
          const int8_t* q = xq.q.data() + (r0 + j) * k + b * kBlock + 4 * c;
          isum[j] = _mm512_dpbusd_epi32(isum[j], lo, _mm512_set1_epi32(load_u32(q)));
          isum[j] = _mm512_dpbusd_epi32(isum[j], hi, _mm512_set1_epi32(load_u32(q + 16)));
        }
      }
    }
    constexpr int64_t at = kValueBytes<kBytes>;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + at)));
    __m512 off;
    if constexpr (kHasMin<kBytes>)
      off = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + at + 32)));
    else  // Q4_0: w = d (n - 8), Q5_0: d (n - 16); Q8_0 stored as q + 128
      off = _mm512_mul_ps(dw, _mm512_set1_ps(kBytes == kQ8_0 ? -128.f : -kZero<kBytes>));
    for (int j = 0; j < rows; ++j) {
      const int64_t x = (r0 + j) * (k / kBlock) + b;
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_set1_ps(xq.d[x]));
      acc[j] = _mm512_fmadd_ps(f, dw, acc[j]);
      acc[j] = _mm512_fmadd_ps(off, _mm512_set1_ps(xq.ds[x]), acc[j]);
    }
  }
  for (int j = 0; j < rows; ++j) {
    float v[kPanel];
    _mm512_storeu_ps(v, acc[j]);
    for (int l = 0; l < kPanel; ++l) out[(r0 + j) * ldo + l] = static_cast<T>(v[l]);
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
      const __m256i u = block_values<kBytes>(blk);
      const float mw = kHasMin<kBytes> ? half(blk + 2) : 0.f;
      for (int j = 0; j < rows; ++j) {
        const int64_t r = r0 + j;
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * k + b * kBlock));
        const float dx = xq.d[r * nb + b];
        const __m256 sum = _mm256_cvtepi32_ps(dot_u8s8(u, s));
        acc[j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dw * dx), acc[j]);
        const float sx = static_cast<float>(xq.s[r * nb + b]);
        extra[j] += kHasMin<kBytes> ? mw * dx * sx : -kZero<kBytes> * dw * dx * sx;
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
        for (int i = 0; i < kBlock; ++i) sum += stored_int<kBytes>(blk, i) * q[i];
        const float sx = static_cast<float>(xq.s[r * nb + b]);
        total += dw * dx * sum + (kHasMin<kBytes> ? half(blk + 2) * dx * sx : -kZero<kBytes> * dw * dx * sx);
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
  const int64_t panels = panel_count(n);  // then n % 16 rows as stored
  // Tasks: a panel each, then one per 16 rows as stored; every row of x against a task's weight
  // rows while their blocks stay in cache.
  const int64_t tasks = panels + (n - panels * kPanel + 15) / 16;
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
#if defined(RS_QUANT_512)
      if (task < panels) {
        const uint8_t* p = wp + task * kPanel * nb * kBytes;
        for (int64_t r0 = 0; r0 < t; r0 += kPanelRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, t - r0));
          dot_panel<kBytes, T>(p, nb, xq, k, r0, rows, out + task * kPanel, n);
        }
        continue;
      }
#endif
      const int64_t c0 = panels * kPanel + (task - panels) * 16, c1 = std::min(n, c0 + 16);
      float acc[kRows];
      for (int64_t r0 = 0; r0 < t; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, t - r0));
        for (int64_t c = c0; c < c1; ++c) {
          dot_rows<kBytes>(wp + c * nb * kBytes, nb, xq, k, r0, rows, acc);
          for (int j = 0; j < rows; ++j) out[(r0 + j) * n + c] = static_cast<T>(acc[j]);
        }
      }
    }
  });
}

// One block's 32 values as the reference dequantizes them (float32, no fused multiply-add: the
// barrier keeps the compiler from contracting d * n + m, so the values are torch's bit for bit).
RS_INLINE float value(float d, float m, int32_t n) {
  float p = d * static_cast<float>(n);
  asm("" : "+x"(p));
  return p + m;
}

// Byte of element i of row l in a panel's block (Q4: its low nibble for i < 16, else its high one).
template <int64_t kBytes>
RS_INLINE int64_t panel_byte(int l, int i) {
  return kBytes == kQ8_0 ? (i / 4) * 64 + 4 * l + i % 4 : ((i % 16) / 4) * 64 + 4 * l + i % 4;
}

// Q5: the byte and bit of a panel's block holding the high bit of element i of row l.
RS_INLINE int64_t panel_high_byte(int l, int i) { return 256 + 8 * (2 * ((i % 16) / 4) + i / 16) + (4 * l + i % 4) / 8; }
RS_INLINE int panel_high_bit(int l, int i) { return (4 * l + i % 4) % 8; }

// Element i of row l of a panel's block, as the reference dequantizes it.
template <int64_t kBytes>
RS_INLINE float panel_value(const uint8_t* blk, int l, int i) {
  const float d = half(blk + kValueBytes<kBytes> + 2 * l);
  const uint8_t byte = blk[panel_byte<kBytes>(l, i)];
  if constexpr (kBytes == kQ8_0) return value(d, 0.f, static_cast<int32_t>(byte) - 128);
  int32_t n = i < 16 ? (byte & 0x0F) : (byte >> 4);
  if constexpr (kFive<kBytes>) n |= ((blk[panel_high_byte(l, i)] >> panel_high_bit(l, i)) & 1) << 4;
  if constexpr (kHasMin<kBytes>) return value(d, half(blk + kValueBytes<kBytes> + 32 + 2 * l), n);
  return value(d, 0.f, n - static_cast<int32_t>(kZero<kBytes>));
}

template <int64_t kBytes>
RS_INLINE float stored_value(const uint8_t* blk, int i) {
  const float d = half(blk);
  if constexpr (kBytes == kQ8_0) return value(d, 0.f, static_cast<int8_t>(blk[2 + i]));
  const int32_t n = stored_int<kBytes>(blk, i);
  if constexpr (kHasMin<kBytes>) return value(d, half(blk + 2), n);
  return value(d, 0.f, n - static_cast<int32_t>(kZero<kBytes>));
}

// 16 weight rows as stored (src, [16, nb, kBytes]) -> one panel (dst, same bytes; zeroed).
template <int64_t kBytes>
void repack_panel(const uint8_t* src, uint8_t* dst, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* out = dst + b * kPanel * kBytes;
    for (int l = 0; l < kPanel; ++l) {
      const uint8_t* blk = src + (l * nb + b) * kBytes;
      for (int i = 0; i < kBlock; ++i) {
        if constexpr (kBytes == kQ8_0) {
          out[panel_byte<kBytes>(l, i)] = static_cast<uint8_t>(static_cast<int8_t>(blk[2 + i]) + 128);
        } else {
          const int32_t n = stored_int<kBytes>(blk, i);
          out[panel_byte<kBytes>(l, i)] |= static_cast<uint8_t>(i < 16 ? (n & 0x0F) : (n & 0x0F) << 4);
          if constexpr (kFive<kBytes>) out[panel_high_byte(l, i)] |= static_cast<uint8_t>((n >> 4) << panel_high_bit(l, i));
        }
      }
      std::memcpy(out + kValueBytes<kBytes> + 2 * l, blk, 2);                                           // d
      if constexpr (kHasMin<kBytes>) std::memcpy(out + kValueBytes<kBytes> + 32 + 2 * l, blk + 2, 2);  // m
    }
  }
}

// Row r of the repacked blocks of a weight with `panels` panels, dequantized into out [nb * 32].
template <int64_t kBytes>
void embed_row(const uint8_t* w, int64_t panels, int64_t nb, int64_t r, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = r < panels * kPanel ? w + ((r / kPanel) * kPanel * nb + b * kPanel) * kBytes : w + (r * nb + b) * kBytes;
    for (int i = 0; i < kBlock; ++i)
      out[b * kBlock + i] = r < panels * kPanel ? panel_value<kBytes>(blk, static_cast<int>(r % kPanel), i) : stored_value<kBytes>(blk, i);
  }
}

template <typename F>
void by_format(int64_t bytes, F&& f) {
  if (bytes == kQ8_0) f(std::integral_constant<int64_t, kQ8_0>{});
  else if (bytes == kQ4_1) f(std::integral_constant<int64_t, kQ4_1>{});
  else if (bytes == kQ4_0) f(std::integral_constant<int64_t, kQ4_0>{});
  else if (bytes == kQ5_0) f(std::integral_constant<int64_t, kQ5_0>{});
  else if (bytes == kQ5_1) f(std::integral_constant<int64_t, kQ5_1>{});
  else TORCH_CHECK(false, "blocks of ", bytes, " bytes are no format this kernel reads (Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34)");
}

}  // namespace

// The blocks in the layout qlinear reads (panels of 16 rows, then the rest as stored), same shape
// and bytes.
at::Tensor qrepack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte, "qrepack: expected contiguous uint8 [N, K/32, bytes]");
  const int64_t n = w.size(0), nb = w.size(1), bytes = w.size(2), panels = panel_count(n);
  at::Tensor out = w.clone();
  by_format(bytes, [&](auto fmt) {
    constexpr int64_t kB = decltype(fmt)::value;
    const uint8_t* src = w.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, panels, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        std::memset(dst + p * kPanel * nb * kB, 0, kPanel * nb * kB);
        repack_panel<kB>(src + p * kPanel * nb * kB, dst + p * kPanel * nb * kB, nb);
      }
    });
  });
  return out;
}

// Rows `ids` of repacked blocks (qrepack), dequantized: float32 [len(ids), K] (an embedding lookup).
at::Tensor qembed(const at::Tensor& w, const at::Tensor& ids) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte, "qembed: expected contiguous uint8 [N, K/32, bytes]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembed: ids must be int64 [T]");
  const int64_t n = w.size(0), nb = w.size(1), bytes = w.size(2), t = ids.size(0), panels = panel_count(n);
  const at::Tensor idx = ids.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "qembed: id ", ip[i], " outside [0, ", n, ")");
  at::Tensor out = at::empty({t, nb * kBlock}, w.options().dtype(at::kFloat));
  by_format(bytes, [&](auto fmt) {
    constexpr int64_t kB = decltype(fmt)::value;
    at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        embed_row<kB>(w.data_ptr<uint8_t>(), panels, nb, ip[i], out.data_ptr<float>() + i * nb * kBlock);
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
  by_format(bytes, [](auto) {});  // refuses an unknown block size before anything is allocated
  at::Tensor out = at::empty({t, w.size(0)}, x.options());
  if (t == 0) return out;
  XQuant xq;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(x, xq);
    T* o = out.data_ptr<T>();
    by_format(bytes, [&](auto fmt) { qlinear_rows<decltype(fmt)::value, T>(xq, w, t, k, o); });
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
