"""POST /v1/completions end to end against the in-process fake GPU: events, bodies, ids, stops."""

from __future__ import annotations

import itertools

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.fake_api import MODEL
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio


async def _stream(served, **body):
    resp = await served.client.post("/v1/completions", json={"stream": True, **body})
    assert resp.status == 200, await resp.text()
    return resp, sse_events(await resp.read())


async def test_stream_event_sequence_and_fields(serve, codec):
    """One event per token with every field, then a finish event (with the choice's usage and the
    request's timing), then [DONE]: no `"choices": []` event unless the client asks for usage."""
    served = await serve()
    ids = codec.encode("Hello world")
    resp, events = await _stream(served, prompt="Hello world", max_tokens=len(ids))
    request_id = resp.headers["x-request-id"]
    tokens, finish, done = events[:-2], events[-2], events[-1]
    assert len(tokens) == len(ids)
    for ev, tid in zip(tokens, ids):
        assert set(ev) == {
            "id",
            "object",
            "created",
            "model",
            "choices",
            "request_id",
            "index",
            "text",
            "token_id",
            "logprob",
        }
        assert ev["object"] == "text_completion" and ev["model"] == MODEL
        assert ev["id"] == ev["request_id"] == request_id
        assert ev["token_id"] == tid and ev["index"] == 0 and ev["logprob"] == -0.5
        assert ev["choices"] == [{"index": 0, "text": ev["text"], "logprobs": None, "finish_reason": None}]
    assert "".join(ev["text"] for ev in tokens) == "Hello world"
    assert finish["choices"][0]["finish_reason"] == "length" and finish["request_id"] == request_id
    assert finish["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ids), "total_tokens": 2 * len(ids)}
    assert (
        set(finish["timing"]) == {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "preemptions"}
        and finish["timing"]["ttft_ms"] >= 0
    )
    assert done == "[DONE]"


async def test_usage_event_only_with_include_usage(serve, codec):
    """stream_options.include_usage adds the `"choices": []` event with usage and timing."""
    served = await serve()
    ids = codec.encode("Hello world")
    _, events = await _stream(served, prompt="Hello world", max_tokens=len(ids), stream_options={"include_usage": True})
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ids), "total_tokens": 2 * len(ids)}
    assert set(usage["timing"]) == {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "preemptions"}
    assert all(e["choices"] for e in events[:-2])


async def test_continuous_usage_stats_put_usage_on_every_event(serve, codec):
    """continuous_usage_stats (with include_usage) puts the choice's usage so far on every event."""
    served = await serve()
    ids = codec.encode("Hello world")
    _, events = await _stream(
        served,
        prompt="Hello world",
        max_tokens=len(ids),
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    tokens = events[:-3]
    assert [e["usage"]["completion_tokens"] for e in tokens] == list(range(1, len(ids) + 1))
    assert all(e["usage"]["prompt_tokens"] == len(ids) for e in tokens)


async def test_stream_options_without_stream_is_400(serve):
    """vLLM refuses stream_options on a request that does not stream."""
    served = await serve()
    resp = await served.client.post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "stream_options"


async def test_first_event_is_a_token(serve, codec):
    """No empty preamble event: the first event already carries the first token."""
    served = await serve()
    _, events = await _stream(served, prompt="abc", max_tokens=2)
    assert events[0]["token_id"] == codec.encode("abc")[0]


async def test_non_streaming_response(serve, codec):
    """stream false answers one OpenAI JSON body with usage and timing."""
    served = await serve()
    ids = codec.encode("Hello world")
    resp = await served.client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": len(ids)})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"] == resp.headers["x-request-id"]
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["completion_tokens"] == len(ids)
    assert body["timing"]["queue_ms"] == pytest.approx(0.1)


async def test_prompt_token_ids_and_n_samples(serve, codec):
    """prompt_token_ids is accepted; n=2 streams both samples, each with its own finish."""
    served = await serve()
    ids = codec.encode("two samples")
    _, events = await _stream(
        served, prompt_token_ids=ids, max_tokens=len(ids), n=2, stream_options={"include_usage": True}
    )
    for index in (0, 1):
        mine = [e for e in events[:-2] if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(e["choices"][0]["text"] for e in mine) == "two samples"
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 2 * len(ids)
    assert served.fake.submits[0].n == 2


async def test_client_request_id_used_when_unique(serve):
    """A client-sent x-request-id is used; a malformed one is replaced."""
    served = await serve()
    resp = await served.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "my-id-1"}
    )
    assert resp.headers["x-request-id"] == "my-id-1"
    assert (await resp.json())["id"] == "my-id-1"
    resp = await served.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "bad id!"}
    )
    assert resp.headers["x-request-id"].startswith("cmpl-")


async def test_client_request_id_in_use_is_replaced(serve):
    """While a request with id X is open, a second request asking for X gets a fresh id."""
    fake = FakeGpu(paused=True)
    served = await serve(fake=fake)
    first = await served.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True}, headers={"x-request-id": "dup"}
    )
    assert first.headers["x-request-id"] == "dup"
    second = await served.client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True}, headers={"x-request-id": "dup"}
    )
    assert second.headers["x-request-id"] != "dup"
    fake.resume()
    await first.read()
    await second.read()


@pytest.mark.parametrize("text", ["世界 こんにちは 你好", "party 🎉🎉 🧑‍🚀 done", "ñandú café ÿ"])
async def test_multibyte_text_split_across_tokens_never_breaks(serve, codec, text):
    """Emoji and CJK split over byte tokens stream without a broken character."""
    ids = codec.encode(text)
    assert any(codec.byte_table[i] and not _utf8_complete(codec.byte_table[i]) for i in ids)
    served = await serve()
    _, events = await _stream(served, prompt=text, max_tokens=len(ids))
    texts = [e["text"] for e in events[:-2]]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == text
    assert "" in texts[1:]  # some token completed no character and was held back


def _utf8_complete(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


async def test_stop_string_spanning_tokens(serve, codec):
    """A stop string across token boundaries truncates the text and cancels the GPU row."""
    served = await serve()
    prompt = "Hello world again"
    _, events = await _stream(served, prompt=prompt, max_tokens=200, stop=["o wo", "zzz"])
    tokens = [e for e in events if "token_id" in e]
    assert "".join(e["text"] for e in tokens) == "Hell"
    finish = events[-2]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["text"] == ""
    assert [c.reason for c in served.fake.cancels] == ["stop"]
    assert finish["usage"]["completion_tokens"] == len(tokens)


async def test_stop_string_prefix_is_held_then_released(serve, codec):
    """Text that could start a stop string is held back and sent once it cannot."""
    served = await serve()
    ids = codec.encode("Hello world")
    _, events = await _stream(served, prompt="Hello world", max_tokens=len(ids), stop="worm")
    texts = [e["text"] for e in events if "token_id" in e]
    assert not any(t.endswith("w") for t in texts)  # "w" might have started "worm"
    finish = events[-2]
    assert "".join(texts) + finish["text"] == "Hello world"
    assert finish["choices"][0]["finish_reason"] == "length"


async def test_stop_string_non_streaming(serve):
    """Non-streaming answers carry the truncated text and finish_reason stop."""
    served = await serve()
    resp = await served.client.post(
        "/v1/completions", json={"prompt": "one two three", "max_tokens": 50, "stop": " thr"}
    )
    body = await resp.json()
    assert body["choices"][0]["text"] == "one two"
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_sampling_fields_reach_the_gpu(serve):
    """Sampling settings, stop_token_ids, seed and the tenant travel in the Submit."""
    served = await serve()
    await served.client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "max_tokens": 2,
            "temperature": 0,
            "top_k": 5,
            "top_p": 0.9,
            "seed": 7,
            "stop_token_ids": [3],
            "ignore_eos": True,
            "user": "ignored",
            "echo": False,
        },
    )
    sub = served.fake.submits[0]
    sp = sub.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.stop_token_ids, sp.ignore_eos) == (
        0.0,
        5,
        0.9,
        7,
        (3,),
        True,
    )
    assert sub.tenant == "shared" and sub.max_tokens == 2


async def test_long_prompt_tokenized_in_thread_is_exact(serve, codec):
    """A prompt past the inline threshold is tokenized off the event loop, with the same ids."""
    served = await serve()
    text = "the quick brown fox jumps over the lazy dog. " * 200
    assert len(text) > served.state.tokenize_inline_chars
    resp = await served.client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert resp.status == 200
    assert served.fake.submits[0].prompt_ids == codec.encode(text)


async def test_gpu_failure_mid_stream_sends_error_event(serve):
    """A GPU-process failure gives every open stream an error event, then [DONE]."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1000, "stream": True})
    await resp.content.readuntil(b"\n\n")
    fake.fail()
    events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "gpu_process_restart"
    assert events[-2]["error"]["type"] == "gpu_process_restart"


async def test_logprobs_streaming_and_not(serve, codec):
    """logprobs asks for OpenAI's logprobs object, per event when streaming, per choice otherwise."""
    served = await serve()
    ids = codec.encode("ab cd")
    _, events = await _stream(served, prompt="ab cd", max_tokens=len(ids), logprobs=1)
    lp = events[1]["choices"][0]["logprobs"]
    assert lp["tokens"] == [codec.decode([ids[1]])] and lp["token_logprobs"] == [-0.5]
    assert lp["top_logprobs"] == [{codec.decode([ids[1]]): -0.5}]
    resp = await served.client.post("/v1/completions", json={"prompt": "ab cd", "logprobs": 0, "max_tokens": len(ids)})
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == "ab cd"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len("ab cd")


async def test_stop_strings_with_two_samples_cancel_once(serve):
    """With n=2 the row is cancelled once, after both samples hit a stop string."""
    served = await serve()
    _, events = await _stream(served, prompt="one two three", max_tokens=100, n=2, stop=" two")
    finishes = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(e["index"] for e in finishes) == [0, 1]
    assert all(e["choices"][0]["finish_reason"] == "stop" for e in finishes)
    for index in (0, 1):
        text = "".join(e["text"] for e in events if "token_id" in e and e["index"] == index)
        assert text == "one"
    assert [c.reason for c in served.fake.cancels] == ["stop"]


async def test_stop_string_in_one_sample_cancels_only_that_sample(serve, codec):
    """n=2: sample 0 hits its stop string at its 3rd token while sample 1 runs on; the worker sends
    Cancel(index=0, reason=stop) at once, so sample 0's row stops within a step or two, and the
    request's own Cancel follows when sample 1 hits too."""
    texts = ("one two three four five six seven eight nine ten", "a b c d e f g h i two j k")
    scripts = [itertools.cycle(codec.encode(t)) for t in texts]
    fake = FakeGpu(script=lambda submit, index: scripts[index], step_interval_s=0.005)
    ended = []
    finish = fake._finish
    fake._finish = lambda row, i, reason, now: (
        ended.append((i, reason, row.generated[i])),
        finish(row, i, reason, now),
    )[1]
    served = await serve(fake=fake)
    _, events = await _stream(served, prompt="x", max_tokens=40, n=2, stop=" two")
    for index, want in ((0, "one"), (1, "a b c d e f g h i")):
        assert "".join(e["text"] for e in events if "token_id" in e and e["index"] == index) == want
    assert [(c.index, c.reason) for c in served.fake.cancels] == [(0, "stop"), (None, "stop")]
    ((_, reason, generated),) = [e for e in ended if e[0] == 0]
    # A row cancelled by a stop string finishes `stop`, as the GPU process finishes it.
    assert reason == "stop" and generated <= 5  # "one", " two", then at most two steps more
