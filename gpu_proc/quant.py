"""GGUF-quantized weights kept as they are stored, and the linear layer that reads them.

A quantized weight is its GGUF blocks as a uint8 tensor `[N, K / 32, block_bytes]`: every block
holds 32 consecutive weights of one output row, and the block's size names the format (`FORMATS`).
The kernel (`csrc/cpu_quant.cpp`, `torch.ops.ringserve_cpu.qlinear`) quantizes the activations
per 32 elements to int8 as llama.cpp does and takes integer dots with the blocks; the references
here are its spec, in torch:

- `dequantize(w)`: the float32 weight the blocks stand for (what `--quantization none` serves,
  and what transformers' GGUF loader gives);
- `quantize_activations(x)`: the kernel's int8 rows, scales and sums;
- `qlinear_reference(x, w)`: the kernel's arithmetic (exact integer block dots, float scales),
  equal to the kernel up to float summation order.

Rows of a weight can be permuted or concatenated as tensors (a block never spans two rows), which
is how the loader undoes llama.cpp's rotary row order and fuses q/k/v and gate/up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, every format here


@dataclass(frozen=True)
class QuantFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType
    block_bytes: int


Q4_0 = QuantFormat("Q4_0", 2, 18)  # d, 16 bytes of nibbles: w = d (n - 8)
Q4_1 = QuantFormat("Q4_1", 3, 20)  # d, m, nibbles: w = d n + m
Q5_0 = QuantFormat("Q5_0", 6, 22)  # d, 32 high bits, nibbles: w = d (n - 16)
Q5_1 = QuantFormat("Q5_1", 7, 24)  # d, m, high bits, nibbles: w = d n + m
Q8_0 = QuantFormat("Q8_0", 8, 34)  # d, 32 int8: w = d q
FORMATS = {f.block_bytes: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)}
_NIBBLES_AT = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8}
_ZERO = {Q4_0: 8, Q5_0: 16}  # the formats without m: w = d (n - zero)
BY_TYPE = {f.ggml_type: f for f in FORMATS.values()}


def format_of(w: torch.Tensor) -> QuantFormat:
    if w.dtype != torch.uint8 or w.dim() != 3 or w.shape[2] not in FORMATS:
        raise ValueError(
            f"not a quantized weight: expected uint8 [N, K/32, block bytes] with blocks of "
            f"{sorted(FORMATS)} bytes, got {w.dtype} {tuple(w.shape)}"
        )
    return FORMATS[w.shape[2]]


def _half(w: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 `[N, nb, 1]`."""
    return w[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> its 32 values: low nibbles are weights 0-15, high nibbles 16-31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.int32)


def _ints(w: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """int32 `[N, nb, 32]`: the blocks' integers (Q8_0 signed; Q4/Q5 unsigned, Q5's bit 4 being
    bit i of the block's 32 high bits)."""
    if fmt is Q8_0:
        return w[..., 2:].view(torch.int8).to(torch.int32)
    at = _NIBBLES_AT[fmt]
    n = _nibbles(w[..., at : at + 16])
    if fmt in (Q5_0, Q5_1):
        high = w[..., at - 4 : at].to(torch.int32)  # little-endian uint32
        # on the blocks' device: the spec also runs on CUDA blocks (the start-up check, the fallback)
        shifts = torch.arange(8, dtype=torch.int32, device=w.device)
        bits = (high[..., :, None] >> shifts) & 1  # [N, nb, 4 bytes, 8]
        n = n | (bits.reshape(*n.shape) << 4)
    return n


def dequantize(w: torch.Tensor) -> torch.Tensor:
    """float32 `[N, K]` of quantized blocks `[N, K / 32, bytes]` (ggml's dequantize_row_*)."""
    fmt = format_of(w)
    n, nb, _ = w.shape
    d, ints = _half(w, 0), _ints(w, fmt)
    if fmt in (Q4_1, Q5_1):
        values = d * ints.float() + _half(w, 2)
    else:
        values = d * (ints - _ZERO.get(fmt, 0)).float()
    return values.reshape(n, nb * BLOCK)


def as_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Blocks `[N, K/32, bytes]` as Q8_0 blocks: exactly for Q4_0, Q5_0 and Q8_0 (the same scale,
    the integer shifted: w = d (n - zero) = d q), requantized for Q4_1 and Q5_1 (the offset fits no
    int8 scale: per block d = max|w| / 127 and q = round(w / d), llama.cpp's Q8_0 quantizer, at
    most half a step of 1/127 of the block's largest weight away). For a fusion group of mixed
    formats, which one kernel call must read in one format."""
    fmt = format_of(w)
    if fmt is Q8_0:
        return w
    n, nb, _ = w.shape
    out = torch.empty((n, nb, Q8_0.block_bytes), dtype=torch.uint8, device=w.device)
    if fmt in _ZERO:
        out[..., 0:2] = w[..., 0:2]
        out[..., 2:] = (_ints(w, fmt) - _ZERO[fmt]).to(torch.int8).view(torch.uint8)
        return out
    values = dequantize(w).reshape(n, nb, BLOCK)
    d = values.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    out[..., 0:2] = d.to(torch.float16).view(torch.uint8)
    out[..., 2:] = torch.round(values * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[T, K]` -> (int8 values `[T, K/32, 32]`, float32 scales `[T, K/32]`, int32 sums `[T, K/32]`):
    per block d = max|x| / 127 and q = round-half-even(x / d), as the kernel does."""
    t, k = x.shape
    blocks = x.float().reshape(t, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return q, d, q.to(torch.int32).sum(-1)


def qlinear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result for x `[T, K]` and blocks `[N, K/32, bytes]`, in float64 then x's dtype."""
    fmt = format_of(w)
    q, dx, sx = quantize_activations(x)
    dw = _half(w, 0)[..., 0].double()  # [N, nb]
    ints = _ints(w, fmt)
    # exact integer block dots [T, N, nb]
    dots = torch.einsum("tbi,nbi->tnb", q.to(torch.float64), ints.to(torch.float64))
    scale = dx.double()[:, None, :] * dw[None]  # [T, N, nb]
    out = (dots * scale).sum(-1)
    if fmt in _ZERO:
        out -= _ZERO[fmt] * (scale * sx.double()[:, None, :]).sum(-1)
    elif fmt in (Q4_1, Q5_1):
        mw = _half(w, 2)[..., 0].double()
        out += (dx.double()[:, None, :] * mw[None] * sx.double()[:, None, :]).sum(-1)
    if bias is not None:
        out += bias.double()
    return out.to(x.dtype)


def repack(blocks: torch.Tensor) -> torch.Tensor:
    """The blocks in the layout the kernel reads (same shape and bytes: on an AVX-512 VNNI CPU
    panels of 16 rows interleaved block by block so one dot's lanes are 16 outputs,
    `csrc/cpu_quant.cpp`; elsewhere as stored)."""
    format_of(blocks)
    if not blocks.is_contiguous() or blocks.device.type != "cpu":
        raise ValueError("quantized blocks must be a contiguous CPU tensor")
    return torch.ops.ringserve_cpu.qrepack.default(blocks)


class QuantLinear:
    """`F.linear(x, dequantize(blocks))` read from the blocks (`PackedLinear`'s interface: the
    fused block takes `packed`, here the repacked blocks, and the C++ `linear` dispatches on uint8).
    `packed`: blocks already repacked (a tied embedding's)."""

    def __init__(
        self, blocks: torch.Tensor | None, bias: torch.Tensor | None = None, *, packed: torch.Tensor | None = None
    ) -> None:
        if packed is None:
            if blocks is None:
                raise ValueError("QuantLinear needs blocks or packed blocks")
            packed = repack(blocks)
        self.format = format_of(packed)
        self.packed, self.bias = packed, bias
        self.shape = (packed.shape[0], packed.shape[1] * BLOCK)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ringserve_cpu.qlinear.default(x, self.packed, self.bias)


def embedding(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 rows `ids` of repacked blocks: `dequantize(blocks)[ids]`, bit for bit."""
    return torch.ops.ringserve_cpu.qembed.default(packed, ids)
