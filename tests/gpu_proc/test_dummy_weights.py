"""`--load-format dummy`: random weights of a checkpoint's shape, no weight files, and the shipped
Llama-3-8B / Llama-2-7B shapes with their weightless checkpoint directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ringserve.config import Config, ConfigError
from ringserve.gpu_proc.model.llama import Llama
from ringserve.gpu_proc.model.loader import CheckpointError, load_model, model_args_from_config, read_special_tokens
from ringserve.tools.commands.make_dummy_model import build_dummy_model, shape_config


def _weightless_copy(model_dir, tmp_path):
    out = tmp_path / "weightless"
    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    return out


def test_dummy_load_needs_no_weight_files(tiny_model_dir, tmp_path):
    """Without safetensors the normal load fails; the dummy load builds the model and it runs."""
    d = _weightless_copy(tiny_model_dir, tmp_path)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d, "cpu", "float32")
    model = load_model(d, "cpu", "float32", load_format="dummy")
    assert model.model.norm.weight.eq(1).all()
    assert 0.015 < model.model.layers[0].mlp.up_proj.weight.std().item() < 0.025
    again = load_model(d, "cpu", "float32", load_format="dummy")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded: the same weights every load


def test_dummy_engine_serves_a_step(tiny_model_dir, tmp_path):
    """The engine builds (and warms up) on dummy weights from the config's load_format."""
    from ringserve.gpu_proc.executor import build_executor
    from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch

    d = _weightless_copy(tiny_model_dir, tmp_path)
    engine = build_executor(Config(device="cpu", dtype="float32", num_blocks=16, load_format="dummy"), d)
    out = engine.step(StepBatch([SeqStep(0, [5, 6, 7], 0, [3], RowSampling(temperature=0.0))]))
    assert len(out.token_ids) == 1 and 0 <= out.token_ids[0] < engine.vocab_size


@pytest.mark.parametrize(
    "shape,params,kv_heads,vocab", [("llama-3-8b", 8.03e9, 8, 128256), ("llama-2-7b", 6.74e9, 32, 32000)]
)
def test_shipped_shapes_are_the_real_models_shapes(shape, params, kv_heads, vocab):
    """The shipped configs describe 8.03B / 6.74B-parameter models with the published head layout."""
    args = model_args_from_config(shape_config(shape), shape)
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(args).parameters())
    assert abs(n - params) / params < 0.005
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim, args.vocab_size) == (
        32,
        32,
        kv_heads,
        128,
        vocab,
    )


def test_make_dummy_model_tokenizer_covers_the_vocabulary(tmp_path):
    """Every id the model can sample decodes; BOS/EOS are the tokenizer's own."""
    from tokenizers import Tokenizer

    d = build_dummy_model("llama-2-7b", tmp_path / "l2")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == json.loads((d / "config.json").read_text())["vocab_size"] == 32000
    assert tok.decode([31999]) != ""
    special = read_special_tokens(d)
    assert special.eos_token_ids == {tok.token_to_id("<|end_of_text|>")}
    assert not list(d.glob("*.safetensors"))


def test_load_format_is_validated():
    assert Config(load_format="dummy").load_format == "dummy"
    with pytest.raises(ConfigError, match="load_format must be auto or dummy"):
        Config(load_format="gguf-ish")
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("llama-9-1t")
