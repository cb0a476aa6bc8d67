"""vLLM's request fields on /v1/completions and /v1/chat/completions, against the in-process fake
GPU: unknown fields ignored and named, the sampling extras on the wire, max_tokens, echo and
prompt logprobs, the logprobs shape, and the worker-side output options."""

from __future__ import annotations

import itertools
import logging

import pytest

from ringserve.api.fake_gpu import FakeGpu
from ringserve.api.sampling_tokens import bad_word_ids
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio
HEADER = "x-ringserve-ignored-fields"


async def _post(served, path="/v1/completions", **body):
    resp = await served.client.post(path, json=body)
    return resp, (sse_events(await resp.read()) if body.get("stream") else await resp.json())


async def test_unknown_fields_are_ignored_and_named(serve, caplog):
    """Fields vLLM's clients send that ringserve does not know (vllm_xargs, kv_transfer_params,
    ...) are ignored, named in a header, on errors too, and in a debug log line."""
    served = await serve()
    with caplog.at_level(logging.DEBUG, logger="ringserve.api"):
        resp, body = await _post(
            served,
            prompt="Hello",
            max_tokens=2,
            vllm_xargs={"a": 1},
            session_id="s",
            stream=True,
            stream_options={"include_usage": True, "extra": 1},
        )
    assert resp.status == 200
    assert resp.headers[HEADER] == "vllm_xargs, session_id, stream_options.extra"
    assert any("vllm_xargs" in r.getMessage() for r in caplog.records)
    resp, body = await _post(served, prompt="Hello", temperature=9, mystery=True)
    assert resp.status == 400 and body["error"]["param"] == "temperature"
    assert resp.headers[HEADER] == "mystery"
    resp, _ = await _post(served, prompt="Hello", max_tokens=1)
    assert HEADER not in resp.headers


async def test_unknown_fields_inside_messages_are_named(serve):
    """Unknown keys of a message or a content part (e.g. Anthropic-style cache_control) too."""
    served = await serve()
    resp, body = await _post(
        served,
        "/v1/chat/completions",
        max_tokens=2,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "x"}}], "weight": 1}
        ],
    )
    assert resp.status == 200, body
    assert resp.headers[HEADER] == "messages[0].content[0].cache_control, messages[0].weight"


async def test_ignored_field_names_are_escaped_in_the_header(serve):
    """A key may hold any character; the header stays printable ASCII."""
    served = await serve()
    resp, _ = await _post(served, prompt="Hello", max_tokens=1, **{"a\nb\u00e9": 1})
    assert resp.status == 200 and resp.headers[HEADER] == "a\\nb\\xe9"


async def test_vllm_sampling_extras_reach_the_gpu(serve, codec):
    """The logits controls travel in the Submit as validated: biases clamped to [-100, 100] and
    sorted, allowed ids sorted and distinct, bad words tokenized as vLLM does."""
    served = await serve()
    resp, body = await _post(
        served,
        prompt="Hello",
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.1,
        min_p=0.05,
        min_tokens=2,
        logit_bias={"9": 250, "3": -1.5},
        allowed_token_ids=[9, 3, 9, 40],
        bad_words=["hello world", " fox"],
        prompt_logprobs=2,
        top_k=-1,
    )
    assert resp.status == 200, body
    sub = served.fake.submits[0]
    sp = sub.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p, sp.min_tokens, sp.top_k) == (
        0.5,
        -0.25,
        1.1,
        0.05,
        2,
        0,
    )
    assert sp.logit_bias == ((3, -1.5), (9, 100.0)) and sp.allowed_token_ids == (3, 9, 40)
    assert sp.bad_words == bad_word_ids(codec, ("hello world", " fox"))
    assert sp.bad_words[0] == tuple(codec.encode("hello world", add_special_tokens=False))
    assert sub.prompt_logprobs == 2


async def test_neutral_vllm_values_are_accepted(serve):
    """What vLLM's clients send at their defaults passes (the benchmark's repetition_penalty 1.0)."""
    served = await serve()
    resp, body = await _post(
        served,
        prompt="Hi",
        max_tokens=1,
        repetition_penalty=1.0,
        min_p=0.0,
        min_tokens=0,
        use_beam_search=False,
        priority=0,
        include_stop_str_in_output=False,
        bad_words=[],
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        best_of=1,
        response_format={"type": "text"},
        logprob_token_ids=None,
        echo=False,
        user="u",
    )
    assert resp.status == 200, body
    sp = served.fake.submits[0].sampling
    assert sp.repetition_penalty == 1.0 and not sp.bad_words and not sp.logit_bias


async def test_max_tokens_absent_null_and_zero(serve, codec):
    """/v1/completions: absent is 16 (OpenAI's default), null is up to the context; 0 only with
    echo, where the prompt is scored and no token shown. Chat: absent is up to the context."""
    served = await serve(context_limit=64)
    n = len(codec.encode("Hello world"))
    for body, want in (({}, 16), ({"max_tokens": None}, 64 - n), ({"max_tokens": 0, "echo": True}, 1)):
        resp, out = await _post(served, prompt="Hello world", **body)
        assert resp.status == 200, out
        assert served.fake.submits[-1].max_tokens == want
    assert out["choices"][0]["text"] == "Hello world" and out["usage"]["completion_tokens"] == 0
    assert out["choices"][0]["finish_reason"] == "length"
    resp, out = await _post(served, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}])
    assert resp.status == 200, out
    sub = served.fake.submits[-1]
    assert sub.max_tokens == 64 - len(sub.prompt_ids)


async def test_echo_with_logprobs_streamed_and_not(serve, codec):
    """echo returns the prompt first, with its tokens' logprobs (null for the first token); the
    text offsets run over prompt and answer and are the same streamed or not."""
    served = await serve()
    ids = codec.encode("ab cd")
    resp, full = await _post(served, prompt="ab cd", max_tokens=2, echo=True, logprobs=1)
    choice = full["choices"][0]
    assert choice["text"] == "ab cd" + codec.decode(ids[:2])
    lp = choice["logprobs"]
    assert lp["tokens"] == [codec.decode([t]) for t in ids + ids[:2]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == [-1.0] * (len(ids) - 1)
    assert served.fake.submits[-1].prompt_logprobs == 1
    widths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(widths[:i]) for i in range(len(widths))]
    _, events = await _post(served, prompt="ab cd", max_tokens=2, echo=True, logprobs=1, stream=True)
    streamed = [e["choices"][0] for e in events[:-1] if e["choices"][0]["logprobs"]]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == lp["text_offset"]
    assert [t for c in streamed for t in c["logprobs"]["tokens"]] == lp["tokens"]


async def test_prompt_logprobs_field(serve, codec):
    """vLLM's prompt_logprobs: per choice, null then {token id: {logprob, rank, decoded_token}}."""
    served = await serve()
    ids = codec.encode("ab cd")
    _, out = await _post(served, prompt="ab cd", max_tokens=1, prompt_logprobs=1)
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[1] == {str(ids[1]): {"logprob": -1.0, "rank": 1, "decoded_token": codec.decode([ids[1]])}}
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["text"] == codec.decode(ids[:1])


async def test_logprobs_zero_is_the_sampled_tokens_own_entry(serve, codec):
    """logprobs 0 returns each token's own logprob in top_logprobs (vLLM), never null entries."""
    served = await serve()
    ids = codec.encode("ab cd")
    _, out = await _post(served, prompt="ab cd", max_tokens=len(ids), logprobs=0)
    lp = out["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{codec.decode([t]): -0.5} for t in ids]


async def test_stop_strings_and_stop_tokens_with_include_stop_str_in_output(serve, codec):
    """A stop string is cut (kept with include_stop_str_in_output); a stop token's text is not
    shown (shown with it)."""
    served = await serve()
    for include, want in ((False, "one"), (True, "one two")):
        _, out = await _post(
            served, prompt="one two three", max_tokens=20, stop=" two", include_stop_str_in_output=include
        )
        assert out["choices"][0]["text"] == want
    stop_id = codec.encode("one two three", add_special_tokens=False)[1]
    for include in (False, True):
        _, out = await _post(
            served, prompt="one two three", max_tokens=20, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["text"] == codec.decode(codec.encode("one two three")[: 2 + include])


async def test_min_tokens_holds_stop_strings_back(serve, codec):
    """No stop string ends a choice before it has more than min_tokens tokens (vLLM's rule)."""
    served = await serve()
    prompt = "one two one two one two one"
    _, out = await _post(served, prompt=prompt, max_tokens=30, stop=" two", min_tokens=4)
    text = out["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "stop" and text.count(" two") == 1 and text.startswith("one two")
    assert served.fake.submits[-1].sampling.min_tokens == 4


async def test_skip_special_tokens_false_shows_them(serve, codec):
    """skip_special_tokens false shows special tokens' text (default: hidden)."""
    special = min(codec.special_ids)
    text_ids = codec.encode("hi", add_special_tokens=False)
    fake = FakeGpu(script=lambda submit, index: itertools.cycle([special, *text_ids]))
    served = await serve(fake=fake)
    shown = codec.tokenizer.id_to_token(special)
    for skip, want in ((True, "hi"), (False, shown + "hi")):
        _, out = await _post(served, prompt="x", max_tokens=1 + len(text_ids), skip_special_tokens=skip)
        assert out["choices"][0]["text"] == want


async def test_the_eos_that_ends_a_sample_is_not_shown(serve, codec):
    """With special tokens shown, the EOS that ends a sample still is not (vLLM); under
    ignore_eos it is ordinary text."""
    eos = min(codec.special_ids)
    text_ids = codec.encode("hi", add_special_tokens=False)
    fake = FakeGpu(script=lambda submit, index: itertools.cycle([*text_ids, eos]), eos_token_ids=frozenset({eos}))
    served = await serve(fake=fake)  # the fake's status reports the fake's EOS ids
    _, out = await _post(served, prompt="x", max_tokens=10, skip_special_tokens=False)
    assert out["choices"][0] == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}
    _, out = await _post(served, prompt="x", max_tokens=len(text_ids) + 1, skip_special_tokens=False, ignore_eos=True)
    assert out["choices"][0]["text"] == "hi" + codec.tokenizer.id_to_token(eos)


async def test_truncate_prompt_tokens_and_add_special_tokens(serve, codec):
    """truncate_prompt_tokens keeps the last N tokens (truncation_side right: the first N);
    add_special_tokens false sends the text's own tokens only."""
    served = await serve(context_limit=64)
    text = "one two three four five six seven"
    ids = codec.encode(text)
    cases = [
        ({"truncate_prompt_tokens": 3}, ids[-3:]),
        ({"truncate_prompt_tokens": 3, "truncation_side": "right"}, ids[:3]),
        ({"truncate_prompt_tokens": -1}, ids),
        ({"add_special_tokens": False}, codec.encode(text, False)),
    ]
    for extra, want in cases:
        resp, out = await _post(served, prompt=text, max_tokens=1, **extra)
        assert resp.status == 200, out
        assert served.fake.submits[-1].prompt_ids == want
    resp, out = await _post(served, prompt_token_ids=list(range(5, 75)), max_tokens=4, truncate_prompt_tokens=10)
    assert resp.status == 200 and served.fake.submits[-1].prompt_ids == list(range(65, 75))
    resp, out = await _post(served, prompt="x " * 200, max_tokens=10, truncate_prompt_tokens=60)
    assert resp.status == 400 and out["error"]["code"] == "context_length_exceeded"
    resp, out = await _post(served, prompt="x", truncate_prompt_tokens=100)
    assert resp.status == 400 and out["error"]["param"] == "truncate_prompt_tokens"


async def test_return_tokens_as_token_ids_and_request_id(serve, codec):
    """return_tokens_as_token_ids names logprob tokens `token_id:<id>`; the body's request_id
    names the request when no x-request-id header does."""
    served = await serve()
    ids = codec.encode("ab")
    resp, out = await _post(
        served, prompt="ab", max_tokens=len(ids), logprobs=1, return_tokens_as_token_ids=True, request_id="my-batch-7"
    )
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["top_logprobs"][0] == {f"token_id:{ids[0]}": -0.5}
    assert out["id"] == resp.headers["x-request-id"] == "my-batch-7"


async def test_chat_prompt_logprobs_and_continuous_usage(serve):
    """Chat takes the same extras: prompt_logprobs on the body, continuous usage on every chunk."""
    served = await serve()
    resp, out = await _post(
        served, "/v1/chat/completions", max_tokens=2, prompt_logprobs=0, messages=[{"role": "user", "content": "Hi"}]
    )
    assert resp.status == 200 and out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) > 3
    _, events = await _post(
        served,
        "/v1/chat/completions",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        messages=[{"role": "user", "content": "Hi"}],
    )
    tokens = [e for e in events[:-1] if e["choices"] and "token_id" in e]
    assert [e["usage"]["completion_tokens"] for e in tokens] == [1, 2, 3]
