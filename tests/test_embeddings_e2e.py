"""/v1/embeddings against the real engine: SmolLM2's last-token embeddings (the session's server)
equal transformers' final hidden states, pooled and normalized, to 1e-4 (cosine >= 0.9999) through
the openai SDK, LangChain's `OpenAIEmbeddings` and litellm's `embedding`; alone and from the prefix
cache within 1e-5 of the batch (the rows a step holds change a GEMM's blocking, so its rounding, on
some CPUs: an AMX box's oneDNN differs in the 7th digit), and bit-identical when the same request
comes again. Mean pooling on the tiny model (a server of its own, with
prefill chunks of 16 tokens so a prompt pools over several steps) equals transformers' mean, and a
repeated prompt (whose blocks are cached) pools every position again.

Nothing here reaches the network: LangChain's token-length check (tiktoken's vocabulary, fetched
from the internet) is off, as it has to be for any server whose model is not OpenAI's."""

from __future__ import annotations

import os

import numpy as np
import openai
import pytest

from tests.helpers.server import ServerProcess

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

MODEL = "smollm2-135m-instruct"
TEXTS = [
    "hello world",
    "The history of the lighthouse begins in antiquity. " * 20,  # a few hundred tokens
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]


def _reference(hf_model, ids: list[int], pooling: str) -> np.ndarray:
    """transformers' pooled, normalized final hidden state (the base model's output, after the norm)."""
    import torch

    with torch.no_grad():
        h = hf_model(torch.tensor([ids])).last_hidden_state[0].double()
    v = h[-1] if pooling == "last" else h.mean(0)
    return (v / v.norm()).numpy()


def _close(got, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    cosine = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
    assert np.abs(got - want).max() <= 1e-4 and cosine >= 0.9999, (np.abs(got - want).max(), cosine)


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_dir) -> list[list[int]]:
    from ringserve.api.tokenizer import TextCodec

    codec = TextCodec.from_dir(smollm2_dir)
    return [codec.encode(t, True) for t in TEXTS]


def test_openai_sdk_equals_transformers_alone_in_a_batch_and_cached(smollm2_server, smollm2_hf, smollm2_ids):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # base64, as the SDK asks by default
    assert batch.usage.prompt_tokens == sum(map(len, smollm2_ids))
    for d, ids in zip(batch.data, smollm2_ids):
        assert len(d.embedding) == smollm2_hf.config.hidden_size
        _close(d.embedding, _reference(smollm2_hf.model, ids, "last"))
    for text, d in zip(TEXTS, batch.data):  # alone, after the batch: its prompt blocks are cached
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert np.abs(np.subtract(alone.data[0].embedding, d.embedding)).max() <= 1e-5
    ids = client.embeddings.create(model=MODEL, input=smollm2_ids[2], encoding_format="float")
    assert ids.data[0].embedding == alone.data[0].embedding  # the same prompt, cached the same way


def test_langchain_and_litellm(smollm2_server, smollm2_hf, smollm2_ids):
    import litellm
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model=MODEL,
        base_url=smollm2_server.url + "/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # else it tokenizes with tiktoken (OpenAI's vocabulary)
        max_retries=0,
    )
    docs = emb.embed_documents(TEXTS[:2])
    query = emb.embed_query(TEXTS[2])
    for got, ids in zip([*docs, query], smollm2_ids):
        _close(got, _reference(smollm2_hf.model, ids, "last"))
    litellm.telemetry = False
    out = litellm.embedding(
        model=f"openai/{MODEL}", input=TEXTS[:1], api_base=smollm2_server.url + "/v1", api_key="unused"
    )
    _close(out.data[0]["embedding"], _reference(smollm2_hf.model, smollm2_ids[0], "last"))
    assert out.usage.prompt_tokens == len(smollm2_ids[0])


def test_mean_pooling_over_chunks_and_cached_blocks(tiny_model_dir, tmp_path):
    from transformers import AutoModel

    from ringserve.api.tokenizer import TextCodec

    hf = AutoModel.from_pretrained(str(tiny_model_dir), dtype="float32").eval()
    codec = TextCodec.from_dir(tiny_model_dir)
    texts = ["a short one", "river stone light morning market garden quiet letter " * 8]
    with ServerProcess(
        tiny_model_dir, tmp_path / "shm", workers=1, embedding_pooling="mean", prefill_budget=16, dtype="float32"
    ) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        first = client.embeddings.create(model=str(tiny_model_dir), input=texts, encoding_format="float")
        again = client.embeddings.create(model=str(tiny_model_dir), input=texts[1], encoding_format="float")
    ids = [codec.encode(t, True) for t in texts]
    assert len(ids[1]) > 3 * 16  # pooled over several prefill chunks
    for d, tids in zip(first.data, ids):
        _close(d.embedding, _reference(hf, tids, "mean"))
    # the same positions pooled again, not the cached ones skipped
    assert np.abs(np.array(again.data[0].embedding) - np.array(first.data[1].embedding)).max() < 1e-6
