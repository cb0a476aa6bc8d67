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
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"

namespace ringserve_cpu {
namespace {

// The row counts a matmul of `t` rows runs as: `t` itself up to 64 (decode steps); above that the
// largest of 8 sizes per power of two that fits, then the same for what is left. oneDNN builds and
// caches a primitive per input shape (two LRU caches of 1,024 entries; ~0.5 MB a shape), and a
// mixed step's token count takes almost any value up to the step budget: run at the exact count,
// an hour of varied traffic grew the process by hundreds of MB as rare counts kept arriving, and
// each new count cost a ~0.25 ms primitive build. Split so, a 16k-token budget makes at most 128
// shapes per weight and 4 pieces per matmul; rows are independent, so the pieces' outputs are the
// rows of the whole. (Padding to the next size instead wasted up to 12.5 % of a 1,032-token step.)
std::vector<int64_t> matmul_pieces(int64_t t) {
  std::vector<int64_t> pieces;
  while (t > 0) {
    int64_t n = t;
    if (t > 64) {
      const int64_t step = int64_t(1) << (63 - __builtin_clzll(static_cast<uint64_t>(t)) - 3);
      n = t / step * step;
    }
    pieces.push_back(n);
    t -= n;
  }
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
// in the row pieces of matmul_pieces(T).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const std::vector<int64_t> pieces = matmul_pieces(x.size(0));
  if (pieces.size() <= 1) return linear_once(x, packed, bias);
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (const int64_t n : pieces) {
    outs.push_back(linear_once(x.narrow(0, start, n), packed, bias));
    start += n;
  }
  return at::cat(outs, 0);
}

std::tuple<at::Tensor, at::Tensor> block(
    at::Tensor x, const std::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, const std::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w,
    const std::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w, const std::optional<at::Tensor>& down_b,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    const at::Tensor& block_tables) {
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
  const at::Tensor qkv = linear(h, qkv_w, qkv_b);  // [T, (heads + 2 kv_heads) * head_dim]
  const at::Tensor q = qkv.narrow(1, 0, nq).view({t, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, nq, nkv).view({t, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, nq + nkv, nkv).view({t, num_kv_heads, head_dim});
  rope(q, k, positions, cos, sin);
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor o = at::empty({t, num_heads, head_dim}, x.options());
  paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, o);
  at::Tensor y = linear(o.view({t, nq}), o_w, o_b);  // [T, hidden]
  add_rms_norm(y, res, post_norm, eps);                // residual += y; y = norm(residual)
  const at::Tensor gate_up = linear(y, gate_up_w, gate_up_b);  // [T, 2 * intermediate]
  at::Tensor act = at::empty({t, gate_up.size(1) / 2}, x.options());
  silu_mul(gate_up, act);
  return {linear(act, down_w, down_b), res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ringserve_cpu, m) {
  m.def("block(Tensor(a!) x, Tensor(b!)? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_w, Tensor? qkv_b, Tensor o_w, Tensor? o_b, Tensor gate_up_w, Tensor? gate_up_b, "
        "Tensor down_w, Tensor? down_b, int num_heads, int num_kv_heads, int head_dim, float scale, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(c!) k_cache, Tensor(d!) v_cache, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor block_tables) -> (Tensor, Tensor)",
        &block);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &linear);
  m.def("matmul_pieces(int t) -> int[]", &matmul_pieces);
}

}  // namespace ringserve_cpu
