"""`ringserve bench quant [--json]`: GGUF files served from their blocks (`--quantization auto`)
against the same weights dequantized (`none`, the reference), per file: what is served, its memory
against the file's tensor bytes, and how far the int8-activation kernels move the model.

For each file (converted once, as `ringserve serve --model FILE.gguf` does): the formats served
(and those transcoded from others), the weights' bytes / the GGUF's tensor bytes (bound 1.25x),
the loglikelihood of the first `--tokens` tokens of a held text (tools/data/english.txt) in one
prefill, both ways (bound: within 1 % when every served tensor is Q8_0, 3 % otherwise), the
largest logit error over the first 256 positions and how often the top-1 token agrees, and for a
few greedy prompts how many tokens equal the reference's before the first difference (reported,
not gated: the int8 activations move near-ties, as llama.cpp's do). Exits 1 when a bound fails.
One torch thread, the CPU; nothing is served over the network.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "data" / "english.txt"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:")
MEMORY_BOUND = 1.25
LOGLIK_BOUND_Q8_0, LOGLIK_BOUND = 0.01, 0.03  # every served tensor Q8_0; otherwise


def measure(path: str, tokens: int, greedy_tokens: int) -> dict:
    import gguf
    import torch
    from tokenizers import Tokenizer

    from ringserve import models
    from ringserve.config import Config
    from ringserve.gpu_proc.executor import served_kv_dtype, weights_bytes
    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.model.loader import load_model
    from ringserve.gpu_proc.model_runner import ModelRunner
    from ringserve.gpu_proc.offline import GREEDY, OfflineRequest, generate, loglikelihood, prefill_logits

    directory = models.ensure(path).directory
    codec = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = codec.encode(TEXT.read_text()).ids[:tokens]
    runners, loaded = {}, {}
    for mode in ("auto", "none"):
        loaded[mode] = model = load_model(directory, "cpu", quantization=mode)
        a = model.args
        # the blocks with the cache a server gives them; the reference float32 throughout
        pool = KVPool(
            a.num_layers, tokens // 16 + 64, a.num_kv_heads, a.head_dim, dtype=served_kv_dtype(Config(), model)
        )
        runners[mode] = ModelRunner(model, pool)
    served = loaded["auto"].weights_served()
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    held = weights_bytes(loaded["auto"])
    lq, lr = (loglikelihood(runners[m], ids) for m in ("auto", "none"))
    bound = LOGLIK_BOUND_Q8_0 if set(served.get("formats", {})) == {"Q8_0"} else LOGLIK_BOUND
    head = ids[:256]
    with torch.inference_mode():
        lq_logits, lr_logits = (prefill_logits(runners[m], head).float() for m in ("auto", "none"))
    reqs = [OfflineRequest(prompt_ids=codec.encode(p).ids, max_tokens=greedy_tokens, sampling=GREEDY) for p in PROMPTS]
    got, ref = ([r.token_ids for r in generate(runners[m], reqs, eos_token_ids=frozenset())] for m in ("auto", "none"))
    equal = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g)) for g, r in zip(got, ref)]
    out = {
        "file": str(path),
        "served": served,
        "kv_cache_dtype": str(runners["auto"].kv_pool.dtype).removeprefix("torch."),
        "weights_bytes": held,
        "tensor_bytes": tensor_bytes,
        "memory_ratio": round(held / tensor_bytes, 3),
        "loglikelihood": {"blocks": round(lq, 2), "dequantized": round(lr, 2), "tokens": len(ids)},
        "loglikelihood_change": round((lq - lr) / abs(lr), 5),
        "loglikelihood_bound": bound,
        "logits_max_abs_error": round((lq_logits - lr_logits).abs().max().item(), 4),
        "logits_max_abs": round(lr_logits.abs().max().item(), 3),
        "top1_agreement": round((lq_logits.argmax(-1) == lr_logits.argmax(-1)).float().mean().item(), 4),
        "greedy_equal_before_first_difference": equal,
        "greedy_tokens": greedy_tokens,
    }
    out["ok"] = out["memory_ratio"] <= MEMORY_BOUND and abs(out["loglikelihood_change"]) <= bound
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench quant", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="", help="comma-separated .gguf files (default: the default model's)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the held text scored")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    import torch

    from ringserve.gpu_proc.cpu_ext import load_cpu_ops

    torch.set_num_threads(1)
    load_cpu_ops()
    paths = [m for m in args.models.split(",") if m] or [_default_gguf()]
    results = [measure(path, args.tokens, args.greedy_tokens) for path in paths]
    if args.json:
        print(json.dumps({"files": results, "ok": all(r["ok"] for r in results)}, indent=2))
    else:
        for r in results:
            f = r["served"].get("formats", {})
            print(
                f"{Path(r['file']).name}: {f} (transcoded {r['served'].get('transcoded_from', {})}); "
                f"memory {r['memory_ratio']}x the tensor bytes; loglikelihood {r['loglikelihood_change']:+.2%} "
                f"(bound {r['loglikelihood_bound']:.0%}); logits max error {r['logits_max_abs_error']} of "
                f"{r['logits_max_abs']}; top-1 {r['top1_agreement']:.1%}; greedy equal "
                f"{r['greedy_equal_before_first_difference']} of {r['greedy_tokens']}; {'ok' if r['ok'] else 'FAILED'}"
            )
    return 0 if all(r["ok"] for r in results) else 1


def _default_gguf() -> str:
    from ringserve import models
    from ringserve.tools.commands.fetch_model import fetch_gguf

    return str(fetch_gguf(models.DEFAULT_MODEL))


if __name__ == "__main__":
    sys.exit(main())
