"""How many KV blocks fit on the GPU: the pool takes what `--gpu-memory-utilization` leaves after
the weights (and anything else already allocated) and an activation reserve.

    budget = total * utilization - used_now - activation_reserve
    num_blocks = budget // block_bytes

`used_now` is `total - free` as the driver reports it after the weights are loaded, so it counts
the weights, torch's cached allocations, the CUDA context and any other process on the device.
The arithmetic is a pure function (`plan_kv_blocks`, `plan_for_model`), tested on CPU with the numbers of
docs/design.md#sizing and of an H200; only `gpu_memory_info` touches torch.cuda.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.config import DEFAULTS

GIB = 1024**3
# cuBLAS workspaces, CUDA-graph pools, allocator fragmentation and the split-KV scratch: not
# proportional to the step size, so a fixed floor on top of the per-token estimate.
FIXED_ACTIVATION_OVERHEAD = 1 * GIB


class KVSizingError(ValueError):
    """The pool would get no blocks (or a nonsensical input); the message says what to change."""


@dataclass(frozen=True)
class KVPlan:
    """The sizing decision and the numbers it came from (logged at start-up, shown in /metrics)."""

    num_blocks: int
    block_bytes: int
    total_bytes: int
    used_bytes: int
    activation_reserve_bytes: int
    utilization: float
    block_size: int = DEFAULTS.block_size

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_blocks} blocks x {self.block_bytes / 2**20:.2f} MiB = "
            f"{self.pool_bytes / GIB:.2f} GiB, {self.tokens} tokens (GPU {self.total_bytes / GIB:.1f} GiB x "
            f"{self.utilization:g}, in use {self.used_bytes / GIB:.2f} GiB, activation reserve "
            f"{self.activation_reserve_bytes / GIB:.2f} GiB)"
        )


def memory_plan_lines(plan: KVPlan, weights_bytes: int, dtype_name: str) -> list[str]:
    """The start-up log's memory plan: where the device's memory goes, one line each."""
    other = max(0, plan.used_bytes - weights_bytes)
    return [
        f"memory plan: GPU {plan.total_bytes / GIB:.1f} GiB, {plan.utilization:g} of it for the server",
        f"memory plan: weights {weights_bytes / GIB:.2f} GiB ({dtype_name}); CUDA context, allocator and other "
        f"processes {other / GIB:.2f} GiB",
        f"memory plan: activation reserve {plan.activation_reserve_bytes / GIB:.2f} GiB",
        f"memory plan: KV cache {plan.num_blocks} blocks x {plan.block_bytes / 2**20:.2f} MiB = "
        f"{plan.pool_bytes / GIB:.2f} GiB ({dtype_name}), {plan.tokens} tokens",
    ]


def kv_block_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers, K and V: 8.39 MB for a 7B model in fp16."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
        ("dtype_bytes", dtype_bytes),
    ):
        if value <= 0:
            raise KVSizingError(f"{name} must be > 0, got {value}")
    return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype_bytes


def estimate_activation_bytes(
    *, max_step_tokens: int, max_rows: int, hidden_size: int, intermediate_size: int, vocab_size: int, dtype_bytes: int
) -> int:
    """Peak transient memory of one step, plus the fixed overhead.

    Per token, the widest point of a Llama layer holds the residual, the normed input, q/k/v, the
    attention output and gate/up/act of the MLP: about 4 * hidden + 3 * intermediate values.
    Per sampling row, float32 logits plus the sampler's softmax and sorted copy: 3 * vocab floats.
    """
    if max_step_tokens <= 0 or max_rows <= 0:
        raise KVSizingError(f"max_step_tokens and max_rows must be > 0, got {max_step_tokens}, {max_rows}")
    per_token = (4 * hidden_size + 3 * intermediate_size) * dtype_bytes
    logits = max_rows * vocab_size * 4 * 3
    return max_step_tokens * per_token + logits + FIXED_ACTIVATION_OVERHEAD


def plan_kv_blocks(
    *,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    block_bytes: int,
    activation_reserve_bytes: int,
    block_size: int = DEFAULTS.block_size,
) -> KVPlan:
    """Blocks the pool gets. Call after the weights are on the device, before the pool exists."""
    if not 0.0 < utilization <= 1.0:
        raise KVSizingError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if total_bytes <= 0 or not 0 <= free_bytes <= total_bytes:
        raise KVSizingError(f"device reports free={free_bytes} of total={total_bytes} bytes")
    if block_bytes <= 0 or activation_reserve_bytes < 0:
        raise KVSizingError(
            f"block_bytes must be > 0 and the reserve >= 0, got {block_bytes}, {activation_reserve_bytes}"
        )
    used = total_bytes - free_bytes
    budget = int(total_bytes * utilization) - used - activation_reserve_bytes
    num_blocks = max(0, budget // block_bytes)
    plan = KVPlan(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        total_bytes=total_bytes,
        used_bytes=used,
        activation_reserve_bytes=activation_reserve_bytes,
        utilization=utilization,
        block_size=block_size,
    )
    if num_blocks == 0:
        raise KVSizingError(
            f"no GPU memory left for the KV cache: {plan.describe()}. Raise --gpu-memory-utilization, "
            f"lower --prefill-budget or --max-rows (smaller activation reserve), free the GPU of other "
            f"processes, or serve a smaller model."
        )
    return plan


def gpu_memory_info(device) -> tuple[int, int]:
    """(free, total) bytes on a CUDA device, as the driver reports them."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def plan_for_model(
    *,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    dtype_bytes: int,
    block_size: int,
    max_rows: int,
    prefill_budget: int,
) -> KVPlan:
    """The pool a model of this shape gets on a device with `free_bytes` free after its weights:
    the engine's sizing, a pure function (tests feed it the design's and an H200's numbers). The
    reserve covers the largest step the scheduler can build: every row decoding plus the prefill
    budget at its highest (8x when few rows decode, docs/design.md#scheduler-pass)."""
    block_bytes = kv_block_bytes(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype_bytes=dtype_bytes,
    )
    reserve = estimate_activation_bytes(
        max_step_tokens=max_rows + prefill_budget * 8,
        max_rows=max_rows,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        dtype_bytes=dtype_bytes,
    )
    return plan_kv_blocks(
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        utilization=utilization,
        block_bytes=block_bytes,
        activation_reserve_bytes=reserve,
        block_size=block_size,
    )


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes on a CUDA device now, after emptying torch's cache (memory torch holds
    but does not use counts as free)."""
    import torch

    torch.cuda.empty_cache()
    return gpu_memory_info(device)
