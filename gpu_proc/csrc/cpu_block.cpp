// One transformer block of the fused CPU forward in a single call.
//
// [residual add +] RMSNorm -> q/k/v projection -> RoPE -> KV write -> paged attention -> o
// projection -> residual add + RMSNorm -> gate/up projection -> SiLU-mul -> down projection: the
// same kernels the Python launchers run one by one (cpu_attention.cpp, cpu_fused.cpp) and the same
// packed oneDNN matmuls (`mkldnn::_linear_pointwise`), without a Python round trip between them.
// That round trip was ~40 us per block (measured on an 8-layer model with hidden size 32, where the
// math costs nothing): 15-20 % of a decode step at one to eight rows. Spec: the module-by-module
// forward in gpu_proc/model/llama.py; launcher and checks: gpu_proc/cpu_ops.py (block); test:
// tests/gpu_proc/test_cpu_ops.py (fused forward against the unfused one).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace ringserve_cpu {
namespace {

// The row counts a matmul of `t` rows runs as: `t` itself up to 64 (decode steps); above that one
// of 8 sizes per power of two — the next one up when it pads at most 1/32 of the rows, else the
// largest that fits and then the same for what is left. oneDNN builds and caches a primitive per
// input shape (two LRU caches of 1,024 entries; ~0.5 MB a shape), and a mixed step's token count
// takes almost any value up to the step budget: run at the exact count, an hour of varied traffic
// grew the process by hundreds of MB as rare counts kept arriving, and each new count cost a
// ~0.25 ms primitive build. So a 16k-token budget makes at most 128 shapes per weight and 4 pieces
// per matmul; rows are independent, so the pieces' outputs are the rows of the whole. Each extra
// piece reads the weights again (measured 2-5 % of a SmolLM2 projection); padding costs its rows
// (a 1,032-token step padded to 1,152 cost 13 %), hence the 1/32 rule: a prefill budget of 256
// tokens plus 30 decode rows runs as 288 rows, 1,032 as 1,024 + 8.
std::vector<int64_t> matmul_pieces(int64_t t) {
  std::vector<int64_t> pieces;
  while (t > 64) {
    const int64_t step = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(t)) - 3);
    const int64_t up = (t + step - 1) / step * step;
    if ((up - t) * 32 <= t) {  // the last piece, padded
      pieces.push_back(up);
      return pieces;
    }
    pieces.push_back(t / step * step);
    t -= pieces.back();  // never 0: a multiple of `step` pads by nothing above
  }
  pieces.push_back(t);  // 0 rows too (a step whose rows all score or sample nothing): one empty call
  return pieces;
}

at::Tensor linear_once(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [T, K] (contiguous) times a weight packed by mkldnn::_reorder_linear_weight (+ bias): [T, N],
// in the row pieces of matmul_pieces(T) (a last piece longer than the rows left runs on them
// padded with zero rows). A quantized weight (GGUF blocks, cpu_quant.cpp) runs its own kernel,
// which keeps no per-shape state.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  if (is_quantized(packed)) return qlinear(x, packed, bias);
  const int64_t t = x.size(0);
  const std::vector<int64_t> pieces = matmul_pieces(t);
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const int64_t n : pieces) {
    const int64_t rows = std::min(n, t - start);
    at::Tensor part = x.narrow(0, start, rows);
    if (rows < n) {
      at::Tensor padded = at::empty({n, x.size(1)}, x.options());
      padded.narrow(0, 0, rows).copy_(part);
      padded.narrow(0, rows, n - rows).zero_();
      part = padded;
    }
    at::Tensor out = linear_once(part, packed, bias);
    outs.push_back(rows < n ? out.narrow(0, 0, rows) : out);
    start += rows;
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

// LoRA adapters' deltas on a projection's output: y[rows] += (x[rows] @ A[slot]^T) @ Bt[slot] for
// each slot's rows, A [slots, R, in] and Bt [slots, R, out] (B transposed, scaled): the gathered
// low-rank product (SGMV) of a step whose rows run different adapters. A fused group's R = G * r
// ranks are its G targets' in order and target g writes only its own output columns `segs[g]`
// (the stacked B is block-diagonal), so the zero blocks are never multiplied. Work goes in tiles
// of 4 rows of one slot (A's rows are read once per tile, 16 accumulators for 4 rows x 4 ranks);
// the tiles run in parallel, each shrinking into its own buffer and expanding at once. The ATen
// form (index_select, two matmuls, index_add_ per slot) cost 28 % of a 32-row SmolLM2 decode
// step with 4 adapters, mostly in its ~80 small ops per layer. Spec: LoraStep.delta in
// gpu_proc/lora.py; `lora` holds A and Bt of qkv, o, gate_up, down.
constexpr int kLoraTile = 4;

template <typename T>
void lora_shrink(const T* const* xr, int n, int64_t in, const T* a, int64_t rank, float* tmp) {
  const int64_t vec_end = in / kLanes * kLanes;
  for (int64_t j0 = 0; j0 < rank; j0 += 4) {
    const T* ar[4];
    for (int q = 0; q < 4; ++q) ar[q] = a + std::min(j0 + q, rank - 1) * in;
    vf acc[16];
    for (vf& v : acc) v = splat(0.0f);
    for (int64_t c = 0; c < vec_end; c += kLanes) {
      vf av[4];
      for (int q = 0; q < 4; ++q) av[q] = load(ar[q] + c);
      for (int i = 0; i < kLoraTile; ++i) {
        const vf xv = load(xr[i] + c);
        for (int q = 0; q < 4; ++q) acc[4 * i + q] += av[q] * xv;
      }
    }
    const vf sums = hsum16(acc);  // lane 4 i + q: row i, rank j0 + q
    for (int i = 0; i < n; ++i)
      for (int q = 0; q < 4 && j0 + q < rank; ++q) {
        float v = sums[4 * i + q];
        for (int64_t c = vec_end; c < in; ++c) v += to_f(ar[q][c]) * to_f(xr[i][c]);
        tmp[i * rank + j0 + q] = v;
      }
  }
}

template <typename T>
void lora_expand(T* const* yr, int n, const float* tmp, int64_t rank, const T* bt, int64_t out,
                 const std::vector<int64_t>& segs) {
  const int64_t r = rank / static_cast<int64_t>(segs.size());
  int64_t off = 0;
  for (size_t g = 0; g < segs.size(); ++g) {
    const int64_t end = off + segs[g], vec_end = off + segs[g] / kLanes * kLanes;
    const T* b = bt + static_cast<int64_t>(g) * r * out;
    const float* t = tmp + static_cast<int64_t>(g) * r;
    for (int64_t c = off; c < vec_end; c += kLanes) {
      vf acc[kLoraTile];
      for (int i = 0; i < n; ++i) acc[i] = load(yr[i] + c);
      for (int64_t k = 0; k < r; ++k) {
        const vf w = load(b + k * out + c);
        for (int i = 0; i < n; ++i) acc[i] += splat(t[i * rank + k]) * w;
      }
      for (int i = 0; i < n; ++i) store(yr[i] + c, acc[i]);
    }
    for (int64_t c = vec_end; c < end; ++c)
      for (int i = 0; i < n; ++i) {
        float v = to_f(yr[i][c]);
        for (int64_t k = 0; k < r; ++k) v += t[i * rank + k] * to_f(b[k * out + c]);
        yr[i][c] = from_f<T>(v);
      }
    off = end;
  }
}

void lora_add(const at::Tensor& x, at::Tensor& y, const at::TensorList lora, int64_t group,
              const at::IntArrayRef slots, const at::TensorList rows, const std::vector<int64_t>& segs) {
  if (lora.empty()) return;
  const at::Tensor& a = lora[2 * group];
  const at::Tensor& bt = lora[2 * group + 1];
  const int64_t in = x.size(1), out = y.size(1), rank = a.size(1);
  struct Tile {
    int64_t slot;
    const int64_t* idx;
    int n;
  };
  std::vector<Tile> tiles;
  for (size_t k = 0; k < slots.size(); ++k) {
    const int64_t* idx = rows[k].data_ptr<int64_t>();
    for (int64_t i = 0; i < rows[k].numel(); i += kLoraTile)
      tiles.push_back({slots[k], idx + i, static_cast<int>(std::min<int64_t>(kLoraTile, rows[k].numel() - i))});
  }
  RS_DISPATCH(x.scalar_type(), "lora_add", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = bt.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> tmp(kLoraTile * rank);
      for (int64_t k = lo; k < hi; ++k) {
        const Tile& tile = tiles[k];
        const scalar_t* xr[kLoraTile];
        scalar_t* yr[kLoraTile];
        for (int i = 0; i < kLoraTile; ++i) {  // a short tile repeats its last row (computed, not stored)
          const int64_t row = tile.idx[std::min(i, tile.n - 1)];
          xr[i] = xp + row * in;
          yr[i] = yp + row * out;
        }
        lora_shrink(xr, tile.n, in, ap + tile.slot * rank * in, rank, tmp.data());
        lora_expand(yr, tile.n, tmp.data(), rank, bp + tile.slot * rank * out, out, segs);
      }
    });
  });
}

// The kernel alone, for its test (cpu_ops.lora_add_): one group's A and Bt.
void lora_add_op(const at::Tensor& x, at::Tensor y, const at::Tensor& a, const at::Tensor& bt, const at::TensorList rows,
                 const at::IntArrayRef slots, const at::IntArrayRef segs) {
  lora_add(x, y, {a, bt}, 0, slots, rows, std::vector<int64_t>(segs.begin(), segs.end()));
}

std::tuple<at::Tensor, at::Tensor> block(
    at::Tensor x, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, const std::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w,
    const std::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w, const std::optional<at::Tensor>& down_b,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, const at::TensorList lora, const at::TensorList lora_rows,
    const at::IntArrayRef lora_slots) {
  const int64_t t = x.size(0), nq = num_heads * head_dim, nkv = num_kv_heads * head_dim;
  at::Tensor res, h;
  if (residual.has_value()) {  // residual += x; h = norm(residual), written over x
    res = *residual;
    add_rms_norm(x, res, input_norm, eps);
    h = x;
  } else {  // the first block: x is the embedding, which becomes the residual stream
    res = x;
    h = at::empty_like(x);
    rms_norm(x, input_norm, eps, h);
  }
  at::Tensor qkv = linear(h, qkv_w, qkv_b);  // [T, (heads + 2 kv_heads) * head_dim]
  lora_add(h, qkv, lora, 0, lora_slots, lora_rows, {nq, nkv, nkv});
  const at::Tensor q = qkv.narrow(1, 0, nq).view({t, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, nq, nkv).view({t, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, nq + nkv, nkv).view({t, num_kv_heads, head_dim});
  rope(q, k, positions, cos, sin);
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor o = at::empty({t, num_heads, head_dim}, x.options());
  paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, o);
  at::Tensor y = linear(o.view({t, nq}), o_w, o_b);  // [T, hidden]
  lora_add(o.view({t, nq}), y, lora, 1, lora_slots, lora_rows, {y.size(1)});
  add_rms_norm(y, res, post_norm, eps);                // residual += y; y = norm(residual)
  at::Tensor gate_up = linear(y, gate_up_w, gate_up_b);  // [T, 2 * intermediate]
  lora_add(y, gate_up, lora, 2, lora_slots, lora_rows, {gate_up.size(1) / 2, gate_up.size(1) / 2});
  at::Tensor act = at::empty({t, gate_up.size(1) / 2}, x.options());
  silu_mul(gate_up, act);
  at::Tensor out = linear(act, down_w, down_b);
  lora_add(act, out, lora, 3, lora_slots, lora_rows, {out.size(1)});
  return {out, res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringserve_cpu, m) {
  m.def("block(Tensor(a!) x, Tensor(b!)? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_w, Tensor? qkv_b, Tensor o_w, Tensor? o_b, Tensor gate_up_w, Tensor? gate_up_b, "
        "Tensor down_w, Tensor? down_b, int num_heads, int num_kv_heads, int head_dim, float scale, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(c!) k_cache, Tensor(d!) v_cache, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, Tensor[] lora, Tensor[] lora_rows, "
        "int[] lora_slots) -> (Tensor, Tensor)",
        &block);
  m.def("lora_add(Tensor x, Tensor(a!) y, Tensor a, Tensor bt, Tensor[] rows, int[] slots, int[] segs) -> ()",
        &lora_add_op);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &linear);
  m.def("matmul_pieces(int t) -> int[]", &matmul_pieces);
}

}  // namespace ringserve_cpu
