"""`ringserve make-dummy-model SHAPE DIR`: a checkpoint directory without weights, for
`ringserve serve --model DIR --load-format dummy` (random weights of the shape, made on the device).

SHAPE is a shipped shape (`llama-3-8b`, `llama-2-7b`: the architecture numbers of those models'
config.json files) or a path to any config.json. The directory gets that config.json, a
generation_config.json with its BOS/EOS ids, and the tiny model's byte-level BPE tokenizer (trained
on text shipped in the repository) padded with `<|dummy_N|>` tokens to the model's vocabulary, so
every sampled id decodes. No file is fetched from anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ringserve.tools.commands.make_tiny_model import _write_json, train_tokenizer, write_tokenizer

SHAPES_DIR = Path(__file__).resolve().parents[1] / "data" / "shapes"
TOKENIZER_VOCAB = 2048  # BPE merges learned from the shipped text; the rest of the vocabulary is padding


def shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def shape_config(shape: str) -> dict:
    """The config.json dict of a shipped shape name or a path to a config.json."""
    path = SHAPES_DIR / f"{shape}.json"
    if not path.is_file():
        path = Path(shape)
    if not path.is_file():
        raise ValueError(f"unknown shape {shape!r}: use one of {', '.join(shapes())} or a path to a config.json")
    return json.loads(path.read_text(encoding="utf-8"))


def build_dummy_model(shape: str, out_dir: str | os.PathLike) -> Path:
    """Write config.json, generation_config.json and a tokenizer covering the vocabulary."""
    from tokenizers import AddedToken

    cfg = shape_config(shape)
    vocab = int(cfg["vocab_size"])
    tokenizer = train_tokenizer(min(TOKENIZER_VOCAB, vocab))
    base = tokenizer.get_vocab_size()
    if base > vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the dummy tokenizer's {base} tokens")
    tokenizer.add_tokens([AddedToken(f"<|dummy_{i}|>", special=False) for i in range(base, vocab)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(out, tokenizer, cfg.get("max_position_embeddings", 8192))
    cfg = {**cfg, "bos_token_id": bos, "eos_token_id": eos}
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve make-dummy-model", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", help=f"one of {', '.join(shapes())}, or a path to a config.json")
    p.add_argument("dir", help="output directory (created if missing)")
    args = p.parse_args(argv)
    try:
        out = build_dummy_model(args.shape, args.dir)
    except (ValueError, KeyError) as e:
        print(f"ringserve make-dummy-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote a weightless {args.shape} checkpoint to {out}; serve it with --load-format dummy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
