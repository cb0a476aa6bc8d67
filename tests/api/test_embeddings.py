"""POST /v1/embeddings on the fake GPU (whose hidden states are `fake_hidden` of each token id):
the openai SDK's float and base64 encodings, batches of strings and of token ids, what a pooling
Submit carries, normalization, usage, and the errors (dimensions, empty input, context, bad ids)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from ringserve.api.fake_gpu import FAKE_HIDDEN_SIZE, fake_hidden
from tests.helpers.fake_api import MODEL

pytestmark = pytest.mark.asyncio


def _expected(ids: list[int], pooling: str = "last", normalize: bool = True) -> np.ndarray:
    rows = np.array([fake_hidden(t) for t in (ids if pooling == "mean" else ids[-1:])], dtype=np.float32)
    v = rows.astype(np.float64).sum(0) / len(rows)
    return v / np.linalg.norm(v) if normalize else v


async def _openai(serve, **config):
    served = await serve(app_kw={"embedding_dims": FAKE_HIDDEN_SIZE}, **config)
    client = openai.AsyncOpenAI(base_url=str(served.client.make_url("/v1")), api_key="k", max_retries=0)
    return served, client


@pytest.mark.parametrize("pooling", ["last", "mean"])
async def test_openai_sdk_embeds_a_batch_as_the_gpu_pooled_it(serve, codec, pooling):
    served, client = await _openai(serve, embedding_pooling=pooling)
    texts = ["hello world", "a second, longer input text"]
    out = await client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    ids = [codec.encode(t, True) for t in texts]
    assert [s.prompt_ids for s in served.fake.submits] == ids
    assert all(s.pooling == pooling and s.max_tokens == 1 and s.n == 1 for s in served.fake.submits)
    assert [d.index for d in out.data] == [0, 1] and out.model == MODEL
    for d, want in zip(out.data, ids):
        assert len(d.embedding) == FAKE_HIDDEN_SIZE
        assert np.allclose(d.embedding, _expected(want, pooling), atol=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in out.data]
    await client.close()


async def test_token_ids_unnormalized_and_dimensions(serve, codec):
    served, client = await _openai(serve)
    raw = await served.client.post("/v1/embeddings", json={"input": [[5, 6, 7], [9]], "normalize": False})
    body = await raw.json()
    assert raw.status == 200 and body["object"] == "list" and body["usage"]["prompt_tokens"] == 4
    assert np.allclose(body["data"][1]["embedding"], _expected([9], normalize=False), atol=1e-6)
    same = await client.embeddings.create(model=MODEL, input=[5, 6, 7], dimensions=FAKE_HIDDEN_SIZE)
    assert np.allclose(same.data[0].embedding, _expected([5, 6, 7]), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        await client.embeddings.create(model=MODEL, input="hi", dimensions=4)
    assert e.value.body["param"] == "dimensions" and "Matryoshka" in e.value.body["message"]
    await client.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [-1]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "hi", "priority": 3}, "priority"),
    ],
)
async def test_bad_bodies_name_their_field(serve, body, param):
    served = await serve()
    resp = await served.client.post("/v1/embeddings", json=body)
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == param, err
    assert served.fake.submits == []


async def test_over_the_context_is_refused_unless_truncated(serve, codec):
    served = await serve(context_limit=64)
    resp = await served.client.post("/v1/embeddings", json={"input": list(range(5, 100))})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["code"] == "context_length_exceeded"
    assert "max_tokens" not in err["message"] and "63 tokens" in err["message"], err  # the hidden token's position
    resp = await served.client.post("/v1/embeddings", json={"input": list(range(5, 68))})
    assert resp.status == 200  # context_limit - 1 tokens fit
    resp = await served.client.post("/v1/embeddings", json={"input": list(range(5, 100)), "truncate_prompt_tokens": 10})
    assert resp.status == 200
    assert served.fake.submits[-1].prompt_ids == list(range(90, 100))  # the last tokens kept
