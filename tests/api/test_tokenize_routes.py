"""vLLM's /tokenize and /detokenize, GET /version, GET /v1/models/{id}, and the model named by the
path it was served from."""

from __future__ import annotations

import pytest

from ringserve import __version__
from tests.helpers.fake_api import MODEL

pytestmark = pytest.mark.asyncio
PATH = "/srv/models/tiny-test"


async def test_tokenize_a_prompt(serve, codec):
    """vLLM's completion-style request: special tokens added unless asked not to; token strings."""
    served = await serve()
    resp = await served.client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert await resp.json() == {
        "count": len(codec.encode("Hello world")),
        "max_model_len": 8192,
        "tokens": codec.encode("Hello world"),
    }
    resp = await served.client.post(
        "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}
    )
    body = await resp.json()
    ids = codec.encode("Hello world", add_special_tokens=False)
    assert body["tokens"] == ids and body["token_strs"] == [codec.tokenizer.id_to_token(i) for i in ids]


async def test_tokenize_messages(serve, codec, chat_template):
    """Chat-style: the messages rendered with the template as /v1/chat/completions renders them."""
    served = await serve()
    messages = [{"role": "user", "content": "Hi"}]
    resp = await served.client.post("/tokenize", json={"messages": messages})
    want = codec.encode(chat_template.render(messages), add_special_tokens=False)
    assert (await resp.json())["tokens"] == want
    chat = await served.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.status == 200 and served.fake.submits[-1].prompt_ids == want
    resp = await served.client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert (await resp.json())["tokens"] == codec.encode(
        chat_template.render(messages, False), add_special_tokens=False
    )


async def test_tokenize_refusals(serve):
    """Both or neither of prompt and messages, a wrong model, a template of the request's own: 4xx."""
    served = await serve()
    for body, status, param in (
        ({}, 400, "prompt"),
        ({"prompt": "a", "messages": []}, 400, "prompt"),
        ({"prompt": "a", "model": "other"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "a"}], "chat_template": "x"}, 400, "chat_template"),
    ):
        resp = await served.client.post("/tokenize", json=body)
        assert resp.status == status and (await resp.json())["error"]["param"] == param


async def test_detokenize(serve, codec):
    """Token ids back to text, special tokens included; ids outside the vocabulary are 400."""
    served = await serve()
    ids = codec.encode("Hello world")
    resp = await served.client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert await resp.json() == {"prompt": codec.decode(ids, skip_special_tokens=False)}
    resp = await served.client.post("/detokenize", json={"tokens": [10**6]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"


async def test_version_and_model_routes(serve):
    """GET /version; GET /v1/models/{id} by id or by the served path, the card never showing the
    path; other ids are 404."""
    served = await serve(app_kw={"model_aliases": frozenset({PATH})})
    assert await (await served.client.get("/version")).json() == {"version": __version__}
    for name in (MODEL, PATH):
        resp = await served.client.get(f"/v1/models/{name}")
        card = await resp.json()
        assert resp.status == 200 and card["id"] == MODEL and card["root"] == MODEL
        assert PATH not in await resp.text()
    resp = await served.client.get("/v1/models/gpt-4")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"


async def test_the_served_path_names_the_model(serve):
    """vLLM's default model id is the path it serves from: requests naming it are served."""
    served = await serve(app_kw={"model_aliases": frozenset({PATH})})
    resp = await served.client.post("/v1/completions", json={"model": PATH, "prompt": "x", "max_tokens": 1})
    assert resp.status == 200 and (await resp.json())["model"] == MODEL
    resp = await served.client.post("/v1/completions", json={"model": PATH + "2", "prompt": "x", "max_tokens": 1})
    assert resp.status == 404
