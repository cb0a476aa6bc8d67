"""POST /v1/chat/completions against the in-process fake GPU, on the tiny model's tokenizer and chat
template: the prompt it submits, the chunk sequence, bodies, logprobs, and every 400."""

from __future__ import annotations

import itertools

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.fake_api import MODEL
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio

HELLO = [{"role": "user", "content": "Hello world"}]


def _answer(codec, text: str, eot: int):
    """A fake-GPU script: the tokens of `text`, then the end-of-turn token, then filler."""
    ids = codec.encode(text, add_special_tokens=False) + [eot]
    return lambda submit, index: itertools.chain(ids, itertools.repeat(ids[0]))


async def _chat(served, **body):
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, **body})
    return resp, (sse_events(await resp.read()) if body.get("stream") else await resp.json())


async def _error(served, **body) -> tuple[int, dict]:
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, **body})
    return resp.status, (await resp.json())["error"]


async def test_prompt_is_the_rendered_template_without_extra_special_tokens(serve, codec, chat_template):
    """The submitted ids are the template's rendering tokenized as is (no second BOS), with
    the generation prompt at the end."""
    served = await serve()
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    resp = await served.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
    assert resp.status == 200, await resp.text()
    text = chat_template.render(messages)
    assert text.endswith("<|begin_of_text|>assistant\n")
    assert served.fake.submits[0].prompt_ids == codec.encode(text, add_special_tokens=False)
    assert codec.encode(text, add_special_tokens=False) != codec.encode(text)


async def test_stream_chunks_role_content_finish_done(serve, codec, chat_template):
    """Role chunk, one content chunk per token with ringserve's fields, the finish chunk with
    timing, no usage chunk by default, then [DONE]."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi there", eot)))
    resp, events = await _chat(served, stream=True, max_tokens=50)
    rid = resp.headers["x-request-id"]
    role, tokens, finish, done = events[0], events[1:-2], events[-2], events[-1]
    assert role["object"] == "chat.completion.chunk" and role["model"] == MODEL and role["id"] == rid
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    answer_ids = codec.encode("Hi there", add_special_tokens=False) + [eot]
    assert [e["token_id"] for e in tokens] == answer_ids
    for e in tokens:
        assert set(e) == {
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
        assert e["choices"][0]["delta"] == {"content": e["text"]} and e["request_id"] == rid
    assert "".join(e["text"] for e in tokens) == "Hi there"
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert set(finish["timing"]) == {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "preemptions"}
    assert done == "[DONE]"


async def test_stream_usage_only_when_asked(serve, codec, chat_template):
    """stream_options.include_usage adds one chunk with empty choices, usage and timing before [DONE]."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi", eot)))
    _, events = await _chat(served, stream=True, stream_options={"include_usage": True})
    usage, done = events[-2], events[-1]
    prompt = len(served.fake.submits[0].prompt_ids)
    answer = len(codec.encode("Hi", add_special_tokens=False)) + 1  # and the end-of-turn token
    assert usage["choices"] == [] and done == "[DONE]"
    assert usage["usage"] == {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}
    assert usage["timing"]["ttft_ms"] >= 0


async def test_non_streaming_body(serve, codec, chat_template):
    """One chat.completion body: the assistant message, finish_reason stop at the end of turn."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi there", eot)))
    resp, body = await _chat(served, max_tokens=50)
    assert resp.status == 200
    assert body["object"] == "chat.completion" and body["id"] == resp.headers["x-request-id"]
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi there"}, "logprobs": None, "finish_reason": "stop"}
    ]
    answer = len(codec.encode("Hi there", add_special_tokens=False)) + 1
    assert body["usage"]["completion_tokens"] == answer and body["request_id"] == body["id"]


async def test_end_of_turn_stops_unless_ignore_eos(serve, codec, chat_template):
    """The template's end-of-turn token joins the stop ids; ignore_eos leaves it out (fixed length)."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi", eot)))
    _, body = await _chat(served, max_tokens=8, stop_token_ids=[7])
    assert served.fake.submits[0].sampling.stop_token_ids == (7, eot)
    assert body["choices"][0]["finish_reason"] == "stop"
    _, body = await _chat(served, max_tokens=8, ignore_eos=True)
    assert served.fake.submits[1].sampling.stop_token_ids == ()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8


async def test_max_tokens_fields(serve, chat_template):
    """max_completion_tokens or max_tokens caps the answer; unset, it runs up to the context limit
    (within the server's max_tokens limit); two different values are a 400."""
    served = await serve(context_limit=64, max_tokens_limit=60)
    await _chat(served, max_completion_tokens=5)
    await _chat(served, max_tokens=6)
    await _chat(served)
    prompt = len(served.fake.submits[2].prompt_ids)
    assert [s.max_tokens for s in served.fake.submits] == [5, 6, min(60, 64 - prompt)]
    status, err = await _error(served, max_tokens=5, max_completion_tokens=6)
    assert status == 400 and err["param"] == "max_tokens"
    status, err = await _error(served, max_completion_tokens=61)
    assert status == 400 and err["param"] == "max_completion_tokens"


async def test_too_long_conversation_is_400(serve):
    """Messages whose prompt leaves no room in the context are 400 context_length_exceeded."""
    served = await serve(context_limit=32, max_tokens_limit=16)
    status, err = await _error(served, messages=[{"role": "user", "content": "word " * 100}])
    assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"


async def test_content_parts_are_joined_with_newlines(serve, chat_template, codec):
    """A list of text parts is one string content, parts joined by a newline."""
    served = await serve()
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    resp, _ = await _chat(served, messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert resp.status == 200
    expected = chat_template.render([{"role": "user", "content": "first\nsecond"}])
    assert served.fake.submits[0].prompt_ids == codec.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tools"),  # the template has no tools
        ("tool_choice", "required", "tool_choice"),  # without tools
        ("response_format", {"type": "bogus"}, "response_format.type"),
        ("use_beam_search", True, "use_beam_search"),
        ("priority", 1, "priority"),
        ("chat_template", "{{ messages }}", "chat_template"),
        ("logit_bias", {"99999": 1.0}, "logit_bias"),
        ("audio", {"voice": "alloy"}, "audio"),
        ("messages", [{"role": "robot", "content": "x"}], "messages[0].role"),
        ("messages", [{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
        ("messages", [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "messages"),
        (
            "messages",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0].type",
        ),
        ("messages", [{"role": "user", "content": None}], "messages[0].content"),
        ("messages", [], "messages"),
        ("stream_options", {"include_usage": True, "continuous_usage_stats": True}, "stream_options"),
        ("top_logprobs", 2, "top_logprobs"),
        ("n", 0, "n"),
        ("temperature", 3.0, "temperature"),
        ("parallel_tool_calls", "yes", "parallel_tool_calls"),
    ],
)
async def test_fields_it_cannot_honour_are_400_naming_them(serve, field, value, param):
    """Tools the template cannot render, bad structured output, audio, non-text parts, bad roles
    and bad values: 400 with param."""
    served = await serve()
    status, err = await _error(served, **{field: value})
    assert status == 400 and err["param"] == param, err
    assert served.fake.submits == []


async def test_neutral_values_of_unsupported_fields_are_accepted(serve):
    """What clients send by default (null tools, text format, empty tool_calls) is fine."""
    served = await serve()
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": None, "refusal": None},
        {"role": "user", "content": "Bye", "name": "bob"},
    ]
    resp, body = await _chat(
        served,
        messages=messages,
        tools=None,
        tool_choice="none",
        response_format={"type": "text"},
        parallel_tool_calls=True,
        frequency_penalty=0,
        user="me",
        max_tokens=2,
    )
    assert resp.status == 200, body


async def test_template_refusal_is_400_with_its_message(serve):
    """The template's raise_exception (two user turns in a row) becomes a 400 quoting it."""
    served = await serve()
    status, err = await _error(served, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert status == 400 and err["code"] == "chat_template_error"
    assert "must alternate" in err["message"]


async def test_model_without_chat_template_is_400(serve):
    """No template: 400 that says so and points at /v1/completions."""
    served = await serve(app_kw={"chat_template": None})
    status, err = await _error(served)
    assert status == 400 and err["code"] == "no_chat_template" and "/v1/completions" in err["message"]


async def test_wrong_model_is_404(serve):
    served = await serve()
    status, err = await _error(served, model="gpt-4")
    assert status == 404 and err["code"] == "model_not_found"


async def test_logprobs_in_chat_shape(serve, codec, chat_template):
    """logprobs + top_logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}, streamed
    per chunk and whole in the body."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi", eot)))
    _, body = await _chat(served, logprobs=True, top_logprobs=2)
    content = body["choices"][0]["logprobs"]["content"]
    hi = codec.encode("Hi", add_special_tokens=False)[0]
    assert content[0] == {
        "token": codec.decode([hi]),
        "logprob": -0.5,
        "bytes": list(codec.decode([hi]).encode()),
        "top_logprobs": [{"token": codec.decode([hi]), "logprob": -0.5, "bytes": list(codec.decode([hi]).encode())}]
        * 2,
    }
    assert served.fake.submits[0].logprobs == 2
    _, events = await _chat(served, stream=True, logprobs=True)
    first = events[1]["choices"][0]["logprobs"]
    assert first == {
        "content": [
            {
                "token": codec.decode([hi]),
                "logprob": -0.5,
                "bytes": list(codec.decode([hi]).encode()),
                "top_logprobs": [],
            }
        ]
    }
    assert served.fake.submits[1].logprobs == 0


async def test_n_choices_each_get_role_and_finish(serve, codec, chat_template):
    """n=2: a role chunk and a finish chunk per choice index."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hi", eot)))
    _, events = await _chat(served, stream=True, n=2)
    roles = [e["choices"][0]["index"] for e in events[:2]]
    finishes = sorted(
        e["choices"][0]["index"] for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["finish_reason"]
    )
    assert roles == [0, 1] and finishes == [0, 1]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:2])


async def test_stop_string_ends_the_answer(serve, codec, chat_template):
    """A stop string cuts the text before it and cancels the row, as on /v1/completions."""
    eot = chat_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, "Hello there friend", eot)))
    _, body = await _chat(served, stop=" there")
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_delete_cancels_a_chat_stream(serve):
    """DELETE /v1/requests/{id} ends a chat stream with finish_reason cancelled."""
    served = await serve(fake=FakeGpu(step_interval_s=0.002))
    resp = await served.client.post(
        "/v1/chat/completions", json={"messages": HELLO, "stream": True, "ignore_eos": True, "max_tokens": 1000}
    )
    await resp.content.readuntil(b"\n\n")
    deleted = await served.client.delete(f"/v1/requests/{resp.headers['x-request-id']}")
    assert deleted.status == 200
    events = sse_events(await resp.read())
    assert events[-2]["choices"][0]["finish_reason"] == "cancelled" and events[-1] == "[DONE]"
    assert [c.reason for c in served.fake.cancels] == ["cancelled"]
    assert served.fake.running == 0 and len(served.state.registry) == 0


async def test_restart_error_event_mid_stream(serve):
    """A GPU-process restart after tokens streamed: the error event, then [DONE]."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake, ready=lambda: fake.ready)
    resp = await served.client.post(
        "/v1/chat/completions", json={"messages": HELLO, "stream": True, "ignore_eos": True, "max_tokens": 1000}
    )
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    fake.restart()
    events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "gpu_process_restart"
    assert events[-2]["request_id"] == resp.headers["x-request-id"]


async def test_rejection_is_counted_and_answered_before_the_stream(serve):
    """A 429 from admission is an HTTP 429 with Retry-After, never an SSE stream."""
    from ringserve.shm.messages import Rejected

    fake = FakeGpu(
        admit=lambda s: Rejected(rid=s.rid, status=429, code="queue_full", message="busy", retry_after_s=2.0)
    )
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "stream": True})
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    assert served.state.stats.as_dict()["requests_rejected_429"] == 1
