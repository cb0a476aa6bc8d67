"""The Llama forward's small CPU operations, fused (`csrc/cpu_fused.cpp`), beside their torch references.

Each `*_reference` is the spec: the same math as `model/llama.py`'s modules (and Hugging Face's
Llama), rounding to the model dtype where they do. The launchers check what the kernels assume
(CPU, float32 or bfloat16, matching dtypes, contiguous rows) and raise ValueError before a kernel
runs. `tests/gpu_proc/test_cpu_ops.py` sweeps shapes and dtypes against the references.

- `rms_norm(x, w, eps)` -> new tensor: `w * (x / rms(x))`, normalised in float32.
- `add_rms_norm_(x, residual, w, eps)`: `residual += x`, then `x = rms_norm(residual)`, in place —
  the residual stream and the next layer's input in one pass, as the transformer block needs them.
- `rope_(q, k, positions, cos, sin)`: rotary embedding of q and k in place ("rotate half" form);
  q and k may be views into one fused projection output.
- `silu_mul(gate_up)` -> `silu(gate) * up` from the fused gate/up projection `[T, 2I]`.
- `argmax_rows(logits)` -> `torch.argmax(logits, -1)` (greedy sampling), about 10x faster on CPU.
- `lora_add_(x, y, a, bt, rows, slots, segs)`: `y[rows] += (x[rows] @ A[slot]^T) @ Bt[slot]` per
  slot's rows, the LoRA adapters' gathered low-rank product (`lora.py`; the block runs it after
  each projection).
- `block(x, residual, weights, step, check)`: one whole transformer block (`csrc/cpu_block.cpp`),
  the kernels above and the packed matmuls in one call; `BlockWeights` and `BlockStep` hold what
  stays fixed for a model and for a step.

`PackedLinear` is the matmul side: a weight reordered once, at load, into oneDNN's blocked layout
(what Inductor's CPU "freezing" does). On the 2-vCPU AMD machine of docs/BENCHMARKS.md it ran a
`[T, 512] x [512, 2816]` projection 2.0x (bfloat16, T = 1-32) and 2.4x (float32, T = 32) faster than
`F.linear`, whose float32 path is MKL (slow on AMD) and whose bfloat16 path reorders the weight on
every call. With the compiled kernels loaded it runs through `csrc/cpu_block.cpp`'s `linear`, which
splits the rows into pieces of a few sizes (`matmul_pieces`) so oneDNN's per-shape primitive caches
stay small (see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

DTYPES = (torch.float32, torch.bfloat16)


def _check(name: str, x: torch.Tensor, dims: int, dtype: torch.dtype | None = None) -> None:
    if x.device.type != "cpu" or x.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-d CPU tensor, got shape {tuple(x.shape)} on {x.device}")
    if x.dtype not in DTYPES or (dtype is not None and x.dtype != dtype):
        raise ValueError(f"{name}: dtype {x.dtype} (expected {dtype or 'float32 or bfloat16'})")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {x.stride()}")


def _check_weight(w: torch.Tensor, x: torch.Tensor) -> None:
    _check("weight", w, 1, x.dtype)
    if w.shape[0] != x.shape[-1]:
        raise ValueError(f"weight of {w.shape[0]} elements for rows of {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check("x", x, 2)
    _check_weight(weight, x)
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.ringserve_cpu.rms_norm.default(x, weight, eps, out)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x; x = rms_norm(residual). Both in place; returns x."""
    for name, t in (("x", x), ("residual", residual)):
        _check(name, t, 2, x.dtype)
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    _check_weight(weight, x)
    torch.ops.ringserve_cpu.add_rms_norm.default(x, residual, weight, eps)
    return x


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised rows, new residual) without touching the inputs."""
    res = residual + x
    return rms_norm_reference(res, weight, eps), res


def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q `[T, H, D]`, k `[T, KVH, D]` rotated in place; cos/sin float32 `[max_pos, D]`; positions int64 `[T]`."""
    _check_rope(q, k, positions, cos, sin)
    torch.ops.ringserve_cpu.rope.default(q, k, positions, cos, sin)


def _check_rope(q, k, positions, cos, sin) -> None:
    _check("q", q, 3)
    _check("k", k, 3, q.dtype)
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need equal tokens and an even, equal head_dim")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != d or not table.is_contiguous():
            raise ValueError(
                f"{name}: expected a contiguous float32 [max_pos, {d}] table, got {table.dtype} {tuple(table.shape)}"
            )
    if positions.dtype != torch.int64 or positions.shape != (t,) or positions.stride(0) != 1:
        raise ValueError(f"positions: expected contiguous int64 [{t}], got {positions.dtype} {tuple(positions.shape)}")


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]` with cos/sin rows `[T, D]` (already indexed by position), in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _check("gate_up", gate_up, 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [T, 2 * intermediate], got {tuple(gate_up.shape)}")
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    torch.ops.ringserve_cpu.silu_mul.default(gate_up, out)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_PACKS: dict[torch.dtype, bool] = {}


def packs(dtype: torch.dtype) -> bool:
    """oneDNN can pack a `dtype` weight on this CPU. Every x86/aarch64 torch wheel has oneDNN, but its
    bfloat16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT ("bf16 path needs the cpu support ..."
    on an AVX2-only EPYC): asked once per dtype by trying, as no public call says so."""
    if dtype not in _PACKS:
        ok = torch.backends.mkldnn.is_available()
        if ok:
            try:
                torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
            except RuntimeError:
                ok = False
        _PACKS[dtype] = ok
    return _PACKS[dtype]


class PackedLinear:
    """`F.linear(x, weight, bias)` with the weight packed once for oneDNN where it can pack that dtype
    here (`packs`), else plain `F.linear`; the fused forward is only used where it packs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if weight.device.type != "cpu" or weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(
                f"weight: expected a 2-d float32 or bfloat16 CPU tensor, got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        self.weight, self.bias = weight, bias
        self.shape = tuple(weight.shape)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if packs(weight.dtype) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if kernels_loaded():
            return torch.ops.ringserve_cpu.linear.default(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, self.bias, "none", [], "")


def matmul_pieces(t: int) -> list[int]:
    """The row counts `PackedLinear` runs a `t`-row matmul as, the last one possibly padded (needs the
    compiled kernels)."""
    return list(torch.ops.ringserve_cpu.matmul_pieces.default(t))


def kernels_loaded() -> bool:
    """True when this process has the compiled kernels (a cheap check, made per sampling step)."""
    return hasattr(torch.ops.ringserve_cpu, "argmax_rows")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 `[R]`: each row's first maximum (a NaN counts as the maximum), as `torch.argmax`."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected float32 [rows, vocab] CPU rows, got {logits.dtype} "
            f"{tuple(logits.shape)} on {logits.device}"
        )
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    torch.ops.ringserve_cpu.argmax_rows.default(logits, out)
    return out


@dataclass(frozen=True)
class BlockWeights:
    """One transformer block's weights in the order `torch.ops.ringserve_cpu.block` takes them."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    # PackedLinear or quant.QuantLinear (GGUF blocks): both give `shape`, `packed` and `bias`
    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    def __post_init__(self) -> None:
        hidden = self.input_norm.shape[0]
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "qkv": (self.qkv.shape, (q + 2 * kv, hidden)),
            "o": (self.o.shape, (hidden, q)),
            "down": (self.down.shape, (hidden, self.gate_up.shape[0] // 2)),
        }
        for name, (got, want) in shapes.items():
            if tuple(got) != want:
                raise ValueError(f"{name} weight {tuple(got)} does not fit the block (expected {want})")

    def args(self) -> tuple:
        return (
            self.input_norm,
            self.post_norm,
            self.eps,
            self.qkv.packed,
            self.qkv.bias,
            self.o.packed,
            self.o.bias,
            self.gate_up.packed,
            self.gate_up.bias,
            self.down.packed,
            self.down.bias,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
        )


def block(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weights: tuple,
    step: tuple,
    check: bool = True,
    lora: tuple[list[torch.Tensor], tuple[torch.Tensor, ...], tuple[int, ...]] = ([], (), ()),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One transformer block: returns (the block's output, the residual stream). `weights` is
    `BlockWeights.args()`; `step` is (positions, cos, sin, slot_mapping, k_cache, v_cache, meta);
    `lora` the step's adapter rows in this block (`lora.LoraStep.args(layer)`, rows, slots).
    x (and residual) are overwritten. With `check`, every shape the kernels rely on is checked
    first, as the one-op launchers check theirs."""
    positions, cos, sin, slot_mapping, k_cache, v_cache, meta = step
    if check:
        _check_block(x, residual, weights, step)
        if lora[0]:
            _check_lora(x, weights, lora)
    return torch.ops.ringserve_cpu.block.default(
        x,
        residual,
        *weights,
        positions,
        cos,
        sin,
        slot_mapping,
        k_cache,
        v_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        *lora,
    )


def lora_add_reference(x, y, a, bt, rows, slots, segs) -> None:
    """The spec of `lora_add_` (`lora.LoraStep.delta`): `segs` only says which output columns each
    target writes, which the reference reads from Bt's zeros."""
    for slot, r in zip(slots, rows):
        y.index_add_(0, r, (x.index_select(0, r) @ a[slot].t()) @ bt[slot])


def lora_add_(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
    slots: tuple[int, ...],
    segs: tuple[int, ...],
) -> None:
    """`lora_add_reference` by the CPU kernel, in place on `y`. Rows must be distinct across slots
    (each token runs one adapter): the kernel writes them in parallel."""
    _check("x", x, 2)
    _check("y", y, 2, x.dtype)
    for name, t in (("a", a), ("bt", bt)):
        _check(name, t, 3, x.dtype)
        if not t.is_contiguous():
            raise ValueError(f"lora_add: {name} must be contiguous")
    if not (x.is_contiguous() and y.is_contiguous()) or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora_add: x {tuple(x.shape)} and y {tuple(y.shape)} must be contiguous, of the same rows")
    if a.shape[2] != x.shape[1] or bt.shape[:2] != a.shape[:2] or bt.shape[2] != y.shape[1]:
        raise ValueError(f"lora_add: A {tuple(a.shape)} / Bt {tuple(bt.shape)} do not fit {x.shape[1]} -> {y.shape[1]}")
    if not segs or sum(segs) != y.shape[1] or a.shape[1] % len(segs):
        raise ValueError(f"lora_add: segments {segs} do not split {y.shape[1]} columns and {a.shape[1]} ranks")
    if len(rows) != len(slots) or any(not 0 <= s < a.shape[0] for s in slots):
        raise ValueError(f"lora_add: slots {slots} for {len(rows)} row lists and {a.shape[0]} slots")
    _check_rows(rows, x.shape[0])
    torch.ops.ringserve_cpu.lora_add.default(x, y, a, bt, list(rows), list(slots), list(segs))


def _check_rows(rows: tuple[torch.Tensor, ...], t: int) -> None:
    seen = torch.cat(list(rows)) if rows else torch.empty(0, dtype=torch.int64)
    for r in rows:
        if r.dtype != torch.int64 or r.dim() != 1 or (r.numel() and not 0 <= int(r.min()) <= int(r.max()) < t):
            raise ValueError(f"lora rows: expected int64 token indices below {t}, got {r.dtype} {tuple(r.shape)}")
    if seen.unique().numel() != seen.numel():
        raise ValueError("lora rows: a token in two slots' rows")


def _check_lora(x: torch.Tensor, weights: tuple, lora: tuple) -> None:
    """The adapters' stacked A / B fit the block's projections and x's dtype, and every row index
    is in the step (`index_select` would raise mid-block otherwise)."""
    tensors, rows, slots = lora
    if len(tensors) != 8 or len(rows) != len(slots):
        raise ValueError(
            f"lora: expected A and B of 4 groups and one row list per slot, got {len(tensors)} / {len(rows)}"
        )
    hidden, num_heads, num_kv_heads, head_dim = x.shape[1], weights[11], weights[12], weights[13]
    inter = tensors[6].shape[2] if tensors[6].dim() == 3 else -1  # down's A: [slots, R, intermediate]
    ins = [hidden, num_heads * head_dim, hidden, inter]
    outs = [(num_heads + 2 * num_kv_heads) * head_dim, hidden, 2 * inter, hidden]
    for g in range(4):
        a, b = tensors[2 * g], tensors[2 * g + 1]
        if a.dtype != x.dtype or b.dtype != x.dtype or a.dim() != 3 or b.dim() != 3:
            raise ValueError(
                f"lora group {g}: A {a.dtype} {tuple(a.shape)} / B {b.dtype} {tuple(b.shape)} for x {x.dtype}"
            )
        if (
            a.shape[1] % (3, 1, 2, 1)[g]
            or a.shape[2] != ins[g]
            or b.shape[2] != outs[g]
            or b.shape[1] != a.shape[1]
            or b.shape[0] != a.shape[0]
        ):
            raise ValueError(
                f"lora group {g}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit {ins[g]} -> {outs[g]}"
            )
        if any(not 0 <= s < a.shape[0] for s in slots):
            raise ValueError(f"lora: slots {slots} outside the {a.shape[0]} resident")
    _check_rows(rows, x.shape[0])


def _check_block(x, residual, weights: tuple, step: tuple) -> None:
    from .attention import cpu_backend

    positions, cos, sin, slot_mapping, k_cache, v_cache, meta = step
    input_norm, num_heads, num_kv_heads, head_dim = weights[0], weights[11], weights[12], weights[13]
    _check("x", x, 2)
    _check_weight(input_norm, x)
    if not x.is_contiguous():
        raise ValueError(f"x: must be contiguous, got strides {x.stride()}")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous()
    ):
        raise ValueError(
            f"residual {residual.dtype} {tuple(residual.shape)} does not match x {x.dtype} {tuple(x.shape)}"
        )
    # The kernels' own launchers check views of these shapes; the block makes them the same way.
    t = x.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=x.dtype)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=x.dtype)
    _check_rope(q, k, positions, cos, sin)
    cpu_backend.check_write(k, k, k_cache, v_cache, slot_mapping)
    cpu_backend.check_attention(q, k_cache, v_cache, meta)
