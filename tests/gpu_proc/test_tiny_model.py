"""The tiny checkpoint that `ringserve make-tiny-model` builds for the server and the tests."""

from __future__ import annotations

import json

import pytest

from ringserve.tools.commands.make_tiny_model import BOS_TOKEN, EOS_TOKEN, TinyModelSpec, build_tiny_model, main


def _tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_checkpoint_has_every_file(tiny_model_dir):
    """The directory is a complete Hugging Face Llama checkpoint."""
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny_model_dir / name).is_file(), name
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["max_position_embeddings"] == 8192


def test_vocab_matches_tokenizer_and_special_tokens(tiny_model_dir):
    """The model's vocabulary is the tokenizer's, with BOS and EOS ids agreeing across files."""
    tok = _tokenizer(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert 1000 <= cfg["vocab_size"] == tok.get_vocab_size() <= 2048
    assert cfg["bos_token_id"] == tok.token_to_id(BOS_TOKEN)
    assert cfg["eos_token_id"] == tok.token_to_id(EOS_TOKEN)
    tcfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"]) == (BOS_TOKEN, EOS_TOKEN)


def test_tokenizer_round_trips_multibyte_text_with_bos(tiny_model_dir):
    """Encoding prepends BOS; decoding CJK, emoji and accents gives the text back exactly."""
    tok = _tokenizer(tiny_model_dir)
    text = "Hello, 世界! 今天天气很好 🙂🎉 café — naïve"
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id(BOS_TOKEN)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_bpe_learned_multibyte_merges(tiny_model_dir):
    """Common CJK text takes fewer tokens than bytes, so some tokens span whole characters."""
    tok = _tokenizer(tiny_model_dir)
    text = "今天天气很好，我们一起去公园散步吧。"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) < len(text.encode("utf-8")) // 2


def test_build_is_deterministic(tmp_path):
    """The same options give byte-identical files."""
    spec = TinyModelSpec(num_layers=1, hidden_size=64, intermediate_size=128, vocab_target=600)
    a, b = build_tiny_model(tmp_path / "a", spec), build_tiny_model(tmp_path / "b", spec)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_transformers_loads_it_and_greedy_does_not_loop(tiny_model_dir):
    """transformers loads the checkpoint, and greedy decoding visits many distinct tokens."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = _tokenizer(tiny_model_dir).encode("The lighthouse keeper climbed the tower").ids
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=32,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    new = out[0, len(ids) :].tolist()
    assert len(set(new)) >= 16


def test_cli_options_shape_the_model(tmp_path, capsys):
    """Layer, head and size options reach config.json; invalid shapes exit 2 with a message."""
    out = tmp_path / "m"
    assert (
        main(
            [
                str(out),
                "--layers",
                "1",
                "--hidden-size",
                "64",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--intermediate-size",
                "96",
                "--vocab",
                "500",
                "--tie-word-embeddings",
            ]
        )
        == 0
    )
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["tie_word_embeddings"],
    ) == (1, 64, 2, 1, True)
    assert main([str(tmp_path / "bad"), "--heads", "3", "--kv-heads", "2"]) == 2
    assert "multiple" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{"num_heads": 0}, {"hidden_size": 100, "num_heads": 3}, {"vocab_target": 10}])
def test_spec_rejects_bad_shapes(kwargs):
    """Impossible shapes are refused at construction."""
    with pytest.raises(ValueError):
        TinyModelSpec(**kwargs)
