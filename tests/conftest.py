"""Session-wide fixtures and the `gpu` marker's skip rule."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI runs the property and fuzz tests derandomized: the same examples every run, so a red CI means
# the change broke something, not that a new random example turned up an old bug. Developers'
# runs explore new examples each time (RINGSERVE_HYPOTHESIS_PROFILE=ci reproduces CI locally).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI") or os.environ.get("RINGSERVE_HYPOTHESIS_PROFILE") == "ci":
    settings.load_profile("ci")

# CI and dev machines here are small and shared: several OpenMP threads per torch process fighting
# over two cores make tiny CPU model steps 10-30x slower (workers spin at every barrier). One
# thread per process, set before anything imports torch; child processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Llama checkpoint (grouped-query: 4 heads, 2 KV heads), built once per session.

    A `pathlib.Path` to a Hugging Face checkpoint directory; treat it as read-only.
    """
    from ringserve.tools.commands.make_tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_mha_model_dir(tmp_path_factory):
    """A multi-head variant of the tiny model (4 heads, 4 KV heads, 2 layers), built once per session."""
    from ringserve.tools.commands.make_tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_layers=2, num_kv_heads=4, seed=1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mha-model"), spec)


@pytest.fixture(scope="session")
def mid_model_dir(tmp_path_factory):
    """A mid-size random Llama (6 layers, hidden 384, GQA 6/2): CPU steps of tens of ms at 32 rows,
    closer to a real model's than the tiny one's, for admission and scheduling tests."""
    from ringserve.tools.commands.make_tiny_model import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2, intermediate_size=1024, seed=2)
    return build_tiny_model(tmp_path_factory.mktemp("mid-model"), spec)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a checkpoint directory (`pathlib.Path`; treat it as read-only).

    The real pretrained model: fetched and converted once per machine into ~/.cache/ringserve
    (`ringserve fetch-model smollm2-135m-instruct`; its progress shows in the test output), then
    reused by every session. A failed fetch fails the test with the reason; it is never a skip,
    so CI without the model is red, not silently weaker.
    """
    from ringserve import models

    try:
        return models.ensure(models.DEFAULT_MODEL).directory
    except models.ModelError as exc:
        pytest.fail(f"SmolLM2-135M-Instruct is not available: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir):
    """The GGUF file SmolLM2 was converted from (`pathlib.Path`, read-only): the reference that
    transformers loads in the parity tests."""
    from ringserve import models
    from ringserve.tools.commands.fetch_model import fetch_gguf

    try:
        return fetch_gguf(models.DEFAULT_MODEL)
    except models.ModelError as exc:
        pytest.fail(f"the SmolLM2 GGUF is not available: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir, tmp_path_factory):
    """`ringserve serve --model smollm2-135m-instruct` (the name, resolved as `make serve` does),
    one for every module that talks to the real model, with `--quantization none` because these
    modules compare with transformers: the weights dequantized. The default (`auto`) serves the
    GGUF blocks as they are, which differ by their int8 activations (tests/test_quant_e2e.py;
    the marker, fairness and admission tests serve them)."""
    from ringserve import models
    from tests.helpers.server import ServerProcess

    # queue_limit_s: 200 requests at once are far above 2 s of estimated CPU work; admission
    # would rightly answer 429, which is not what these tests are about.
    with ServerProcess(
        models.DEFAULT_MODEL,
        tmp_path_factory.mktemp("smollm2-shm"),
        workers=2,
        queue_limit_s=600,
        ready_timeout_s=300,
        quantization="none",
    ) as srv:
        yield srv


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' SmolLM2, loaded by its own GGUF loader from the file the server's checkpoint
    was converted from: the reference for tokens and logprobs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name).eval()
