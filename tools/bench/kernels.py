"""`ringserve bench kernels [--json] [--quick]`: the CUDA path against the hardware limit.

* Decode attention (one layer, 7B shape: 32 heads, head dim 128, fp16) at batch 1/32/64/256 x
  context 512/1k/4k: achieved bandwidth (K+V bytes read / kernel time) and % of the device peak,
  beside torch `scaled_dot_product_attention` on the same K/V already gathered dense.
* Decode step of a 7B-shaped Llama with random fp16 weights (32 layers, 32 heads, head dim 128,
  vocab 32,000) at batch 1 and 32 x 1k context, beside the bandwidth bound
  (weight bytes + KV bytes) / peak bandwidth. Goal at batch 32: <= 1.3 x the bound.
* Prefill of one 2,048-token prompt on the same model: tokens/s beside the FLOP bound.

Peaks come from a table of data-sheet figures by device name (dense fp16 tensor FLOPs, HBM
bandwidth); `--peak-gbps` / `--peak-tflops` override, and a device-to-device copy is measured and
reported beside them as the practically reachable bandwidth. Times are CUDA-event medians after
warm-up. Needs a CUDA device and CuPy (`pip install -e .[cuda]`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

# name fragment -> (HBM GB/s, dense fp16 tensor TFLOP/s), from the vendors' data sheets
DEVICE_PEAKS = {
    "H200": (4800.0, 989.0),
    "H100 SXM": (3350.0, 989.0),
    "H100 PCIe": (2000.0, 756.0),
    "H100 NVL": (3900.0, 835.0),
    "H100": (3350.0, 989.0),
    "A100-SXM4-80GB": (2039.0, 312.0),
    "A100 80GB PCIe": (1935.0, 312.0),
    "A100": (1555.0, 312.0),
    "L40S": (864.0, 362.0),
    "L4": (300.0, 121.0),
    "A10": (600.0, 125.0),
    "RTX 4090": (1008.0, 165.0),
}
SEVEN_B: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    max_position_embeddings=4096,
)
BLOCK = 16


@dataclass
class Peaks:
    device: str
    gbps: float | None
    tflops: float | None
    copy_gbps: float  # measured device-to-device copy: what streaming reads can actually reach


def lookup_peaks(name: str) -> tuple[float | None, float | None]:
    """Data-sheet (GB/s, TFLOP/s) for a device name; the longest matching fragment wins."""
    best = None
    for fragment, peaks in DEVICE_PEAKS.items():
        if fragment.lower() in name.lower() and (best is None or len(fragment) > len(best[0])):
            best = (fragment, peaks)
    return best[1] if best else (None, None)


def kv_bytes(batch: int, ctx: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """K and V bytes a decode step reads for `batch` rows of `ctx` tokens."""
    return 2 * batch * ctx * num_layers * num_kv_heads * head_dim * dtype_bytes


def dense_weight_bytes(args: dict, dtype_bytes: int = 2) -> int:
    """Weights a decode step streams: every matrix except the embedding table (a row gather)."""
    h, i, layers = args["hidden_size"], args["intermediate_size"], args["num_layers"]
    q = args["num_heads"] * args["head_dim"]
    kv = args["num_kv_heads"] * args["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return (layers * per_layer + h + args["vocab_size"] * h) * dtype_bytes


def prefill_flops(args: dict, tokens: int) -> float:
    """Matmul FLOPs of one prompt: 2 per weight per token, plus causal QK^T and PV (half the square)."""
    matmul = dense_weight_bytes(args, 1) * 2.0 * tokens
    attention = 2 * 2 * args["num_layers"] * args["num_heads"] * args["head_dim"] * tokens * tokens / 2
    return matmul + attention


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_graph_ms(fn, iters: int) -> float | None:
    """Median time of `fn` replayed from a CUDA graph (no host launch gaps), or None when `fn`
    cannot be captured; the reason goes to stderr."""
    import torch

    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return _time_ms(graph.replay, iters)
    except Exception as e:  # a capture failure is a finding to report, not a crash of the bench
        print(f"bench kernels: CUDA graph capture failed ({type(e).__name__}: {e}); eager timing only", file=sys.stderr)
        return None


def _measure_peaks(args) -> Peaks:
    import torch

    name = torch.cuda.get_device_name()
    gbps, tflops = lookup_peaks(name)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters=10)
    copy_gbps = 2 * src.numel() / (ms * 1e-3) / 1e9  # a copy reads and writes every byte
    return Peaks(name, args.peak_gbps or gbps, args.peak_tflops or tflops, copy_gbps)


def _decode_case(
    batch: int, ctx: int, heads: int, head_dim: int, peaks: Peaks, iters: int, kv_heads: int | None = None
) -> dict:
    import torch
    import torch.nn.functional as F

    from ringserve.gpu_proc.attention import cupy_backend
    from ringserve.gpu_proc.step import SeqStep, StepBatch
    from ringserve.gpu_proc.step_inputs import build_step_inputs

    kv_heads = kv_heads or heads
    nblocks = ctx // BLOCK
    ids = list(range(batch * nblocks))
    random.Random(0).shuffle(ids)  # scattered blocks, as a long-running pool has
    kc = torch.randn(batch * nblocks, kv_heads, BLOCK, head_dim, dtype=torch.float16, device="cuda")
    vc = torch.randn_like(kc)
    steps = [SeqStep(b, [0], ctx - 1, ids[b * nblocks : (b + 1) * nblocks]) for b in range(batch)]
    meta = build_step_inputs(StepBatch(steps), BLOCK, torch.device("cuda")).meta
    q = torch.randn(batch, heads, head_dim, dtype=torch.float16, device="cuda")
    scale = head_dim**-0.5
    call = lambda: cupy_backend.paged_attention(q, kc, vc, meta, scale)  # noqa: E731
    eager_ms = _time_ms(call, iters)
    graph_ms = _time_graph_ms(call, iters)
    ms = graph_ms if graph_ms is not None else eager_ms  # kernel time without launch gaps
    bytes_read = kv_bytes(batch, ctx, 1, kv_heads, head_dim)
    gbps = bytes_read / (ms * 1e-3) / 1e9
    table = meta.block_tables.long()  # [B, nblocks]
    k = kc[table].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, ctx, head_dim)  # [B, KVH, ctx, D]
    v = vc[table].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, ctx, head_dim)
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # [B, H, ctx, D] for SDPA
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    qd = q.view(batch, heads, 1, head_dim)
    sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale), iters)
    row = dict(
        batch=batch,
        ctx=ctx,
        heads=heads,
        kv_heads=kv_heads,
        ms=ms,
        eager_ms=eager_ms,
        graph_ms=graph_ms,
        gbps=gbps,
        sdpa_ms=sdpa_ms,
        sdpa_gbps=bytes_read / (sdpa_ms * 1e-3) / 1e9,
        pct_peak=100 * gbps / peaks.gbps if peaks.gbps else None,
    )
    return row


def _prefill_case(tokens: int, heads: int, kv_heads: int, head_dim: int, peaks: Peaks, iters: int) -> dict:
    """One prompt of `tokens` through the prefill kernel alone (fp16, tensor cores on sm_80+):
    achieved TFLOP/s of causal attention (4 * heads * head_dim * tokens^2 / 2 FLOPs)."""
    import torch

    from ringserve.gpu_proc.attention import cupy_backend
    from ringserve.gpu_proc.step import SeqStep, StepBatch
    from ringserve.gpu_proc.step_inputs import build_step_inputs

    nblocks = -(-tokens // BLOCK)
    ids = list(range(nblocks))
    random.Random(1).shuffle(ids)
    kc = torch.randn(nblocks, kv_heads, BLOCK, head_dim, dtype=torch.float16, device="cuda")
    vc = torch.randn_like(kc)
    meta = build_step_inputs(StepBatch([SeqStep(0, [0] * tokens, 0, ids)]), BLOCK, torch.device("cuda")).meta
    q = torch.randn(tokens, heads, head_dim, dtype=torch.float16, device="cuda")
    call = lambda: cupy_backend.paged_prefill(q, kc, vc, meta, head_dim**-0.5)  # noqa: E731
    ms = _time_graph_ms(call, iters) or _time_ms(call, iters)
    flops = 4.0 * heads * head_dim * tokens * tokens / 2
    tflops = flops / (ms * 1e-3) / 1e12
    return dict(
        tokens=tokens,
        heads=heads,
        kv_heads=kv_heads,
        ms=ms,
        tflops=tflops,
        pct_peak=100 * tflops / peaks.tflops if peaks.tflops else None,
    )


# (N, K) of Llama-3-8B's projections: q/o, gate (or up), down; rows of x across the GEMV (<= 32)
# and the dequantize + GEMM path.
QUANT_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
QUANT_ROWS = (1, 8, 32, 128)


def _quant_cases(fmts: tuple[str, ...], peaks: Peaks, iters: int) -> list[dict]:
    """The quantized projection (`quant_cuda.QuantKernels.linear`) beside fp16 `F.linear` on the
    dequantized weight: ms, and the GB/s of the block bytes read (the GEMV's bound)."""
    import torch

    from ringserve.gpu_proc import quant_cuda
    from ringserve.gpu_proc.quant import dequantize

    kernels = quant_cuda.default_kernels()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for fmt in fmts:
        kernels.compile([fmt], torch.float16, torch.device("cuda"))
        for n, k in QUANT_SHAPES:
            blocks = quant_cuda.random_blocks(fmt, n, k, gen).cuda()
            dense = dequantize(blocks).half()
            scratch = torch.empty(n * k, dtype=torch.float16, device="cuda")
            for rows in QUANT_ROWS:
                x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
                ms = _time_ms(lambda x=x, b=blocks, s=scratch: kernels.linear(x, b, None, s), iters)
                fp16_ms = _time_ms(lambda x=x, w=dense: torch.nn.functional.linear(x, w), iters)
                gbps = blocks.numel() / ms / 1e6
                cases.append(
                    dict(
                        format=fmt,
                        n=n,
                        k=k,
                        rows=rows,
                        path="gemv" if rows <= quant_cuda.GEMV_MAX_ROWS else "dequantize+gemm",
                        ms=ms,
                        fp16_ms=fp16_ms,
                        speedup=fp16_ms / ms,
                        block_gbps=gbps,
                        pct_peak=100 * gbps / peaks.gbps if peaks.gbps else None,
                    )
                )
            torch.cuda.empty_cache()
    return cases


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _build_7b(layers: int):
    import torch

    from ringserve.gpu_proc.model.dummy_weights import random_model
    from ringserve.gpu_proc.model.llama import ModelArgs

    args = ModelArgs(**{**SEVEN_B, "num_layers": layers})
    return random_model(args, "cuda", torch.float16), args  # fp16 from the start: no fp32 copy


def _model_benches(args_ns, peaks: Peaks) -> tuple[list[dict], dict]:
    import torch

    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.model_runner import ModelRunner
    from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch

    model, margs = _build_7b(args_ns.layers)
    shape = {**SEVEN_B, "num_layers": args_ns.layers}
    ctx, prompt = 1024, args_ns.prompt
    rows = max(args_ns.step_batches)
    pool = KVPool(
        margs.num_layers,
        rows * ctx // BLOCK + prompt // BLOCK + 1,
        margs.num_kv_heads,
        margs.head_dim,
        dtype=torch.float16,
        device="cuda",
    )
    runner = ModelRunner(model, pool)
    greedy = RowSampling(temperature=0.0)
    steps_out = []
    for batch in args_ns.step_batches:
        per = ctx // BLOCK
        batch_steps = StepBatch(
            [SeqStep(b, [1], ctx - 1, list(range(b * per, (b + 1) * per)), greedy) for b in range(batch)]
        )
        inputs = runner.prepare(batch_steps)
        ms = _time_ms(lambda inputs=inputs: runner.forward(inputs), args_ns.iters)
        total_ms = _time_ms(lambda steps=batch_steps: runner.execute(steps), args_ns.iters)
        graph_ms = _time_graph_ms(lambda inputs=inputs: runner.forward(inputs), args_ns.iters)
        moved = dense_weight_bytes(shape) + kv_bytes(batch, ctx, margs.num_layers, margs.num_kv_heads, margs.head_dim)
        bound_ms = moved / (peaks.gbps * 1e9) * 1e3 if peaks.gbps else None
        steps_out.append(
            dict(
                batch=batch,
                ctx=ctx,
                layers=margs.num_layers,
                forward_ms=ms,
                step_ms=total_ms,
                graph_ms=graph_ms,
                bound_ms=bound_ms,
                ratio=ms / bound_ms if bound_ms else None,
            )
        )
    base = rows * ctx // BLOCK
    prefill = StepBatch([SeqStep(0, [1] * prompt, 0, list(range(base, base + math.ceil(prompt / BLOCK))), greedy)])
    inputs = runner.prepare(prefill)
    ms = _time_ms(lambda: runner.forward(inputs), max(3, args_ns.iters // 4))
    flops = prefill_flops(shape, prompt)
    bound_tps = prompt / (flops / (peaks.tflops * 1e12)) if peaks.tflops else None
    prefill_out = dict(
        tokens=prompt,
        layers=margs.num_layers,
        ms=ms,
        tokens_per_s=prompt / (ms * 1e-3),
        tflops=flops / (ms * 1e-3) / 1e12,
        bound_tokens_per_s=bound_tps,
    )
    return steps_out, prefill_out


def _fmt(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ringserve bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--quick", action="store_true", help="fewer cases and a 4-layer model (smoke run)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per case (median reported)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the 7B-shaped model")
    ap.add_argument("--prompt", type=int, default=2048, help="prefill prompt length")
    ap.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak GB/s")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the dense fp16 TFLOP/s")
    ap.add_argument("--skip-model", action="store_true", help="only the attention kernel cases")
    ap.add_argument("--batches", type=_ints, help="decode batches (comma list)")
    ap.add_argument("--contexts", type=_ints, help="decode contexts (comma list)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads of the attention cases (default: 32, MHA)")
    ap.add_argument("--prefill-tokens", type=_ints, default=(), help="prefill-kernel prompt lengths (comma list)")
    ap.add_argument(
        "--quant-formats",
        default="",
        help="GGUF formats of the quantized-projection cases (comma list, e.g. Q4_1,Q8_0)",
    )
    args = ap.parse_args(argv)
    import torch

    try:
        import cupy  # noqa: F401
    except ImportError:
        cupy = None
    if not torch.cuda.is_available() or cupy is None:
        what = "a CUDA device" if not torch.cuda.is_available() else "CuPy (pip install -e .[cuda])"
        print(f"ringserve bench kernels: needs {what}; nothing measured", file=sys.stderr)
        return 2
    batches, ctxs = ((1, 32), (1024,)) if args.quick else ((1, 32, 64, 256), (512, 1024, 4096))
    batches, ctxs = args.batches or batches, args.contexts or ctxs
    kv_heads = args.kv_heads or SEVEN_B["num_kv_heads"]
    if args.quick:
        args.layers, args.iters = min(args.layers, 4), min(args.iters, 5)
    args.step_batches = (1, 32)
    peaks = _measure_peaks(args)
    decode = []
    for b in batches:
        for c in ctxs:
            decode.append(_decode_case(b, c, SEVEN_B["num_heads"], SEVEN_B["head_dim"], peaks, args.iters, kv_heads))
            torch.cuda.empty_cache()  # the 256 x 4k case holds tens of GB; give it back before the next
    prefill_attention = [
        _prefill_case(n, SEVEN_B["num_heads"], kv_heads, SEVEN_B["head_dim"], peaks, args.iters)
        for n in args.prefill_tokens
    ]
    quant = _quant_cases(tuple(f for f in args.quant_formats.split(",") if f), peaks, args.iters)
    steps, prefill = ([], None) if args.skip_model else _model_benches(args, peaks)
    out = dict(
        peaks=asdict(peaks),
        decode_attention=decode,
        prefill_attention=prefill_attention,
        quant_projection=quant,
        decode_step=steps,
        prefill=prefill,
        conditions=dict(
            dtype="float16",
            torch=torch.__version__,
            cupy=cupy.__version__,
            cuda=torch.version.cuda,
            iters=args.iters,
            quick=args.quick,
        ),
    )
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{peaks.device}: peak {_fmt(peaks.gbps, '.0f')} GB/s, {_fmt(peaks.tflops, '.0f')} TFLOP/s fp16; "
        f"measured copy {peaks.copy_gbps:.0f} GB/s"
    )
    print("decode attention (1 layer, 32 heads x 128, fp16)")
    print(
        f"  {'batch':>5} {'ctx':>5} {'ms':>8} {'eager ms':>8} {'GB/s':>7} {'%peak':>6} {'sdpa ms':>8} {'sdpa GB/s':>9}"
    )
    for r in decode:
        print(
            f"  {r['batch']:>5} {r['ctx']:>5} {r['ms']:>8.3f} {r['eager_ms']:>8.3f} {r['gbps']:>7.0f} "
            f"{_fmt(r['pct_peak']):>6} {r['sdpa_ms']:>8.3f} {r['sdpa_gbps']:>9.0f}"
        )
    for r in prefill_attention:
        print(
            f"prefill attention {r['tokens']} tokens (32 heads / {r['kv_heads']} KV heads x 128, fp16): "
            f"{r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s ({_fmt(r['pct_peak'])} % of peak)"
        )
    for r in quant:
        print(
            f"{r['format']} projection {r['n']} x {r['k']}, {r['rows']} rows ({r['path']}): {r['ms']:.3f} ms, "
            f"fp16 {r['fp16_ms']:.3f} ms ({r['speedup']:.2f}x), blocks {r['block_gbps']:.0f} GB/s ({_fmt(r['pct_peak'])} %)"
        )
    for r in steps:
        print(
            f"decode step, {r['layers']} layers, batch {r['batch']} x {r['ctx']}: forward {r['forward_ms']:.2f} ms "
            f"(with host prep {r['step_ms']:.2f} ms, CUDA graph {_fmt(r['graph_ms'], '.2f')} ms), bound {_fmt(r['bound_ms'], '.2f')} ms, "
            f"ratio {_fmt(r['ratio'], '.2f')}"
        )
    if prefill:
        print(
            f"prefill {prefill['tokens']} tokens, {prefill['layers']} layers: {prefill['ms']:.1f} ms, "
            f"{prefill['tokens_per_s']:.0f} tokens/s ({prefill['tflops']:.0f} TFLOP/s), "
            f"FLOP bound {_fmt(prefill['bound_tokens_per_s'], '.0f')} tokens/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
