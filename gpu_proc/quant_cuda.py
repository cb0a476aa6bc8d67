"""GGUF-quantized projections on CUDA: the launchers of `attention/kernels/quant_linear.cu`.

The blocks stay as they are stored (`quant.py`: uint8 `[N, K / 32, block bytes]`, now in GPU
memory). `QuantKernels` plans each launch and hands it to an executor, as `AttentionKernels` does
(CuPy on a GPU, the CPU execution harness in tests):

- `gemv(x, blocks)`: decode-shaped products (up to `GEMV_MAX_ROWS` rows of x) read the blocks
  directly, one warp per output row; a row's result is the same bits whatever else shares the call;
- `dequantize(blocks, dtype)`: the dense weight, bit for bit `quant.dequantize` (cast), for
  prefill-shaped products, which then run as torch's tensor-core GEMM on a scratch buffer the
  layer shares (`linear`); `embedding` gathers and dequantizes the rows a step reads.

The spec is `quant.dequantize`: `F.linear(x, dequantize(w))`, which is what `--quantization none`
serves. `CudaQuantLinear` and `CudaQuantEmbedding` are the modules the model holds on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy
import torch
from torch import nn
from torch.nn import functional as F

from .attention import cupy_backend
from .quant import BLOCK, BY_TYPE, Q4_1, Q5_1, dequantize, format_of

# Rows of x a launch of the GEMV reads per CTA (quant_linear.cu RS_QGEMV_TOKENS) and output rows per
# CTA (one a warp). Up to GEMV_MAX_ROWS rows the blocks are read GEMV_MAX_ROWS / 8 times at most,
# still fewer bytes than one pass over a float16 weight; above it one dequantization feeds a GEMM.
GEMV_TOKENS = 8
GEMV_ROWS_PER_CTA = cupy_backend.QGEMV_THREADS // 32
GEMV_MAX_ROWS = 32
DEQUANT_VALUES = 8  # weights per thread of the dequantization
DTYPES = tuple(cupy_backend.TRAITS)


def kernel_names(formats: Iterable[str], dtype: torch.dtype) -> list[str]:
    """Every kernel a model holding blocks of `formats` in activations of `dtype` launches."""
    names = []
    for fmt in sorted(set(formats)):
        names += [cupy_backend.qgemv_kernel(fmt, dtype), cupy_backend.qdequant_kernel(fmt, dtype)]
    return names


def _rows_readable(x: torch.Tensor) -> bool:
    """x's rows as the GEMV reads them: contiguous, 16-byte aligned, a multiple of 8 elements apart
    (one row: its stride is never read)."""
    return x.stride(1) == 1 and x.data_ptr() % 16 == 0 and (x.shape[0] < 2 or x.stride(0) % 8 == 0)


def _check_blocks(blocks: torch.Tensor) -> str:
    fmt = format_of(blocks)  # raises on anything but uint8 [N, K/32, block bytes]
    if not blocks.is_contiguous():
        raise ValueError("blocks: must be contiguous")
    if blocks.data_ptr() % 2:
        raise ValueError("blocks: must be 2-byte aligned (the kernels read 16-bit words)")
    return fmt.name


class QuantKernels:
    """The launchers, running their kernels on `executor` (`cupy_executor.KernelExecutor`)."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def compile(
        self,
        formats: Iterable[str],
        dtype: torch.dtype,
        device: torch.device,
        progress: Callable[[], None] | None = None,
    ) -> list[str]:
        names = kernel_names(formats, dtype)
        self.executor.compile(names, torch.device(device), progress)
        return names

    def gemv(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, K]` @ the blocks' weight `[N, K]`.T (+ bias), any T (GEMV_TOKENS rows of x a CTA)."""
        device = self.executor.device_of(blocks)
        fmt = _check_blocks(blocks)
        n, nb, _ = blocks.shape
        if x.dtype not in DTYPES:
            raise TypeError(f"x: dtype {x.dtype} is not one of {', '.join(str(d) for d in DTYPES)}")
        if x.dim() != 2 or x.shape[1] != nb * BLOCK:
            raise ValueError(f"x: expected [T, {nb * BLOCK}] for blocks {tuple(blocks.shape)}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"x: on {x.device}, the blocks on {device}")
        if x.shape[0] and not _rows_readable(x):
            raise ValueError("x: rows must be contiguous, 16-byte aligned, a multiple of 8 elements apart")
        if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
            raise ValueError(f"bias: expected contiguous {x.dtype} [{n}], got {bias.dtype} {tuple(bias.shape)}")
        t = x.shape[0]
        out = self.executor.empty((t, n), x.dtype, device)
        if t == 0 or n == 0:
            return out
        self.executor.launch(
            cupy_backend.qgemv_kernel(fmt, x.dtype),
            device,
            (math.ceil(n / GEMV_ROWS_PER_CTA), math.ceil(t / GEMV_TOKENS)),
            (cupy_backend.QGEMV_THREADS,),
            (
                blocks,
                x,
                x.stride(0),
                bias if bias is not None else 0,
                out,
                out.stride(0),
                numpy.int32(n),
                numpy.int32(nb),
                numpy.int32(t),
            ),
        )
        return out

    def dequantize(
        self,
        blocks: torch.Tensor,
        dtype: torch.dtype,
        rows: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`quant.dequantize(blocks)[rows]` in `dtype` (rows None: every row), into `out` if given
        (a contiguous buffer of at least the result's size: the layer's scratch)."""
        device = self.executor.device_of(blocks)
        fmt = _check_blocks(blocks)
        n, nb, _ = blocks.shape
        if dtype not in DTYPES:
            raise TypeError(f"dtype {dtype} is not one of {', '.join(str(d) for d in DTYPES)}")
        if rows is not None and (rows.dtype != torch.int64 or rows.dim() != 1 or rows.device != device):
            raise ValueError(f"rows: expected int64 [R] on {device}, got {rows.dtype} {tuple(rows.shape)}")
        r = n if rows is None else rows.shape[0]
        rows = None if rows is None else rows.contiguous()
        shape = (r, nb * BLOCK)
        if out is None:
            out = self.executor.empty(shape, dtype, device)
        else:
            if out.dtype != dtype or not out.is_contiguous() or out.numel() < r * nb * BLOCK or out.device != device:
                raise ValueError(f"out: expected a contiguous {dtype} buffer of {r * nb * BLOCK} elements on {device}")
            out = out.view(-1)[: r * nb * BLOCK].view(shape)
        total = r * nb * (BLOCK // DEQUANT_VALUES)
        if total == 0:
            return out
        self.executor.launch(
            cupy_backend.qdequant_kernel(fmt, dtype),
            device,
            (math.ceil(total / cupy_backend.QDEQUANT_THREADS),),
            (cupy_backend.QDEQUANT_THREADS,),
            (blocks, n, numpy.int32(nb), rows if rows is not None else 0, out, r),
        )
        return out

    def linear(
        self,
        x: torch.Tensor,
        blocks: torch.Tensor,
        bias: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`F.linear(x, dequantize(blocks), bias)` for x `[..., K]`: the GEMV up to GEMV_MAX_ROWS rows,
        else the weight dequantized into `scratch` and torch's GEMM."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] <= GEMV_MAX_ROWS:
            if x2.shape[0] and not _rows_readable(x2):
                x2 = x2.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
            y = self.gemv(x2, blocks, bias)
        else:
            y = F.linear(x2, self.dequantize(blocks, x.dtype, out=scratch), bias)
        return y.view(*lead, blocks.shape[0])


class CudaQuantLinear(nn.Module):
    """An `nn.Linear` whose weight is held as GGUF blocks on the device (`QuantKernels.linear`).
    `scratch`: a buffer the model's layers share for prefill-shaped dequantizations."""

    blocks: torch.Tensor

    def __init__(
        self, kernels: QuantKernels, blocks: torch.Tensor, bias: torch.Tensor | None, scratch: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.kernels, self.scratch = kernels, scratch
        self.register_buffer("blocks", blocks, persistent=False)
        self.bias = bias
        self.format = format_of(blocks).name
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * BLOCK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.blocks, self.bias, self.scratch)


class CudaQuantEmbedding(nn.Module):
    """`nn.Embedding` over GGUF blocks on the device: the rows a step reads, dequantized."""

    blocks: torch.Tensor

    def __init__(self, kernels: QuantKernels, blocks: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernels, self.dtype = kernels, dtype
        self.register_buffer("blocks", blocks, persistent=False)
        self.format = format_of(blocks).name

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lead = input_ids.shape
        ids = input_ids.reshape(-1).to(torch.int64)
        return self.kernels.dequantize(self.blocks, self.dtype, rows=ids).view(*lead, -1)


def random_blocks(fmt: str, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """CPU blocks `[n, k / 32, bytes]` of format `fmt` with random integers (every bit pattern of
    the nibbles, high bits and int8s) and finite scales: d in [0.001, 0.05], m in [-0.5, 0.5]
    (the kernel tests' and the start-up check's inputs)."""
    form = next(f for f in BY_TYPE.values() if f.name == fmt)
    nb = k // BLOCK
    blocks = torch.randint(0, 256, (n, nb, form.block_bytes), dtype=torch.uint8, generator=generator)
    d = (torch.rand(n, nb, generator=generator) * 0.049 + 0.001).to(torch.float16)
    blocks[..., 0:2] = d.view(torch.uint8).view(n, nb, 2)
    if form in (Q4_1, Q5_1):
        m = (torch.rand(n, nb, generator=generator) - 0.5).to(torch.float16)
        blocks[..., 2:4] = m.view(torch.uint8).view(n, nb, 2)
    return blocks


def default_kernels() -> QuantKernels:
    """The launchers on the attention kernels' CuPy executor (one compile cache for the unit)."""
    return QuantKernels(cupy_backend.default_kernels().executor)


def serve_on_device(model, kernels: QuantKernels) -> list[torch.Tensor]:
    """Move a model's GGUF blocks (`model.quantized`, name -> CPU blocks) to its device and put
    `CudaQuantLinear` / `CudaQuantEmbedding` modules in place of the layers they stand for (a tied
    head reads the embedding's blocks); one scratch buffer, as large as the largest weight, serves
    every layer's prefill dequantization. Empties `model.quantized`; returns the device blocks."""
    device, dtype = model.device, model.dtype
    blocks = {name: b.to(device) for name, b in model.quantized.items()}
    embed = blocks.pop("model.embed_tokens.weight", None)
    tied_head = embed is not None and model.args.tie_word_embeddings and "lm_head.weight" not in blocks
    linears = list(blocks.values()) + ([embed] if tied_head else [])  # the embedding gathers its own rows
    scratch = torch.empty(
        max((b.shape[0] * b.shape[1] * BLOCK for b in linears), default=0), dtype=dtype, device=device
    )
    for name, b in blocks.items():
        path = name.removesuffix(".weight")
        parent, _, leaf = path.rpartition(".")
        linear = model.get_submodule(path)
        bias = linear.bias if linear.bias is not None and not linear.bias.is_meta else None
        setattr(model.get_submodule(parent) if parent else model, leaf, CudaQuantLinear(kernels, b, bias, scratch))
    if embed is not None:
        model.model.embed_tokens = CudaQuantEmbedding(kernels, embed, dtype)
        if tied_head:
            model.lm_head = CudaQuantLinear(kernels, embed, None, scratch)
        blocks["model.embed_tokens.weight"] = embed
    for b in blocks.values():
        name = format_of(b).name
        model.quantized_formats[name] = model.quantized_formats.get(name, 0) + 1
    model.quantized = {}
    return list(blocks.values())


def dequantize_on_device(model) -> None:
    """The reverse of `serve_on_device` (a failed kernel check, a reference setup): every
    quantized module back to its float layer, dequantized by the torch spec on the CPU (its int32
    intermediates would take several times the weight's size in device memory) and copied over;
    a tied head gets the embedding's weight from `tie_weights`."""
    tied = model.args.tie_word_embeddings
    for path, module in list(model.named_modules()):
        if not isinstance(module, (CudaQuantLinear, CudaQuantEmbedding)):
            continue
        if tied and path == "lm_head":
            model.lm_head = nn.Linear(model.args.hidden_size, model.args.vocab_size, bias=False, device="meta")
            continue
        values = dequantize(module.blocks.cpu()).to(model.dtype).to(model.device)
        weight = nn.Parameter(values, requires_grad=False)
        if isinstance(module, CudaQuantEmbedding):
            replacement: nn.Module = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
        else:
            replacement = nn.Linear(
                module.in_features, module.out_features, bias=module.bias is not None, device="meta"
            )
            if module.bias is not None:
                replacement.bias = nn.Parameter(module.bias, requires_grad=False)
        replacement.weight = weight
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
    if tied:
        model.tie_weights()
    model.quantized_formats = {}


# The start-up check's weight: 45 rows (CTA edges), 34 blocks a row (lanes take two); rows of x
# across the GEMV's tiles, one past GEMV_MAX_ROWS. Small: a check of every format takes milliseconds.
CHECK_N, CHECK_K = 45, 1088
CHECK_ROWS = (1, 9, GEMV_MAX_ROWS + 1)


def check_quant_kernels(kernels: QuantKernels, formats: Iterable[str], dtype: torch.dtype, device: torch.device):
    """Each format's GEMV and dequantization on the device against the torch spec (float64
    products of `quant.dequantize`; the dequantization bit for bit): `self_check.OpCheck`s, op
    `quant <format>`. A launch that raises is a failed check, unless the device is left unusable."""
    from .attention.self_check import ERROR_CHARS, OpCheck, _usable_or_raise, _worst

    checks = []
    for fmt in sorted(set(formats)):
        names = tuple(kernel_names([fmt], dtype))
        shape = (
            f"{CHECK_N} x {CHECK_K} blocks of {fmt}, rows of x {list(CHECK_ROWS)}, {str(dtype).removeprefix('torch.')}"
        )
        try:
            gen = torch.Generator().manual_seed(11)
            blocks = random_blocks(fmt, CHECK_N, CHECK_K, gen).to(device)
            weight = dequantize(blocks)
            dense = kernels.dequantize(blocks, dtype)
            ok, worst, tol = torch.equal(dense, weight.to(dtype)), 0.0, ""
            if not ok:
                worst = float((dense.double() - weight.double()).abs().max())
            for t in CHECK_ROWS:
                x = torch.randn(t, CHECK_K, generator=gen).to(dtype).to(device)
                verdict = _worst(kernels.gemv(x, blocks), x.double() @ weight.double().T, dtype)
                ok, worst, tol = ok and verdict[0], max(worst, verdict[1]), verdict[2]
            checks.append(OpCheck(f"quant {fmt}", names, shape, ok, worst, f"dequantized bit for bit; GEMV {tol}"))
        except Exception as exc:  # a launch that raised: the layers of this format are dequantized
            _usable_or_raise(device, f"quant {fmt}", exc)
            error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
            checks.append(OpCheck(f"quant {fmt}", names, shape, False, float("nan"), "-", error))
    return tuple(checks)


def verify_model(model, device: torch.device, require: bool, progress: Callable[[], None] | None = None) -> dict:
    """Compile and check the kernels of the blocks a model serves on the device; on a failure
    (or a compile NVRTC refuses) its layers are dequantized and served by torch (with `require`,
    --require-kernels, the start fails instead). Returns what the GPU process publishes."""
    import logging

    from .attention.self_check import KernelCheckFatal

    log = logging.getLogger("ringserve.gpu")
    kernels, formats = model.quant_kernels, set(model.quantized_formats)
    try:
        kernels.compile(formats, model.dtype, device, progress)
        checks = check_quant_kernels(kernels, formats, model.dtype, device)
    except KernelCheckFatal:
        raise
    except Exception as exc:  # NVRTC refused the source
        if require:
            raise KernelCheckFatal(f"--require-kernels: the quantized kernels do not compile: {exc}") from exc
        log.error("quantized kernels do not compile, serving the weights dequantized: %s", exc)
        model.dequantize_device_blocks()
        return {"served": "dequantized", "failures": [{"op": "quant compile", "error": str(exc)[:120]}]}
    failed = [c for c in checks if not c.ok]
    for c in failed:
        log.error(
            "quantized kernel check FAILED for %s (%s): worst error %.3g (%s) on %s%s",
            c.op,
            ", ".join(c.kernels),
            c.worst_error,
            c.tolerance,
            c.shape,
            f": {c.error}" if c.error else "",
        )
    if failed and require:
        raise KernelCheckFatal(f"--require-kernels: the {failed[0].op} kernel check failed ({failed[0].shape})")
    if failed:
        model.dequantize_device_blocks()  # every format: one model, one path
        log.error("serving every quantized weight dequantized (torch) after the failed check")
        return {
            "served": "dequantized",
            "failures": [{"op": c.op, "error": c.error, "worst_error": str(c.worst_error)} for c in failed],
        }
    log.info("quantized kernels verified against the reference: %s", ", ".join(sorted(formats)))
    return {"served": "kernels", "formats": sorted(formats), "failures": []}
