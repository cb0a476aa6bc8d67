"""What `ringserve bench peers` sends, and what a token costs: prompts of a stated token length,
the prompt-copying workload, the model's useful FLOPs per token and the core's GEMM peak.

Prompts are token ids, so both engines see exactly the same input whatever their tokenizers or
chat templates do: `text` cuts windows of `--prompt-tokens` tokens from the English texts in
`tools/data/` (a different window per request), `copy` asks the model in its own chat format
to repeat a passage of `--copy-tokens` tokens (what n-gram speculation is for: the answer is in
the prompt), `random` is random ids (every prompt different), as the bench sent before.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
COPY_INSTRUCTION = "Repeat the following text exactly, word for word, and say nothing else.\n\n"


def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def _text_ids(tok) -> list[int]:
    """The English texts shipped in tools/data, as one long id list (no special tokens)."""
    text = "\n\n".join((DATA / name).read_text() for name in ("english.txt", "serving_design.txt"))
    return tok.encode(text, add_special_tokens=False).ids


def text_prompts(model_dir: str, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` windows of exactly `length` tokens of real text, at seeded offsets (all different
    while the text is long enough)."""
    ids = _text_ids(_tokenizer(model_dir))
    if len(ids) <= length:
        raise ValueError(f"the texts in {DATA} hold {len(ids)} tokens, fewer than --prompt-tokens {length}")
    rng = random.Random(seed)
    starts = rng.sample(range(len(ids) - length), min(n, len(ids) - length))
    while len(starts) < n:
        starts.append(rng.randrange(len(ids) - length))
    return [ids[s : s + length] for s in starts]


def copy_prompts(model_dir: str, n: int, passage_tokens: int, seed: int) -> list[list[int]]:
    """`n` requests to repeat a passage of `passage_tokens` tokens, each its own passage, in the
    model's ChatML form when its tokenizer has the markers (SmolLM2), else as plain text."""
    tok = _tokenizer(model_dir)
    passages = text_prompts(model_dir, n, passage_tokens, seed)
    chatml = tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None
    head = tok.encode(("<|im_start|>user\n" if chatml else "") + COPY_INSTRUCTION, add_special_tokens=False).ids
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n" if chatml else "\n\n", add_special_tokens=False).ids
    return [head + p + tail for p in passages]


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` different prompts of `length` random ids (above the usual special ids 0-2)."""
    rng = random.Random(seed)
    hi = max(4, vocab)
    return [[rng.randrange(3, hi) for _ in range(length)] for _ in range(n)]


def flops_per_token(model_dir: str) -> tuple[float, float]:
    """(FLOPs of the dense layers per token fed, FLOPs of the LM head per token sampled): 2 per
    weight of each matmul. Attention's own FLOPs (a few percent at these lengths) are left out."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads) * cfg.get("head_dim", h // heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter  # q, o; k, v; gate, up, down
    return 2.0 * layers * per_layer, 2.0 * h * cfg["vocab_size"]


GEMM_SHAPES = ((256, 576, 1536), (2048, 576, 1536))  # (m, k, n): SmolLM2's hidden size and MLP width


def _best_s(fn, seconds: float) -> float:
    for _ in range(3):
        fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            fn()
        best = min(best, (time.perf_counter() - t0) / 4)
    return best


def gemm_peak_gflops(dtype: str, seconds: float = 0.7) -> dict[str, float]:
    """One thread's matmul rate on this core in `dtype`, GFLOP/s, per shape of `GEMM_SHAPES`:
    `torch.matmul`, and oneDNN with the weight packed once (what ringserve's CPU path and vLLM's
    CPU linear layers run; about twice torch.matmul's rate on AVX-512), and their best as `peak`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    try:
        dt = getattr(torch, dtype)
        for m, k, n in GEMM_SHAPES:
            x, w = torch.randn(m, k, dtype=dt), torch.randn(n, k, dtype=dt)
            flop = 2.0 * m * k * n
            out[f"matmul {m}x{k}x{n}"] = round(flop / _best_s(lambda x=x, w=w: x @ w.t(), seconds) / 1e9, 1)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                run = lambda x=x, p=packed, f=torch.ops.mkldnn._linear_pointwise: f(x, p, None, "none", [], "")  # noqa: E731
                out[f"onednn {m}x{k}x{n}"] = round(flop / _best_s(run, seconds) / 1e9, 1)
            except (AttributeError, RuntimeError):  # a torch without oneDNN: matmul is the peak
                pass
    finally:
        torch.set_num_threads(threads)
    out["peak"] = max(out.values())
    return out
