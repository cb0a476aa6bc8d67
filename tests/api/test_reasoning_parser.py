"""`--reasoning-parser` (`api/chat/reasoning_parsers.py`): a reasoning model's `<think>` text as
`reasoning` / `reasoning_content` on chat (streamed and not), a `reasoning` item on /v1/responses,
tool calls read after the thinking, and a forced answer read as content. The fake GPU answers with
a scripted text in the tiny model's tokens, so each test knows what the model "thought"."""

from __future__ import annotations

import itertools
import json

import openai
import pytest

from ringserve.api.chat.reasoning_parsers import REASONING_PARSERS, ReasoningThenTools, ThinkSplitter
from ringserve.api.chat.tool_parsers import make_parser
from ringserve.api.fake_gpu import FakeGpu
from ringserve.config import Config, ConfigError
from tests.helpers.fake_api import MODEL
from tests.helpers.sse import sse_events

HI = [{"role": "user", "content": "hi"}]
THOUGHT = "The user greets me. I greet back."
ANSWER = "Hello there!"
THINK_THEN_CALL = (
    '<think>I need the weather.</think><tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
)
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def _split(parser: str, text: str, cut: int | None = None) -> tuple[str, str]:
    """(reasoning, content) of `text` fed whole, or in pieces of `cut` characters."""
    s = ThinkSplitter(parser)
    pieces = [text] if cut is None else [text[i : i + cut] for i in range(0, len(text), cut)]
    out = [p for piece in pieces for p in s.feed(piece)] + s.finish()
    for reasoning, text_piece in out:
        assert not reasoning or ("<think>" not in text_piece and "</think>" not in text_piece)
    return "".join(t for r, t in out if r), "".join(t for r, t in out if not r)


@pytest.mark.parametrize("cut", [None, 1, 2, 3, 5, 8])
def test_thinking_is_split_from_content_however_the_text_streams(cut):
    text = f"<think>{THOUGHT}</think>\n\n{ANSWER}"
    for parser in REASONING_PARSERS:
        assert _split(parser, text, cut) == (THOUGHT, f"\n\n{ANSWER}")
    # DeepSeek-R1's template opens the thinking in the prompt: no <think> in the answer
    assert _split("deepseek_r1", f"{THOUGHT}</think>{ANSWER}", cut) == (THOUGHT, ANSWER)
    assert _split("deepseek_r1", f"  <think>{THOUGHT}</think>{ANSWER}", cut) == (THOUGHT, ANSWER)
    # an answer that never closes its thinking: all thinking (deepseek_r1), all content (qwen3)
    assert _split("deepseek_r1", THOUGHT + " and </thi", cut) == (THOUGHT + " and </thi", "")
    assert _split("qwen3", ANSWER, cut) == ("", ANSWER)
    assert _split("qwen3", f"{ANSWER}</think>x", cut) == ("", f"{ANSWER}</think>x")
    assert _split("qwen3", "<thin", cut) == ("", "<thin")  # a lone prefix of the tag is text
    assert _split("qwen3", f"<think>{THOUGHT}", cut) == (THOUGHT, "")


def test_tool_calls_are_read_after_the_thinking():
    parser = ReasoningThenTools("qwen3", make_parser("hermes"))
    text = THINK_THEN_CALL
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    assert "".join(d.text for d in deltas if d.reasoning) == "I need the weather."
    assert [d.name for d in deltas if d.id is not None] == ["weather"]
    assert json.loads("".join(d.arguments for d in deltas if d.index is not None)) == {"city": "Oslo"}
    assert parser.called
    # a <tool_call> inside the thinking is thinking, not a call
    parser = ReasoningThenTools("qwen3", make_parser("hermes"))
    deltas = parser.feed('<think>maybe <tool_call>{"name": "weather"}</tool_call>?</think>No.') + parser.finish()
    assert not parser.called and "".join(d.text for d in deltas if not d.reasoning) == "No."


def test_the_config_names_every_parser_and_refuses_others():
    for parser in REASONING_PARSERS:
        Config(reasoning_parser=parser)
    with pytest.raises(ConfigError, match="reasoning_parser must be deepseek_r1 or qwen3"):
        Config(reasoning_parser="think")


def _script(codec, text: str, eot: int):
    ids = codec.encode(text, add_special_tokens=False) + [eot]
    return lambda submit, index: itertools.chain(ids, itertools.repeat(ids[0]))


@pytest.mark.asyncio
async def _served(serve, codec, chat_template, text: str, **config):
    eot = chat_template.end_of_turn_ids[0]
    return await serve(fake=FakeGpu(script=_script(codec, text, eot)), **config)


@pytest.mark.asyncio
async def test_chat_answers_reasoning_and_content_streamed_and_not(serve, codec, chat_template):
    served = await _served(serve, codec, chat_template, f"<think>{THOUGHT}</think>{ANSWER}", reasoning_parser="qwen3")
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 60})
    message = (await resp.json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT, "reasoning_content": THOUGHT}
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 60, "stream": True})
    events = sse_events(await resp.read())
    deltas = [e["choices"][0]["delta"] for e in events[1:-1] if e["choices"]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == THOUGHT == "".join(d.get("reasoning_content", "") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning" not in d for d in deltas[first_content:])  # thinking comes first
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.asyncio
async def test_without_the_parser_the_tags_are_content(serve, codec, chat_template):
    text = f"<think>{THOUGHT}</think>{ANSWER}"
    served = await _served(serve, codec, chat_template, text)
    resp = await served.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 60})
    message = (await resp.json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}


@pytest.mark.asyncio
async def test_an_answer_a_grammar_forces_is_content(serve, codec, chat_template):
    """A forced answer has no thinking (the grammar applies from its first token): the parser
    stays off, so no grammar-shaped JSON is ever taken for thinking."""
    text = '{"a": 1}'
    served = await _served(serve, codec, chat_template, text, reasoning_parser="deepseek_r1")
    body = {"messages": HI, "max_tokens": 60, "response_format": {"type": "json_object"}}
    resp = await served.client.post("/v1/chat/completions", json=body)
    message = (await resp.json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": text}


@pytest.mark.asyncio
async def test_tools_after_thinking_through_the_openai_sdk(serve, codec, tools_template):
    """The openai SDK, streamed (its accumulator) and not: the thinking, then the call."""
    text = THINK_THEN_CALL
    eot = tools_template.end_of_turn_ids[0]
    served = await serve(
        fake=FakeGpu(script=_script(codec, text, eot)),
        app_kw={"chat_template": tools_template},
        reasoning_parser="qwen3",
    )
    client = openai.AsyncOpenAI(base_url=str(served.client.make_url("/v1")), api_key="x", max_retries=0)
    kw = {"model": MODEL, "messages": HI, "tools": [WEATHER], "max_tokens": 80, "reasoning_effort": "low"}
    done = await client.chat.completions.create(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == "I need the weather."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    reasoning, calls = "", {}
    async for chunk in await client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            for call in c.delta.tool_calls or ():
                calls.setdefault(call.index, "")
                calls[call.index] += call.function.arguments or ""
    assert reasoning == "I need the weather." and json.loads(calls[0]) == {"city": "Oslo"}
    await client.close()


@pytest.mark.asyncio
async def test_responses_has_a_reasoning_item_streamed_and_not(serve, codec, chat_template):
    served = await _served(serve, codec, chat_template, f"{THOUGHT}</think>{ANSWER}", reasoning_parser="deepseek_r1")
    client = openai.AsyncOpenAI(base_url=str(served.client.make_url("/v1")), api_key="x", max_retries=0)
    done = await client.responses.create(model=MODEL, input="hi", max_output_tokens=60, reasoning={"effort": "low"})
    assert [i.type for i in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == THOUGHT and done.output[0].summary == []
    assert done.output_text == ANSWER
    # the reasoning item goes back as input (as agents resend a response's output): accepted
    again = await client.responses.create(
        model=MODEL, input=[*done.model_dump()["output"], {"role": "user", "content": "more"}], max_output_tokens=4
    )
    assert again.status in ("completed", "incomplete")
    follow = await client.responses.create(model=MODEL, input="more", previous_response_id=done.id, max_output_tokens=4)
    assert follow.status in ("completed", "incomplete")
    kinds, text = [], ""
    async with client.responses.stream(model=MODEL, input="hi", max_output_tokens=60) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert text == THOUGHT and final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    await client.close()
