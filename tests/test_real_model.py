"""The real pretrained model (SmolLM2-135M-Instruct) served end to end: greedy tokens identical to
transformers (alone and among 32 concurrent requests), the `openai` client's chat and completions
calls (the marker test is tests/test_marker_e2e.py).

The model is fetched once per machine (`smollm2_dir`); one server serves the whole module. Each
test keeps to a few dozen tokens: a step of this model on a busy 2-CPU machine takes tens of ms.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from ringserve.api.chat.template import ChatTemplate
from ringserve.api.tokenizer import TextCodec
from tests.helpers.sse import sse_events

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 24
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPTS = [
    'def fibonacci(n):\n    """Return the first n Fibonacci numbers."""\n',
    "The secret code is QX7TRM4B. Remember it: QX7TRM4B. I repeat, the secret code is",
    "The history of the lighthouse begins in antiquity. " * 12 + "In the nineteenth century,",
]


@pytest.fixture(scope="module")
def codec(smollm2_dir) -> TextCodec:
    return TextCodec.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(smollm2_dir, codec) -> list[list[int]]:
    """Token ids: the chat-formatted question, code, a marker prompt, a ~150-token text."""
    chat = ChatTemplate.load(smollm2_dir, codec).render(CAPITAL)
    return [codec.encode(chat, add_special_tokens=False)] + [codec.encode(t) for t in TEXT_PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2_hf, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (ending with the EOS token when it comes, as
    the server's answers do)."""
    import torch

    hf = smollm2_hf
    eos = hf.generation_config.eos_token_id
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = hf.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos
            )[0, len(ids) :].tolist()
            out.append(gen[: gen.index(eos) + 1] if eos in gen else gen)
    return out


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


async def _greedy_ids(session, url: str, ids: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    body = {"prompt_token_ids": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        events = sse_events(await resp.read())
    return [e["token_id"] for e in events if isinstance(e, dict) and "token_id" in e]


def _filler(rng: random.Random, codec: TextCodec) -> dict:
    words = "river stone light morning market garden quiet letter winter train".split()
    text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 120)))
    body = {"prompt": text, "max_tokens": rng.randint(4, 40), "temperature": rng.choice([0, 0.8])}
    if body["temperature"]:
        body["seed"] = rng.randint(0, 1000)
    return body


def test_greedy_tokens_match_transformers_alone(server, prompts, reference):
    """Each prompt alone: the server's greedy tokens are transformers' tokens."""

    async def main():
        async with aiohttp.ClientSession() as s:
            return [await _greedy_ids(s, server.url, ids) for ids in prompts]

    assert asyncio.run(main()) == reference


def test_greedy_tokens_match_transformers_among_32_concurrent(server, prompts, reference, codec):
    """The same prompts inside a batch of 32 concurrent requests of mixed lengths and sampling."""
    rng = random.Random(7)
    fillers = [_filler(rng, codec) for _ in range(32 - len(prompts))]

    async def main():
        async with aiohttp.ClientSession() as s:

            async def filler(body):
                async with s.post(server.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            results = await asyncio.gather(
                *[_greedy_ids(s, server.url, ids) for ids in prompts], *[filler(b) for b in fillers]
            )
            return results[: len(prompts)]

    assert asyncio.run(main()) == reference


def test_chat_answer_is_real_english(server, codec, reference):
    """The chat-formatted question's greedy answer, as text."""
    assert codec.decode(reference[0]) == "The capital of France is Paris."


def test_openai_client_chat(server):
    """openai's chat.completions.create, plain and streamed (same greedy text, usage at the end)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    full = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert "Paris" in choice.message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_client_completions(server):
    """openai's completions.create continues a text sensibly."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text
