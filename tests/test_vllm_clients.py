"""Clients written for vLLM's OpenAI server, unchanged, against the real model (SmolLM2): the
`openai` client's naive streaming loop, the exact payload `vllm bench serve` sends (and its
tokenizer alignment), lm-eval's log-likelihood payload with values checked against transformers,
and batched prompts with n = 2. The server is the session's SmolLM2 server (`smollm2_server`).
"""

from __future__ import annotations

import asyncio
import json
from operator import itemgetter

import aiohttp
import pytest
import torch

MODEL = "smollm2-135m-instruct"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_naive_streaming_loops(smollm2_server):
    """`for chunk in stream: chunk.choices[0].text` (and the chat equivalent) as the OpenAI and
    vLLM docs write it: no chunk without a choice unless usage was asked for."""
    client = _client(smollm2_server)
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    text = ""
    for chunk in stream:
        text += chunk.choices[0].text
    assert "Paris" in text
    stream = client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=16, temperature=0, stream=True)
    text = ""
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
    assert "Paris" in text


async def _bench_request(session: aiohttp.ClientSession, url: str, prompt: str, output_len: int) -> dict:
    """One request as vLLM's benchmark client (vllm/benchmarks/lib/endpoint_request_func.py,
    async_request_openai_completions, with --ignore-eos) builds and reads it."""
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    out = {"text": "", "chunks": 0, "output_tokens": None, "prompt_len": None}
    async with session.post(url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: ") :])
            if choices := data.get("choices"):
                out["text"] += choices[0].get("text") or ""
                out["chunks"] += 1
            elif usage := data.get("usage"):
                out["output_tokens"], out["prompt_len"] = usage.get("completion_tokens"), usage.get("prompt_tokens")
    return out


def test_vllm_bench_serve_payload(smollm2_server):
    """Eight concurrent requests with the benchmark's exact payload all succeed and report the
    usage it reads; its tokenizer alignment (/tokenize, /detokenize) works as it calls it."""
    url = smollm2_server.url
    prompts = [f"Request {i}: tell me about the sea and the " + "waves " * i for i in range(8)]

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url + "/tokenize", json={"model": MODEL, "prompt": prompts[3], "add_special_tokens": False}
            ) as r:
                tokens = (await r.json())["tokens"]
            async with s.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens[:5]}) as r:
                head = (await r.json())["prompt"]
            return tokens, head, await asyncio.gather(*(_bench_request(s, url, p, 12) for p in prompts))

    tokens, head, results = asyncio.run(main())
    assert prompts[3].startswith(head) and len(tokens) > 5
    for r in results:
        assert r["output_tokens"] == 12 and r["chunks"] >= 12 and r["prompt_len"] > 5


def _reference_logprobs(hf, ids: list[int]) -> list[float]:
    """transformers' full-sequence log-softmax: the logprob of every token given those before it."""
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    return [logp[p - 1, ids[p]].item() for p in range(1, len(ids))]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_payload(smollm2_server, smollm2_hf, smollm2_dir, max_tokens):
    """lm-eval's local-completions scoring request (a batch of token-id prompts, echo, logprobs 1,
    max_tokens 1 or 0), parsed as lm-eval parses it: the continuation's log-likelihood equals
    transformers' full-sequence log-softmax, and greedy-ness agrees."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a banana"),
        ("One, two, three,", " four, five"),
        ("Water boils at one hundred degrees", " Celsius."),
    ]
    requests = [(tok.encode(c).ids, tok.encode(x).ids) for c, x in pairs]
    payload = {
        "model": MODEL,
        "prompt": [c + x for c, x in requests],
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    resp = _client(smollm2_server).completions.with_raw_response.create(**payload)
    out = json.loads(resp.text)
    choices = sorted(out["choices"], key=itemgetter("index"))
    assert len(choices) == len(requests)
    for choice, (ctx, cont) in zip(choices, requests):
        lp = choice["logprobs"]
        ids = ctx + cont
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        ref = _reference_logprobs(smollm2_hf, ids)
        torch.testing.assert_close(
            torch.tensor(lp["token_logprobs"][1 : len(ids)]), torch.tensor(ref), atol=2e-3, rtol=1e-3
        )
        end = None if max_tokens == 0 else -1  # lm-eval drops the generated token: [ctxlen:-1]
        scored = lp["token_logprobs"][len(ctx) : end]
        assert sum(scored) == pytest.approx(sum(ref[len(ctx) - 1 :]), abs=5e-3)
        greedy = all(t == max(top.values()) for t, top in zip(scored, lp["top_logprobs"][len(ctx) : end]))
        with torch.no_grad():
            logits = smollm2_hf(torch.tensor([ids])).logits[0]
        assert greedy == all(logits[p - 1].argmax().item() == ids[p] for p in range(len(ctx), len(ids)))
    assert (
        choices[0]["logprobs"]["token_logprobs"][-1 - max_tokens]
        > choices[1]["logprobs"]["token_logprobs"][-1 - max_tokens]
    )


def test_batched_prompts_with_n_2_equal_each_prompt_alone(smollm2_server):
    """A batch of prompts with n = 2 and a seed: choice 2p + j is what prompt p alone gives as
    its sample j (each prompt is its own request on the GPU; randomness follows seed and sample)."""
    client = _client(smollm2_server)
    prompts = ["Once upon a time", "The best way to cook rice is", "def add(a, b):"]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, temperature=0.8, seed=42)
    assert [c.index for c in batch.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=10, temperature=0.8, seed=42)
        assert [c.text for c in batch.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices]
    assert batch.choices[0].text != batch.choices[1].text
    assert batch.usage.completion_tokens == 60


def test_penalties_through_the_openai_client(smollm2_server):
    """vLLM's sampling extras in extra_body reach the model: a greedy answer that repeats itself
    stops repeating under a repetition penalty; a bad word never appears."""
    client = _client(smollm2_server)
    prompt = "List the days of the week: Monday, Tuesday,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    assert "Wednesday" in plain
    banned = (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"bad_words": ["Wednesday"]}
        )
        .choices[0]
        .text
    )
    assert "Wednesday" not in banned
    penalized = (
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            extra_body={"repetition_penalty": 1.8, "presence_penalty": 1.0, "min_tokens": 5},
        )
        .choices[0]
        .text
    )
    assert penalized != plain
    assert max(penalized.count(w) for w in penalized.split() if len(w) > 3) <= max(
        plain.count(w) for w in plain.split() if len(w) > 3
    )


def test_the_model_by_the_path_it_was_served_from(smollm2_server, smollm2_dir):
    """vLLM's default model id is the served path; `ringserve serve` passes it to the workers. The
    model card never shows it (a client has no business knowing the server's filesystem)."""
    client = _client(smollm2_server)
    path = str(smollm2_dir)
    assert client.models.retrieve(MODEL).root == MODEL and client.models.retrieve(path).id == MODEL
    out = client.completions.create(model=path, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert out.model == MODEL and out.choices[0].text
