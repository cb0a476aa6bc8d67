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
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

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

// LoRA adapters' deltas on a projection's output: y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T for
// each slot's rows, A [slots, R, in] and B [slots, out, R] (scaled, block-diagonal over a fused
// group). Spec: LoraStep.delta in gpu_proc/lora.py; `lora` holds A and B of qkv, o, gate_up, down.
void lora_add(const at::Tensor& x, at::Tensor& y, const at::TensorList lora, int64_t group,
              const at::IntArrayRef slots, const at::TensorList rows) {
  if (lora.empty()) return;
  const at::Tensor& a = lora[2 * group];
  const at::Tensor& b = lora[2 * group + 1];
  for (size_t k = 0; k < slots.size(); ++k) {
    const at::Tensor xs = x.index_select(0, rows[k]);
    y.index_add_(0, rows[k], at::matmul(at::matmul(xs, a[slots[k]].t()), b[slots[k]].t()));
  }
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
  lora_add(h, qkv, lora, 0, lora_slots, lora_rows);
  const at::Tensor q = qkv.narrow(1, 0, nq).view({t, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, nq, nkv).view({t, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, nq + nkv, nkv).view({t, num_kv_heads, head_dim});
  rope(q, k, positions, cos, sin);
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor o = at::empty({t, num_heads, head_dim}, x.options());
  paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, o);
  at::Tensor y = linear(o.view({t, nq}), o_w, o_b);  // [T, hidden]
  lora_add(o.view({t, nq}), y, lora, 1, lora_slots, lora_rows);
  add_rms_norm(y, res, post_norm, eps);                // residual += y; y = norm(residual)
  at::Tensor gate_up = linear(y, gate_up_w, gate_up_b);  // [T, 2 * intermediate]
  lora_add(y, gate_up, lora, 2, lora_slots, lora_rows);
  at::Tensor act = at::empty({t, gate_up.size(1) / 2}, x.options());
  silu_mul(gate_up, act);
  at::Tensor out = linear(act, down_w, down_b);
  lora_add(act, out, lora, 3, lora_slots, lora_rows);
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
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &linear);
  m.def("matmul_pieces(int t) -> int[]", &matmul_pieces);
}

}  // namespace ringserve_cpu
