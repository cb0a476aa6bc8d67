"""A list of prompts on /v1/completions (langchain's batch, lm-eval with batch size > 1) against the
in-process fake GPU: one Submit per prompt, choices numbered prompt * n + sample, usage over the
whole; a refusal, a DELETE and a stop string cover the whole batch or exactly their sample."""

from __future__ import annotations

import pytest

from ringserve.api.fake_gpu import FakeGpu
from ringserve.shm.messages import Rejected
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio
PROMPTS = ["alpha beta", "gamma", "delta epsilon zeta"]


async def test_batched_text_prompts_with_n_2(serve, codec):
    """Three prompts, n=2: six choices, choice 2p + j answers prompt p (the fake echoes it); usage
    counts each prompt once and every choice's tokens."""
    served = await serve()
    lens = [len(codec.encode(p)) for p in PROMPTS]
    resp = await served.client.post(
        "/v1/completions", json={"prompt": PROMPTS, "n": 2, "max_tokens": 20, "stop": "zzz"}
    )
    body = await resp.json()
    assert resp.status == 200, body
    assert [s.prompt_ids for s in served.fake.submits] == [codec.encode(p) for p in PROMPTS]
    assert all(s.n == 2 for s in served.fake.submits)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        assert c["text"].startswith(PROMPTS[c["index"] // 2])
    assert body["usage"] == {"prompt_tokens": sum(lens), "completion_tokens": 6 * 20, "total_tokens": sum(lens) + 120}


async def test_batched_token_prompts_streamed(serve):
    """Token-id lists, streamed: every event's choice index maps to its prompt and sample."""
    served = await serve()
    prompts = [[5, 6, 7], [8, 9]]
    resp = await served.client.post(
        "/v1/completions",
        json={"prompt": prompts, "n": 2, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(await resp.read())
    for index in range(4):
        mine = [e for e in events[:-2] if e["choices"][0]["index"] == index]
        assert [e["token_id"] for e in mine if "token_id" in e] == prompts[index // 2] + prompts[index // 2][
            : 3 - len(prompts[index // 2])
        ]
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["prompt_tokens"] == 5 and events[-2]["usage"]["completion_tokens"] == 12


async def test_a_refused_prompt_refuses_the_batch(serve):
    """The GPU refuses one prompt (429): the client gets the 429 and the admitted prompts are cancelled."""
    fake = FakeGpu(
        step_interval_s=0.05,
        admit=lambda s: (
            Rejected(rid=s.rid, status=429, code="overloaded", message="busy", retry_after_s=2.0)
            if s.prompt_ids[-1] == 9
            else None
        ),
    )
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/completions", json={"prompt": [[5, 6], [8, 9], [7]], "max_tokens": 50})
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert sorted(c.rid for c in fake.cancels) == sorted(s.rid for s in fake.submits if s.prompt_ids[-1] != 9)
    assert len(served.state.registry) == 0


async def test_delete_cancels_every_prompt(serve):
    """DELETE of a batched request ends all its choices and cancels every Submit."""
    served = await serve(fake=FakeGpu(step_interval_s=0.005))
    resp = await served.client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 1000, "stream": True})
    await resp.content.readuntil(b"\n\n")
    assert (await served.client.delete(f"/v1/requests/{resp.headers['x-request-id']}")).status == 200
    events = sse_events(await resp.read())
    finishes = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(e["index"] for e in finishes) == [0, 1, 2]
    assert all(e["choices"][0]["finish_reason"] == "cancelled" for e in finishes)
    assert sorted(c.rid for c in served.fake.cancels) == sorted(s.rid for s in served.fake.submits)
    assert served.fake.running == 0


async def test_stop_string_in_one_choice_cancels_only_its_sample(serve):
    """A stop string ends choices 2 and 3 (prompt 1's samples): each Cancel names that Submit and
    its own sample index, while prompt 0's choices run to max_tokens."""
    served = await serve(fake=FakeGpu(step_interval_s=0.002))
    resp = await served.client.post(
        "/v1/completions", json={"prompt": ["one two", "three four five"], "n": 2, "max_tokens": 12, "stop": " fiv"}
    )
    body = await resp.json()
    reasons = [c["finish_reason"] for c in body["choices"]]
    assert reasons == ["length", "length", "stop", "stop"]
    second = served.fake.submits[1].rid
    assert sorted((c.rid, c.index) for c in served.fake.cancels) == [(second, 0), (second, 1)]
