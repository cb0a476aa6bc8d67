"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the anthropic
SDK, on the fake GPU with scripted answers in the tiny model's tokens: the prompt the conversation
becomes, create and stream (the SDK's accumulator), tools round trip, thinking, stop sequences,
x-api-key tenants, and Anthropic-shaped errors."""

from __future__ import annotations

import itertools
import json

import anthropic
import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.fake_api import MODEL

pytestmark = pytest.mark.asyncio

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _script(codec, text: str, eot: int):
    ids = codec.encode(text, add_special_tokens=False) + [eot]
    return lambda submit, index: itertools.chain(ids, itertools.repeat(ids[0]))


async def _client(serve, codec, template, text: str, **config):
    served = await serve(
        fake=FakeGpu(script=_script(codec, text, template.end_of_turn_ids[0])),
        app_kw={"chat_template": template},
        **config,
    )
    client = anthropic.AsyncAnthropic(base_url=str(served.client.make_url("")), api_key="key-a", max_retries=0)
    return served, client


def _answer_tokens(codec) -> int:  # noqa: N802 - "Hello there!" and the end of turn
    return len(codec.encode("Hello there!", add_special_tokens=False)) + 1


def _prompt(served, codec) -> str:
    return codec.decode(served.fake.submits[-1].prompt_ids, False)


async def test_create_and_stream_answer_text(serve, codec, chat_template):
    served, client = await _client(serve, codec, chat_template, "Hello there!")
    msg = await client.messages.create(model=MODEL, max_tokens=40, system="Be brief.", messages=HI)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello there!")]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens == len(
        served.fake.submits[-1].prompt_ids
    ) and msg.usage.output_tokens == _answer_tokens(codec)
    assert _prompt(served, codec) == chat_template.render([{"role": "system", "content": "Be brief."}, *HI])
    kinds = []
    async with client.messages.stream(model=MODEL, max_tokens=40, messages=HI) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    assert final.content[0].text == "Hello there!" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == _answer_tokens(codec)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    await client.close()


async def test_max_tokens_and_stop_sequences(serve, codec, chat_template):
    served, client = await _client(serve, codec, chat_template, "one two three four five")
    msg = await client.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2
    msg = await client.messages.create(model=MODEL, max_tokens=40, messages=HI, stop_sequences=["three"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "three"
    assert msg.content[0].text == "one two "
    async with client.messages.stream(model=MODEL, max_tokens=40, messages=HI, stop_sequences=["four"]) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "four"
    await client.close()


async def test_a_tool_round_trip(serve, codec, tools_template):
    """The model calls the tool (create and stream), the client sends the tool_use and its
    tool_result back, and the prompt holds both as the template renders calls and tool messages."""
    served, client = await _client(serve, codec, tools_template, CALL)
    msg = await client.messages.create(model=MODEL, max_tokens=60, messages=HI, tools=[WEATHER])
    assert msg.stop_reason == "tool_use"
    (use,) = msg.content
    assert use.type == "tool_use" and use.name == "weather" and use.input == {"city": "Oslo"}
    assert use.id.startswith("toolu_")
    async with client.messages.stream(model=MODEL, max_tokens=60, messages=HI, tools=[WEATHER]) as stream:
        partial = [e.partial_json async for e in stream if e.type == "input_json"]
        final = await stream.get_final_message()
    assert json.loads("".join(partial)) == {"city": "Oslo"} and final.content[0].input == {"city": "Oslo"}
    turns = [
        *HI,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]
    again = await client.messages.create(model=MODEL, max_tokens=60, messages=turns, tools=[WEATHER])
    assert again.stop_reason == "tool_use"
    prompt = _prompt(served, codec)
    assert '"city": "Oslo"' in prompt and "tool\nSunny, 21 C" in prompt and '"name": "weather"' in prompt
    # a forced tool: tool_choice any and a named tool reach the grammar-forced path
    for choice in ({"type": "any"}, {"type": "tool", "name": "weather"}):
        resp = await served.client.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 8, "messages": HI, "tools": [WEATHER], "tool_choice": choice},
        )
        assert resp.status == 200, await resp.text()
        assert served.fake.submits[-1].sampling.grammar is not None
    await client.close()


async def test_thinking_comes_back_as_a_thinking_block(serve, codec, chat_template):
    served, client = await _client(
        serve, codec, chat_template, "<think>A greeting.</think>Hello!", reasoning_parser="qwen3"
    )
    msg = await client.messages.create(model=MODEL, max_tokens=40, messages=HI)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "A greeting." and msg.content[1].text == "Hello!"
    async with client.messages.stream(model=MODEL, max_tokens=40, messages=HI) as stream:
        final = await stream.get_final_message()
    assert final.content[0].thinking == "A greeting." and final.content[1].text == "Hello!"
    # the thinking block goes back in the history and is left out of the prompt
    turns = [
        *HI,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": "ok"},
    ]
    await client.messages.create(model=MODEL, max_tokens=4, messages=turns)
    assert "A greeting." not in _prompt(served, codec) and "Hello!" in _prompt(served, codec)
    await client.close()


async def test_count_tokens_is_the_prompt_length(serve, codec, chat_template):
    served, client = await _client(serve, codec, chat_template, "x")
    count = await client.messages.count_tokens(model=MODEL, messages=HI, system="Be brief.")
    text = chat_template.render([{"role": "system", "content": "Be brief."}, *HI])
    assert count.input_tokens == len(codec.encode(text, add_special_tokens=False))
    assert not served.fake.submits  # counting submits nothing
    await client.close()


async def test_x_api_key_is_the_key_and_errors_are_anthropic_shaped(serve, codec, chat_template):
    served = await serve(
        fake=FakeGpu(script=_script(codec, "Hi", chat_template.end_of_turn_ids[0])), keys=frozenset({"key-a"})
    )
    url = str(served.client.make_url(""))
    good = anthropic.AsyncAnthropic(base_url=url, api_key="key-a", max_retries=0)
    assert (await good.messages.create(model=MODEL, max_tokens=4, messages=HI)).content[0].text == "Hi"
    bad = anthropic.AsyncAnthropic(base_url=url, api_key="key-b", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        await bad.messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    cases = [
        ({"messages": HI}, "max_tokens is required"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        ({"max_tokens": 4, "messages": HI, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"max_tokens": 0, "messages": HI}, "max_tokens"),
    ]
    for body, says in cases:
        resp = await served.client.post("/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": "key-a"})
        payload = await resp.json()
        assert resp.status == 400 and payload["type"] == "error", payload
        assert payload["error"]["type"] == "invalid_request_error" and says in payload["error"]["message"], payload
    # a server tool is left out (ringserve runs none) and named as ignored
    resp = await served.client.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 2, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "w"}]},
        headers={"x-api-key": "key-a"},
    )
    assert resp.status == 200 and "tools[0]" in resp.headers["x-ringserve-ignored-fields"]
    with pytest.raises(anthropic.NotFoundError):
        await good.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HI)
    await good.close()
    await bad.close()


async def test_what_claude_code_sends_is_served(serve, codec, chat_template):
    """Claude Code's shape: a fixed max_tokens of 32,000 whatever the context (a cap, held to the
    room the context and --max-tokens-limit leave), system reminders between the turns, adaptive
    thinking, and fields of its betas (named as ignored)."""
    served, client = await _client(serve, codec, chat_template, "one two three " * 120, context_limit=256)
    turns = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Remember the rules."}]
    resp = await served.client.post(
        "/v1/messages?beta=true",
        json={
            "model": MODEL,
            "max_tokens": 32000,
            "messages": turns,
            "system": [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "adaptive", "display": "omitted"},
            "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u"},
        },
        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"},
    )
    body = await resp.json()
    assert resp.status == 200, body
    prompt_tokens = len(served.fake.submits[-1].prompt_ids)
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 256 - prompt_tokens
    assert {"output_config", "context_management"} <= {
        f.strip() for f in resp.headers["x-ringserve-ignored-fields"].split(",")
    }
    assert _prompt(served, codec).endswith(
        chat_template.render(
            [
                {"role": "system", "content": "You are an agent."},
                *[{"role": t["role"], "content": t["content"]} for t in turns],
            ]
        )[-40:]
    )
    served, client = await _client(serve, codec, chat_template, "one two three " * 120, max_tokens_limit=5)
    async with client.messages.stream(model=MODEL, max_tokens=32000, messages=HI) as stream:  # the SDK streams so
        msg = await stream.get_final_message()
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    await client.close()


async def test_a_prompt_over_the_context_is_a_clear_error(serve, codec, chat_template):
    served, client = await _client(serve, codec, chat_template, "x", context_limit=64)
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "word " * 200}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    message = err.value.body["error"]["message"]
    # max_tokens is a cap here: the message must not blame it or quote it
    assert "context limit of 64 tokens" in message and "max_tokens" not in message, message
    await client.close()
