"""/v1/messages against the real model (SmolLM2, the session's 2-worker server) through the
anthropic SDK: create and stream (the SDK's accumulator), a tool round trip, count_tokens equal to
the prompt the message was answered for, and a conversation past the context (a coding agent's
system prompt and tool schemas are tens of thousands of tokens) answered at once with Anthropic's
error. A 135M model does not call tools by itself: the round trip forces the first call with
`tool_choice: any`, as tests/test_responses_e2e.py does with `required`."""

from __future__ import annotations

import anthropic
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="key-a", max_retries=0)


def test_create_stream_and_count_tokens(smollm2_server):
    client = _client(smollm2_server)
    # NOTE: greedy; the SDK (2.x) no longer takes temperature as an argument, the API still does
    kw = dict(model=MODEL, max_tokens=24, extra_body=GREEDY, system="Answer briefly.", messages=ASK)
    msg = client.messages.create(**kw)
    assert msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 24
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == msg.content[0].text  # greedy: the same answer
    count = client.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=ASK)
    assert count.input_tokens == msg.usage.input_tokens


def test_tool_round_trip(smollm2_server):
    client = _client(smollm2_server)
    msg = client.messages.create(
        model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    )
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    turns = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]
    with client.messages.stream(
        model=MODEL, max_tokens=40, extra_body=GREEDY, messages=turns, tools=[WEATHER]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content


def test_a_conversation_past_the_context_is_answered_at_once_with_the_limit(smollm2_server):
    client = _client(smollm2_server)
    tools = [{**WEATHER, "name": f"tool_{i}", "description": "A tool of a coding agent. " * 200} for i in range(12)]
    with pytest.raises(anthropic.BadRequestError) as err:  # streamed, as the SDK has a 32,000-token answer sent
        with client.messages.stream(
            model=MODEL, max_tokens=32000, messages=ASK, tools=tools, system="You are an agent."
        ):
            pass
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    # max_tokens is a cap here (Claude Code sends 32,000 whatever the model): the prompt alone is over
    assert "context limit of 8192 tokens" in message and "max_tokens" not in message, message
