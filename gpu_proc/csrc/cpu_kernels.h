// The CPU kernels' entry points, shared by their registrations and by the fused transformer block
// (cpu_block.cpp). Shapes and contracts: gpu_proc/attention/cpu_backend.py, gpu_proc/cpu_ops.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace ringserve_cpu {

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& block_tables, double scale, at::Tensor out);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rope(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
void silu_mul(const at::Tensor& gate_up, at::Tensor out);
// A GGUF-quantized weight (uint8 blocks, cpu_quant.cpp) and the linear layer that reads it.
bool is_quantized(const at::Tensor& w);
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

}  // namespace ringserve_cpu
