// CPU paged attention that reads K/V blocks where they lie, and the KV write.
//
// Spec: gpu_proc/attention/reference.py (write_kv, paged_attention); launcher with the shape,
// dtype and stride checks: gpu_proc/attention/cpu_backend.py; sweep test against the reference:
// tests/gpu_proc/test_cpu_backend.py.
//
// Cache layout [num_blocks, num_kv_heads, block_size, head_dim]: one head's keys of one block are
// block_size * head_dim contiguous elements. A work item is (sequence, KV head, tile of up to
// kTile query tokens); its rows are the tile's tokens times the query heads that share the KV head
// (grouped-query attention), so every key block is read once per item, in place, for all of them.
// Each row keeps a running max, a running sum and a float32 accumulator over the blocks it can see
// (online softmax), so nothing proportional to the context is materialised. A row's arithmetic
// depends only on its own query and keys, never on the other rows of the item or of the step:
// the output of a token is the same alone and in any batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace ringserve_cpu {
namespace {

constexpr int64_t kTile = 16;  // query tokens per work item of a prefill chunk

struct Item {
  int64_t seq, kv_head, tok_lo, tok_hi;  // tokens [tok_lo, tok_hi) of the step
};

// One row's update from a chunk of up to 16 keys `k[j * d]`, `v[j * d]` (float32), j < n: their
// scores, then the row's running max `m`, sum `l` and accumulator `acc[d]` (online softmax).
// kDim > 0: head_dim is kDim (a multiple of 16), loops are unrolled, the accumulator stays in
// registers and the 16 dot products are reduced together; `full` says the chunk's 16 rows may all
// be read (past `n` they hold other slots of the same block: any value, masked out here).
// kDim == 0: any head_dim, plain loops.
template <int64_t kDim>
inline void row_keys(const float* qr, const float* k, const float* v, int64_t n, int64_t dim_rt, bool full,
                     float& m, float& l, float* acc) {
  const int64_t d = kDim ? kDim : dim_rt;
  const vi in_range = lane_index() < static_cast<int32_t>(n);
  vf scores = splat(0.0f);
  if constexpr (kDim > 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    vf qv[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) qv[c] = load(qr + c * kLanes);
    if (full) {
      vf part[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) {
        part[j] = qv[0] * load(k + j * kDim);
        for (int64_t c = 1; c < kChunks; ++c) part[j] += qv[c] * load(k + j * kDim + c * kLanes);
      }
      scores = hsum16(part);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        vf part = qv[0] * load(k + j * kDim);
        for (int64_t c = 1; c < kChunks; ++c) part += qv[c] * load(k + j * kDim + c * kLanes);
        scores[j] = hsum(part);
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) scores[j] = dot(qr, k + j * d, d);
  }
  scores = in_range ? scores : splat(-std::numeric_limits<float>::infinity());
  const float best = std::max(m, hmax(scores));
  const float c = sexp(m - best);  // rescales what was summed against the old max (1 if unchanged)
  vf p = vexp(scores - best);
  p = in_range ? p : splat(0.0f);
  l = l * c + hsum(p);
  m = best;
  if constexpr (kDim > 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    vf a[kChunks];
    for (int64_t i = 0; i < kChunks; ++i) a[i] = load(acc + i * kLanes) * c;
    for (int64_t j = 0; j < n; ++j) {
      const vf pj = splat(p[j]);
      for (int64_t i = 0; i < kChunks; ++i) a[i] += pj * load(v + j * kDim + i * kLanes);
    }
    for (int64_t i = 0; i < kChunks; ++i) store(acc + i * kLanes, a[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) acc[i] *= c;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < d; ++i) acc[i] += p[j] * v[j * d + i];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RS_BF16_DOT 1
// bfloat16 caches on CPUs with AVX512-BF16: `vdpbf16ps` multiplies bfloat16 pairs into float32
// accumulators, so keys and values are read as they lie, never widened first. Scores: the query
// row (bfloat16, as the model computed it) against each key. P.V: probabilities rounded to
// bfloat16 (as the reference rounds them to the cache dtype) times the values of two keys at a
// time, interleaved so each 32-bit lane holds one dimension of both; the accumulators therefore
// hold dimensions in the unpack instructions' order, put back in `store_row_bf16`.
template <int64_t kDim>
inline void row_keys_bf16(const c10::BFloat16* qr, float scale, const c10::BFloat16* k, const c10::BFloat16* v,
                          int64_t n, bool full, float& m, float& l, float* acc) {
  static_assert(kDim % 32 == 0, "row_keys_bf16 takes head dims of whole 32-element vectors");
  constexpr int64_t kQ = kDim / 32;
  const vi in_range = lane_index() < static_cast<int32_t>(n);
  __m512bh qv[kQ];
  for (int64_t c = 0; c < kQ; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qr + 32 * c);
  vf part[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    __m512 a = _mm512_setzero_ps();
    if (full || j < n)
      for (int64_t c = 0; c < kQ; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + j * kDim + 32 * c));
    part[j] = (vf)a;
  }
  vf scores = hsum16(part) * scale;
  scores = in_range ? scores : splat(-std::numeric_limits<float>::infinity());
  const float best = std::max(m, hmax(scores));
  const float c = sexp(m - best);
  vf p = vexp(scores - best);
  p = in_range ? p : splat(0.0f);
  l = l * c + hsum(p);
  m = best;
  uint32_t pairs[kLanes / 2];  // (p[2i], p[2i+1]) as two bfloat16 in one 32-bit word
  const __m256bh pb = _mm512_cvtneps_pbh((__m512)p);
  std::memcpy(pairs, &pb, sizeof pairs);
  __m512 a[2 * kQ];
  for (int64_t i = 0; i < 2 * kQ; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), _mm512_set1_ps(c));
  for (int64_t j = 0; j < n; j += 2) {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[j / 2]));
    for (int64_t c2 = 0; c2 < kQ; ++c2) {
      const __m512i v0 = _mm512_loadu_si512(v + j * kDim + 32 * c2);
      // NOTE: an odd last key pairs with zeros, not with the slot after it (unwritten: maybe NaN).
      const __m512i v1 = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * kDim + 32 * c2) : _mm512_setzero_si512();
      a[2 * c2] = _mm512_dpbf16_ps(a[2 * c2], (__m512bh)_mm512_unpacklo_epi16(v0, v1), w);
      a[2 * c2 + 1] = _mm512_dpbf16_ps(a[2 * c2 + 1], (__m512bh)_mm512_unpackhi_epi16(v0, v1), w);
    }
  }
  for (int64_t i = 0; i < 2 * kQ; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// acc (dimensions in unpack order) * inv -> dst (bfloat16 or float32) in dimension order.
template <int64_t kDim, typename T>
inline void store_row_bf16(const float* acc, float inv, T* dst) {
  // unpacklo holds dims 0-3, 8-11, 16-19, 24-27 of each 32; unpackhi dims 4-7, 12-15, 20-23, 28-31.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = 0; c < kDim / 32; ++c) {
    const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
    store(dst + 32 * c, (vf)_mm512_permutex2var_ps(lo, first, hi) * inv);
    store(dst + 32 * c + 16, (vf)_mm512_permutex2var_ps(lo, second, hi) * inv);
  }
}
#endif

// `count` elements of a cache block as float32: the block itself when T is float32, else widened
// into `buf` (once per chunk, for every row of the work item).
inline const float* as_float(const float* src, int64_t, float*) { return src; }
inline const float* as_float(const c10::BFloat16* src, int64_t count, float* buf) {
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) store(buf + i, load(src + i));
  for (; i < count; ++i) buf[i] = to_f(src[i]);
  return buf;
}

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// T: q and out (the model's dtype); KV: the caches' (T, or bfloat16 under float32 activations:
// the query is then rounded to bfloat16 first, as the reference casts it to the cache dtype).
template <typename T, typename KV, int64_t kDim>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
            double scale_d, at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_tok_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t num_seqs = seq_lens.size(0), table_stride = block_tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  T* op = out.data_ptr<T>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const float scale = static_cast<float>(scale_d);
#ifdef RS_BF16_DOT
  constexpr bool kNativeBf16 = std::is_same_v<KV, c10::BFloat16> && kDim > 0 && kDim % 32 == 0;
#else
  constexpr bool kNativeBf16 = false;
#endif

  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == q.size(0), "paged_attention: query_start_loc must run from 0 to ",
              q.size(0), ", got ", qsl[0], " .. ", qsl[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(qsl[s] < qsl[s + 1] && lens[s] >= qsl[s + 1] - qsl[s], "paged_attention: sequence ", s, " has ",
                qsl[s + 1] - qsl[s], " new tokens and a context of ", lens[s]);
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t lo = qsl[s]; lo < qsl[s + 1]; lo += kTile)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({s, h, lo, std::min<int64_t>(lo + kTile, qsl[s + 1])});

  const int64_t max_rows = kTile * group, num_blocks = k_cache.size(0);
  const int64_t block_elems = block_size * head_dim;
  // Chunks of 16 keys never cross a block's end, so a row may read all 16 (kbuf/vbuf are whole blocks).
  const bool full_chunks = block_size % kLanes == 0;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(max_rows * head_dim), acc(max_rows * head_dim), m(max_rows), l(max_rows);
    std::vector<float> kbuf(block_elems), vbuf(block_elems);
    std::vector<int64_t> visible(max_rows);
    std::vector<const KV*> qrow(max_rows);
    std::vector<KV> qcast(std::is_same_v<T, KV> ? 0 : max_rows * head_dim);  // q rounded to the cache dtype
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const int64_t first_pos = lens[item.seq] - (qsl[item.seq + 1] - qsl[item.seq]);  // the chunk's first token
      const int64_t rows = (item.tok_hi - item.tok_lo) * group;
      // Rows in (token, head-in-group) order; queries pre-scaled, so a score is one dot product.
      for (int64_t t = item.tok_lo; t < item.tok_hi; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = (t - item.tok_lo) * group + g;
          const T* src = qp + t * q_tok_stride + (item.kv_head * group + g) * q_head_stride;
          if constexpr (std::is_same_v<T, KV>) {
            qrow[r] = src;
          } else {
            for (int64_t d = 0; d < head_dim; ++d) qcast[r * head_dim + d] = from_f<KV>(to_f(src[d]));
            qrow[r] = qcast.data() + r * head_dim;
          }
          if (!kNativeBf16)
            for (int64_t d = 0; d < head_dim; ++d) qf[r * head_dim + d] = to_f(qrow[r][d]) * scale;
          visible[r] = first_pos + (t - qsl[item.seq]) + 1;  // keys 0 .. own position
          m[r] = -std::numeric_limits<float>::infinity();
          l[r] = 0.0f;
        }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0f);
      const int64_t max_visible = visible[rows - 1];
      const int32_t* table = tables + item.seq * table_stride;
      const int64_t nblocks = (max_visible + block_size - 1) / block_size;
      for (int64_t b = 0; b < nblocks; ++b) {
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_attention: block id ", table[b],
                    " outside the cache of ", num_blocks, " blocks");
        const int64_t off = (static_cast<int64_t>(table[b]) * num_kv_heads + item.kv_head) * block_elems;
        if (b + 1 < nblocks && table[b + 1] >= 0 && table[b + 1] < num_blocks) {
          // The blocks are scattered: start loading the next one while this one is computed.
          const int64_t next = (static_cast<int64_t>(table[b + 1]) * num_kv_heads + item.kv_head) * block_elems;
          prefetch(kp + next, block_elems * sizeof(KV));
          prefetch(vp + next, block_elems * sizeof(KV));
        }
        const int64_t in_block = std::min(block_size, max_visible - b * block_size);
#ifdef RS_BF16_DOT
        if constexpr (kNativeBf16) {
          for (int64_t j = 0; j < in_block; j += kLanes)
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t n = std::min<int64_t>(kLanes, visible[r] - b * block_size - j);
              if (n > 0)
                row_keys_bf16<kDim>(qrow[r], scale, kp + off + j * head_dim, vp + off + j * head_dim, n,
                                    full_chunks || n == kLanes, m[r], l[r], acc.data() + r * head_dim);
            }
          continue;
        }
#endif
        const float* kf = as_float(kp + off, in_block * head_dim, kbuf.data());
        const float* vf_ = as_float(vp + off, in_block * head_dim, vbuf.data());
        for (int64_t j = 0; j < in_block; j += kLanes)
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = std::min<int64_t>(kLanes, visible[r] - b * block_size - j);  // this row's keys here
            if (n > 0)
              row_keys<kDim>(qf.data() + r * head_dim, kf + j * head_dim, vf_ + j * head_dim, n, head_dim,
                             full_chunks || n == kLanes, m[r], l[r], acc.data() + r * head_dim);
          }
      }
      for (int64_t t = item.tok_lo; t < item.tok_hi; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = (t - item.tok_lo) * group + g;
          const float inv = 1.0f / l[r];
          T* dst = op + (t * num_heads + item.kv_head * group + g) * head_dim;
#ifdef RS_BF16_DOT
          if constexpr (kNativeBf16) {
            store_row_bf16<kDim>(acc.data() + r * head_dim, inv, dst);
            continue;
          }
#endif
          int64_t d = 0;
          for (; d + kLanes <= head_dim; d += kLanes) store(dst + d, load(acc.data() + r * head_dim + d) * inv);
          for (; d < head_dim; ++d) dst[d] = from_f<T>(acc[r * head_dim + d] * inv);
        }
    }
  });
}

}  // namespace

// q [T, H, D] (head_dim contiguous); caches [NB, KVH, BS, D] contiguous; out [T, H, D] contiguous.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, at::Tensor out) {
  const auto run = [&](auto q_type, auto kv_type) {
    using T = decltype(q_type);
    using KV = decltype(kv_type);
    // Common head sizes get a compile-time loop bound (fully unrolled); others the general loop.
    switch (q.size(2)) {
      case 64: return attend<T, KV, 64>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
      case 128: return attend<T, KV, 128>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
      case 32: return attend<T, KV, 32>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
      default: return attend<T, KV, 0>(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
    }
  };
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) return run(float{}, c10::BFloat16{});
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention: q ", q.scalar_type(), " over a ",
              k_cache.scalar_type(), " cache (float32 over bfloat16 is the one mixed pair)");
  RS_DISPATCH(q.scalar_type(), "paged_attention", [&] { return run(scalar_t{}, scalar_t{}); });
}

namespace {

template <typename T, typename KV>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slot_mapping) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t block_size = k_cache.size(2), slots = k_cache.size(0) * block_size;
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const T* ks = k.data_ptr<T>();
  const T* vs = v.data_ptr<T>();
  KV* kc = k_cache.data_ptr<KV>();
  KV* vc = v_cache.data_ptr<KV>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = sm[t];
    if (slot < 0) continue;  // padding: nothing to store
    TORCH_CHECK(slot < slots, "write_kv: slot ", slot, " outside the cache of ", slots, " slots");
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t dst = ((block * kv_heads + h) * block_size + offset) * head_dim;
      const T* kr = ks + t * k.stride(0) + h * k.stride(1);
      const T* vr = vs + t * v.stride(0) + h * v.stride(1);
      if constexpr (std::is_same_v<T, KV>) {
        std::memcpy(kc + dst, kr, head_dim * sizeof(T));
        std::memcpy(vc + dst, vr, head_dim * sizeof(T));
      } else {  // rounded to the cache dtype as the reference's .to(cache dtype) does (nearest even)
        for (int64_t d = 0; d < head_dim; ++d) {
          kc[dst + d] = from_f<KV>(to_f(kr[d]));
          vc[dst + d] = from_f<KV>(to_f(vr[d]));
        }
      }
    }
  }
}

}  // namespace

// k, v [T, KVH, D] (head_dim contiguous); caches [NB, KVH, BS, D] contiguous; slot -1 is skipped.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  if (k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16)
    return write<float, c10::BFloat16>(k, v, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type(), "write_kv: keys ", k.scalar_type(), " into a ",
              k_cache.scalar_type(), " cache (float32 into bfloat16 is the one mixed pair)");
  RS_DISPATCH(k.scalar_type(), "write_kv", [&] { write<scalar_t, scalar_t>(k, v, k_cache, v_cache, slot_mapping); });
}

TORCH_LIBRARY_FRAGMENT(ringserve_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, Tensor(a!) out) -> ()",
        &paged_attention);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv);
}

}  // namespace ringserve_cpu
