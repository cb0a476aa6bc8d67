"""Structured output and tool calling in the API worker, against the fake GPU: every spelling of a
constraint reaches the GPU as a grammar (none is ignored), conflicting ones are refused, tools are
rendered and forced choices constrained, and a tool-calling answer streams as `delta.tool_calls`
and answers as `message.tool_calls` with finish_reason tool_calls."""

from __future__ import annotations

import itertools
import json

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio

HELLO = [{"role": "user", "content": "Hello world"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _answer(codec, text: str, eot: int):
    ids = codec.encode(text, add_special_tokens=False) + [eot]
    return lambda submit, index: itertools.chain(ids, itertools.repeat(ids[0]))


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_every_spelling_becomes_the_same_grammar(serve, route):
    """response_format, structured_outputs and the guided_* fields all reach the GPU as a grammar;
    the same constraint spelled differently is the same grammar."""
    served = await serve()
    base = {"messages": HELLO} if "chat" in route else {"prompt": "Hi"}
    spellings = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"},
        {"structured_outputs": {"regex": "a+"}},
        {"guided_regex": "a+"},
        {"structured_outputs": {"choice": ["x", "y"]}},
        {"guided_choice": ["x", "y"]},
        {"structured_outputs": {"grammar": 'start: "a"+'}},
        {"guided_grammar": 'start: "a"+'},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True}},
    ]
    for body in spellings:
        resp = await served.client.post(route, json={**base, "max_tokens": 2, **body})
        assert resp.status == 200, (body, await resp.text())
    grammars = [s.sampling.grammar for s in served.fake.submits]
    assert all(grammars), "a constraint was ignored"
    assert len(set(grammars[:4])) == 1 and grammars[4] == grammars[5] and grammars[6] == grammars[7]
    assert grammars[8] == grammars[9] and grammars[10] == grammars[11] and len(set(grammars)) == 5


async def test_unconstrained_requests_have_no_grammar(serve):
    served = await serve()
    for body in ({}, {"response_format": {"type": "text"}}, {"response_format": None, "structured_outputs": None}):
        resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **body})
        assert resp.status == 200
    assert [s.sampling.grammar for s in served.fake.submits] == [None, None, None]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ],
)
async def test_conflicting_or_malformed_constraints_are_400(serve, tools_template, body, param):
    served = await serve(app_kw={"chat_template": tools_template})
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, **body})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["param"] == param, err
    assert served.fake.submits == []


async def test_tools_are_rendered_and_forced_choices_constrained(serve, codec, tools_template):
    """Tools reach the template; auto leaves the answer free, required and named constrain it,
    none drops the tools."""
    served = await serve(app_kw={"chat_template": tools_template})
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}, "none"):
        resp = await served.client.post(
            "/v1/chat/completions", json={"messages": HELLO, "tools": [TOOL], "tool_choice": choice, "max_tokens": 2}
        )
        assert resp.status == 200, await resp.text()
    auto, required, named, none = served.fake.submits
    assert "get_weather" in codec.decode(auto.prompt_ids, False) and "get_weather" not in codec.decode(
        none.prompt_ids, False
    )
    assert auto.sampling.grammar is None and none.sampling.grammar is None
    assert required.sampling.grammar and named.sampling.grammar and required.sampling.grammar != named.sampling.grammar


async def test_tools_need_a_template_that_renders_them(serve):
    served = await serve()  # the tiny model's own template knows no tools
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "tools": [TOOL]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools"


async def test_tool_call_answer_streams_and_answers_as_tool_calls(serve, codec, tools_template):
    """A hermes-style answer: content first, then the call as delta.tool_calls pieces (index, id,
    type and name first, then arguments), finish_reason tool_calls, no usage before the end."""
    eot = tools_template.end_of_turn_ids[0]
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    served = await serve(fake=FakeGpu(script=_answer(codec, text, eot)), app_kw={"chat_template": tools_template})
    body = {"messages": HELLO, "tools": [TOOL], "max_tokens": 60}
    resp = await served.client.post("/v1/chat/completions", json={**body, "stream": True})
    events = sse_events(await resp.read())
    chunks = [e for e in events[1:] if isinstance(e, dict) and e["choices"]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    pieces = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content.strip() == "Sure."
    assert pieces[0]["index"] == 0 and pieces[0]["id"].startswith("call_") and pieces[0]["type"] == "function"
    assert pieces[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("usage" in c for c in chunks)
    resp = await served.client.post("/v1/chat/completions", json=body)
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_history_with_tool_calls_developer_and_null_content_renders(serve, codec, tools_template):
    """An assistant's tool calls (content null, arguments as a JSON string) reach the template as
    objects, tool messages render, developer is system where the template has no developer role."""
    served = await serve(app_kw={"chat_template": tools_template})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "developer", "content": "Be brief."},
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    resp = await served.client.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": [TOOL], "max_tokens": 2, "store": True, "metadata": {"k": "v"}},
    )
    assert resp.status == 200, await resp.text()
    prompt = codec.decode(served.fake.submits[0].prompt_ids, False)
    assert "system\nBe brief." in prompt and "tool\nsunny" in prompt
    assert '"arguments": {"city": "Paris"}' in prompt


def _strict_json(text: str):
    """`text` read as JSON proper: NaN and Infinity refused, as any JSON parser but Python's does."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice, text",
    [
        ("required", '[{"name": "get_weather", "parameters": {"city": "\\ud800", "n": 1e999999, "m": 2.50}}]'),
        (
            "auto",
            '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800", "n": 1e999999, "m": 2.50}}</tool_call>',
        ),
    ],
)
async def test_tool_arguments_are_json_whatever_the_model_wrote(serve, codec, tools_template, choice, text, stream):
    """A lone surrogate escape and a number too large for a float, in a call's arguments: the
    answer is a 200 (streamed: events to [DONE]) whose arguments are the JSON the model wrote —
    not a 500 (the surrogate cannot be encoded once decoded), not `Infinity`, and `2.50` as written."""
    eot = tools_template.end_of_turn_ids[0]
    served = await serve(fake=FakeGpu(script=_answer(codec, text, eot)), app_kw={"chat_template": tools_template})
    body = {"messages": HELLO, "tools": [TOOL], "tool_choice": choice, "max_tokens": 120, "stream": stream}
    resp = await served.client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    if stream:
        events = sse_events(await resp.read())
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        pieces = [
            p
            for e in events[1:-1]
            if isinstance(e, dict) and e["choices"]
            for p in e["choices"][0]["delta"].get("tool_calls") or []
        ]
        arguments = "".join(p["function"].get("arguments") or "" for p in pieces)
    else:
        (call,) = (await resp.json())["choices"][0]["message"]["tool_calls"]
        arguments = call["function"]["arguments"]
    assert arguments == '{"city": "\\ud800", "n": 1e999999, "m": 2.50}'
    assert _strict_json(arguments)["city"] == "\ud800"


async def test_nan_in_an_auto_tool_call_is_no_call(serve, codec, tools_template):
    """`NaN` is not JSON: a <tool_call> block holding it is the model's text, not a call whose
    arguments a client could not parse."""
    eot = tools_template.end_of_turn_ids[0]
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>'
    served = await serve(fake=FakeGpu(script=_answer(codec, text, eot)), app_kw={"chat_template": tools_template})
    resp = await served.client.post("/v1/chat/completions", json={"messages": HELLO, "tools": [TOOL], "max_tokens": 80})
    message = (await resp.json())["choices"][0]["message"]
    assert resp.status == 200 and not message.get("tool_calls") and "NaN" in message["content"]
