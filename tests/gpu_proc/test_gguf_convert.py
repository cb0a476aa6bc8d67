"""GGUF files: converted once into a checkpoint that equals the original, refused with what they are
when they are not a Llama, served by `ringserve serve --model FILE.gguf`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ringserve import models
from ringserve.gpu_proc.model.gguf_convert import GgufError, check_architecture, convert_gguf
from tests.helpers.gguf_files import write_llama_gguf
from tests.helpers.net import http_json
from tests.helpers.server import ServerProcess

TEXTS = ["Hello world", "今天天气很好 🙂", "  two  spaces\n\nand lines", "<|end_of_text|> after a special"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """The tiny model written as llama.cpp writes a Llama GGUF (float32 tensors)."""
    return write_llama_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf")


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """A private XDG_CACHE_HOME, shared by this module's CLI and server tests."""
    return tmp_path_factory.mktemp("cache")


def test_conversion_gives_back_the_checkpoint(tiny_model_dir, tiny_gguf, tmp_path):
    """Every tensor equal (q/k rows un-permuted), the same token ids, the chat template and the
    config fields the loader reads; the marker is written."""
    from tokenizers import Tokenizer

    out = convert_gguf(tiny_gguf, tmp_path / "converted", say=lambda _: None)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(converted[name], t), name
    a = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    b = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert [a.encode(t).ids for t in TEXTS] == [b.encode(t).ids for t in TEXTS]
    tok_a = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    tok_b = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_b["chat_template"] == tok_a["chat_template"]
    assert (tok_b["bos_token"], tok_b["eos_token"]) == (tok_a["bos_token"], tok_a["eos_token"])
    cfg_a = json.loads((tiny_model_dir / "config.json").read_text())
    cfg_b = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
    ):
        assert cfg_b[key] == cfg_a[key], key
    assert cfg_b["rms_norm_eps"] == pytest.approx(cfg_a["rms_norm_eps"])
    assert cfg_b["rope_parameters"]["rope_theta"] == cfg_a["rope_theta"]
    assert cfg_b["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg_b
    assert models.is_converted(out)


def test_bfloat16_storage_on_request(tiny_gguf, tmp_path):
    out = convert_gguf(tiny_gguf, tmp_path / "bf16", dtype="bfloat16", say=lambda _: None)
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_other_architecture_is_refused_naming_it(tmp_path):
    """A GGUF of another architecture fails at once, naming the architecture and the model."""
    import gguf

    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_name("some encoder")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GgufError, match="architecture 'bert' \\(some encoder\\).*'llama'"):
        convert_gguf(path, tmp_path / "out", say=lambda _: None)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [path]


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(GgufError, match="not a GGUF file"):
        check_architecture(path)


def _fetch(path, cache_home) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    return subprocess.run(
        [sys.executable, "-m", "ringserve", "fetch-model", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_fetch_model_converts_a_gguf_once(tiny_gguf, cache_home, monkeypatch):
    """`ringserve fetch-model FILE.gguf` prints the cache directory `--model FILE.gguf` serves;
    a second call finds it and converts nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    first = _fetch(tiny_gguf, cache_home)
    assert first.returncode == 0, first.stderr
    expected = models.resolve(str(tiny_gguf)).directory
    assert first.stdout.strip().splitlines()[-1] == str(expected) and models.is_converted(expected)
    assert "converting" in first.stderr
    second = _fetch(tiny_gguf, cache_home)
    assert second.returncode == 0 and second.stdout.strip() == str(expected)
    assert "converting" not in second.stderr


def test_serve_a_gguf_file(tiny_gguf, cache_home, tmp_path, monkeypatch):
    """`ringserve serve --model FILE.gguf` serves the converted model under the file's name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    with ServerProcess(tiny_gguf, tmp_path / "shm", workers=1) as srv:
        status, body, _ = http_json(srv.url + "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "tiny-chat"
        status, body, _ = http_json(
            srv.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body


def test_a_changed_file_is_a_new_cache_entry(tiny_gguf, tmp_path, monkeypatch):
    """The cache key follows the file: a new mtime (or another stored dtype) is another directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "copy.gguf"
    path.write_bytes(tiny_gguf.read_bytes())
    before = models.resolve(str(path)).directory
    assert models.resolve(str(path)).directory == before
    assert models.resolve(str(path), "bfloat16").directory != before
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert models.resolve(str(path)).directory != before
