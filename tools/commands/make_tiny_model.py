"""`ringserve make-tiny-model DIR`: a small Llama checkpoint built in about a second.

The checkpoint is a real Hugging Face Llama directory — `config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` (with a chat template), `generation_config.json` — so the server, the tests and
`transformers.LlamaForCausalLM.from_pretrained` all load it the same way. Weights are random from a
fixed seed; the tokenizer is a byte-level BPE trained with `tokenizers` on the text in
`tools/data/` (English, CJK and emoji, so multi-byte merges exist and incremental detokenizing has
real work to do). The same options always give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
# A chat template in the shape real ones take (turn markers from the special tokens, a refusal for
# a malformed conversation through raise_exception), so the chat route runs on the tiny model too.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.index0 > 0 and message['role'] != 'system' "
    "and message['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{- raise_exception('Conversation roles must alternate: two ' + message['role'] "
    "+ ' messages in a row') }}"
    "{%- endif %}"
    "{{- bos_token + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- bos_token + 'assistant\n' }}{%- endif %}"
)
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """The shape of the tiny model. Defaults keep one CPU step to about a millisecond."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 352
    vocab_target: int = 2048  # BPE stops earlier when the text has no more frequent pairs
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head_dim (hidden_size / num_heads) must be even for rotary embeddings")
        if self.vocab_target < 300:
            raise ValueError(f"vocab_target must be >= 300 (256 bytes + specials + merges), got {self.vocab_target}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def train_tokenizer(vocab_target: int):
    """A byte-level BPE over the shipped text, with BOS prepended by the post-processor (as
    Llama 3's tokenizer does) and the byte-level decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen or not
    )
    files = sorted(str(p) for p in DATA_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no training text in {DATA_DIR}; the package data is missing")
    tokenizer.train(files, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def make_weights(spec: TinyModelSpec, vocab_size: int) -> dict:
    """Random weights named as in Hugging Face Llama checkpoints.

    Scales are chosen so the model is far from uniform: embeddings with unit variance and
    projections at 1/sqrt(fan_in) keep activations O(1), and the head gets a larger gain so logits
    spread over several units. Greedy decoding then wanders through the vocabulary instead of
    repeating one token, and argmax ties between implementations are practically impossible.
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    def norm_weight() -> torch.Tensor:
        # Not all ones: a loader that drops norm weights must change the outputs.
        return (1.0 + 0.1 * torch.randn(h, generator=gen)).contiguous()

    weights = {"model.embed_tokens.weight": normal(vocab_size, h, std=1.0)}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm_weight()
        weights[p + "self_attn.q_proj.weight"] = normal(spec.num_heads * d, h, std=1.5 / math.sqrt(h))
        weights[p + "self_attn.k_proj.weight"] = normal(spec.num_kv_heads * d, h, std=1.5 / math.sqrt(h))
        weights[p + "self_attn.v_proj.weight"] = normal(spec.num_kv_heads * d, h, std=1.0 / math.sqrt(h))
        weights[p + "self_attn.o_proj.weight"] = normal(h, spec.num_heads * d, std=1.0 / math.sqrt(h))
        weights[p + "post_attention_layernorm.weight"] = norm_weight()
        weights[p + "mlp.gate_proj.weight"] = normal(i, h, std=1.0 / math.sqrt(h))
        weights[p + "mlp.up_proj.weight"] = normal(i, h, std=1.0 / math.sqrt(h))
        weights[p + "mlp.down_proj.weight"] = normal(h, i, std=1.0 / math.sqrt(i))
    weights["model.norm.weight"] = norm_weight()
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(vocab_size, h, std=4.0 / math.sqrt(h))
    return weights


def hf_config(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(out: Path, tokenizer, max_length: int, chat_template: str | None = None) -> tuple[int, int]:
    """Save `tokenizer` (one of `train_tokenizer`'s) into `out` with its tokenizer_config.json and
    special_tokens_map.json; returns its (BOS, EOS) ids."""
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
    return tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)


def build_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None) -> Path:
    """Write the checkpoint into `out_dir` (created if missing) and return its path."""
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(spec.vocab_target)
    vocab_size = tokenizer.get_vocab_size()
    bos_id, eos_id = write_tokenizer(out, tokenizer, spec.max_position_embeddings, CHAT_TEMPLATE)
    _write_json(out / "config.json", hf_config(spec, vocab_size, bos_id, eos_id))
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    save_file(make_weights(spec, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _parser() -> argparse.ArgumentParser:
    d = TinyModelSpec()
    p = argparse.ArgumentParser(prog="ringserve make-tiny-model", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="output directory (created if missing; existing files are replaced)")
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--vocab", type=int, default=d.vocab_target, help="BPE vocabulary target")
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--rope-theta", type=float, default=d.rope_theta)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = TinyModelSpec(
            num_layers=args.layers,
            hidden_size=args.hidden_size,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            vocab_target=args.vocab,
            max_position_embeddings=args.max_position_embeddings,
            rope_theta=args.rope_theta,
            tie_word_embeddings=args.tie_word_embeddings,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"ringserve make-tiny-model: {e}", file=sys.stderr)
        return 2
    out = build_tiny_model(args.dir, spec)
    print(f"wrote tiny Llama checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
