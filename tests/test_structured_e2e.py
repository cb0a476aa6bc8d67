"""Structured output and tool calling against the real model (SmolLM2), through the clients agent
frameworks are built on: the openai SDK (`parse()`, its stream helpers), LangChain
(`with_structured_output` by all three methods, `bind_tools`, `stream_usage`), litellm with tools
and an openai-agents agent with one function tool. The server is the session's SmolLM2 server
(`smollm2_server`, on loopback); nothing here reaches the network: LangSmith, litellm's model
price map and the agents SDK's tracing are all kept local.

A 135M model does not call tools by itself, so the round trips force the first call
(`tool_choice: required`, as the clients allow) and let the model answer freely after the tool's
result; `auto` parsing is covered on the model's real output where it calls, and by the parser
tests (tests/api/test_tool_parsers.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

MODEL = "smollm2-135m-instruct"
# kept local whatever the environment says (set before any of these clients is imported)
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _async_client(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _validate(instance, schema) -> None:
    import jsonschema

    jsonschema.validate(instance, schema)


# -- structured output ---------------------------------------------------------------------------


def test_openai_parse_returns_a_valid_pydantic_instance(smollm2_server):
    """`client.chat.completions.parse(response_format=PydanticModel)` gets an instance back."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=99)
        capital: bool

    out = _client(smollm2_server).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "coastal": {"type": "boolean"},
        },
        "required": ["city", "country", "coastal"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"type": "string", "enum": ["low", "high"]}, "score": {"type": "number"}},
        "required": ["level"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}, "required": ["id"]},
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
        "required": ["value"],
    },
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 30}, "year": {"type": "integer"}},
        "required": ["title", "year"],
        "additionalProperties": False,
        "$defs": {},
    },
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99, "minimum": 0}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["north", "south", "east", "west"]}, "minItems": 1, "maxItems": 2},
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
            "currency": {"const": "EUR"},
        },
        "required": ["price", "currency"],
        "additionalProperties": False,
    },
]


def test_json_schema_output_validates_for_20_schemas(smollm2_server):
    """20 schemas (nested objects, arrays, enums, required fields, number ranges, $refs, formats),
    sent at once as `response_format: json_schema`: every answer parses and validates."""
    assert len(SCHEMAS) == 20
    client = _async_client(smollm2_server)

    async def one(i: int, schema: dict):
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Answer in JSON (example {i})."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
            max_tokens=120,
            temperature=0.7,
            seed=i,
        )

    async def main():
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))

    for schema, out in zip(SCHEMAS, asyncio.run(main())):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        _validate(json.loads(choice.message.content), schema)


def test_choice_regex_and_grammar_outputs_match(smollm2_server):
    """`choice`, `regex` and `grammar` by every spelling: vLLM's `structured_outputs` on both
    routes, and the older `guided_*` fields, which are honoured, not ignored."""
    client = _client(smollm2_server)
    ask = [{"role": "user", "content": "Is the sky blue?"}]
    cases = [
        ("chat", {"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ("chat", {"guided_choice": ["red", "green", "blue"]}, r"red|green|blue"),
        ("chat", {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ("chat", {"guided_regex": r"(cat|dog)s?"}, r"(cat|dog)s?"),
        ("completions", {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}"}}, r"[A-Z][a-z]{2,8}"),
        ("completions", {"guided_choice": ["Paris", "Lyon"]}, r"Paris|Lyon"),
        ("completions", {"guided_json": {"type": "integer", "minimum": 0, "maximum": 99}}, r"[0-9]{1,2}"),
        ("chat", {"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "."'}}, r"a[bc]+\."),
        ("completions", {"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, r"x[0-9]{2}"),
        ("chat", {"structured_outputs": {"json_object": True}}, r"\{.*\}"),
    ]
    for route, extra, pattern in cases:
        if route == "chat":
            out = client.chat.completions.create(
                model=MODEL, messages=ask, max_tokens=24, temperature=0, extra_body=extra
            )
            text, reason = out.choices[0].message.content, out.choices[0].finish_reason
        else:
            out = client.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, extra_body=extra
            )
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert reason == "stop" and re.fullmatch(pattern, text, re.S), (extra, text, reason)


def test_max_tokens_cutting_the_structure_is_length(smollm2_server):
    """A structure that max_tokens cuts short ends with finish_reason length."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 30}
    out = _client(smollm2_server).chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        max_tokens=6,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "long", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "body, param, construct",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "format": "ipv9"}},
                }
            },
            "response_format.json_schema.schema",
            "ipv9",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "unclosed group"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
            "guided_json",
            "missing",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "structural_tag"),
    ],
)
def test_unsupported_schema_or_grammar_is_400_naming_the_construct(smollm2_server, body, param, construct):
    """Fail closed: a constraint llguidance cannot enforce is a 400 that names it, never free text."""
    import httpx

    resp = httpx.post(
        smollm2_server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and construct in err["message"], err


@pytest.mark.parametrize(
    "extra_body, param, says",
    [
        ({"guided_grammar": 'start: a\na: "x" a\n'}, "guided_grammar", "admits no text"),
        ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs.regex", "admits no text"),
    ],
)
def test_a_grammar_that_admits_nothing_is_400_through_the_openai_client(smollm2_server, extra_body, param, says):
    """Grammars whose language is empty are the documented 400, as the openai client raises it
    (they were a 200 with finish_reason stop and an empty or cut answer)."""
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        _client(smollm2_server).chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, max_tokens=8, extra_body=extra_body
        )
    err = caught.value.body
    assert err["param"] == param and says in err["message"] and err["code"] == "unsupported_value", err


def test_a_5000_rule_gbnf_is_refused_at_once_while_health_answers(smollm2_server):
    """The issue's 172 KB GBNF grammar (and the 450-pattern schema): 400 grammar_too_complex in
    well under a second, /health answering meanwhile; the server then serves a constrained request
    as before (its worker was not restarted under it)."""
    import concurrent.futures
    import time

    import httpx

    from tests.helpers.grammars import gbnf_chain, pattern_schema

    def health_latencies(stop) -> list[float]:
        out = []
        while not stop.is_set():
            t0 = time.monotonic()
            assert httpx.get(smollm2_server.url + "/health", timeout=10).status_code == 200
            out.append(time.monotonic() - t0)
            time.sleep(0.05)
        return out

    import threading

    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        probe = pool.submit(health_latencies, stop)
        answers = []
        for body in ({"guided_grammar": gbnf_chain(5000)}, {"guided_json": pattern_schema(450)}):
            t0 = time.monotonic()
            resp = httpx.post(
                smollm2_server.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 4, **body},
                timeout=60,
            )
            answers.append((resp.status_code, resp.json()["error"]["code"], time.monotonic() - t0))
        time.sleep(0.3)
        stop.set()
        latencies = probe.result()
    assert all(status == 400 and code == "grammar_too_complex" and took < 2.0 for status, code, took in answers)
    assert latencies and max(latencies) < 1.0, latencies
    done = _client(smollm2_server).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert done.choices[0].message.content in ("yes", "no")


# -- tool calling --------------------------------------------------------------------------------


def test_tool_choice_required_and_named_give_valid_arguments(smollm2_server):
    """`required` and a named function are forced with a grammar: a call of a listed tool whose
    arguments validate against its parameters, finish_reason tool_calls."""
    client = _client(smollm2_server)
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=tools, tool_choice=choice, max_tokens=60, temperature=0
        )
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            _validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_equals_the_non_streamed_one(smollm2_server):
    """The openai SDK's own stream helpers accumulate the streamed `delta.tool_calls` into the same
    call the non-streamed request returns; the first piece of a call carries index, id, type and
    name."""
    client = _client(smollm2_server)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=60)
        whole = client.chat.completions.create(**kwargs, temperature=0).choices[0]
        firsts = []
        with client.chat.completions.stream(**kwargs, temperature=0) as stream:
            for event in stream:
                if event.type == "chunk" and event.chunk.choices and event.chunk.choices[0].delta.tool_calls:
                    piece = event.chunk.choices[0].delta.tool_calls[0]
                    if piece.id is not None:
                        firsts.append(piece)
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == whole.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        assert [(p.index, p.type, p.function.name) for p in firsts] == [
            (i, "function", c.function.name) for i, c in enumerate(whole.message.tool_calls)
        ]


def test_auto_tool_choice_streams_what_the_model_wrote(smollm2_server):
    """With tools and tool_choice auto the model answers freely and the parser reads it: here it
    writes tool-like markup that is no call (SmolLM2 does not call tools by itself), which streams
    as the same content the non-streamed answer has."""
    history = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"},
        {"role": "assistant", "content": "It is 20 degrees in Rome."},
        {"role": "user", "content": "What is the weather in London?"},
    ]
    client = _client(smollm2_server)
    kwargs = dict(model=MODEL, messages=history, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    text = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
    )
    assert whole.message.tool_calls is None and whole.finish_reason in ("stop", "length")
    assert text == whole.message.content and text


def test_tool_history_and_the_openai_chat_surface_render(smollm2_server):
    """A history with an assistant's tool calls (content null) and the tool's answer, a developer
    message, `metadata` and `store`: accepted and answered."""
    out = _client(smollm2_server).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "You answer briefly."},
            *ASK_WEATHER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=30,
        temperature=0,
        metadata={"app": "test"},
        store=True,
    )
    assert out.choices[0].message.content and out.usage.prompt_tokens > 100


# -- LangChain, litellm, openai-agents -----------------------------------------------------------


def _langchain(server, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=80, max_retries=0, **kw
    )


def test_langchain_with_structured_output_all_three_methods(smollm2_server):
    """`with_structured_output` by json_schema (its default), function_calling and json_mode."""
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=20)
        degrees: int = Field(ge=-30, le=50)

    llm = _langchain(smollm2_server)
    ask = "What is the weather in Paris? Answer in JSON."
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Weather, method=method).invoke(ask)
        assert isinstance(got, Weather), (method, got)
    # json_mode is any JSON object: the prompt says which (a 135M model rambles on otherwise)
    got = llm.with_structured_output(None, method="json_mode").invoke(
        'Give the weather in Paris as JSON like {"city": "Rome", "degrees": 20}.'
    )
    assert isinstance(got, dict) and got, got


def test_langchain_stream_usage_is_counted_once(smollm2_server):
    """`stream_usage=True` sums every chunk's usage: the stream's total equals the request's."""
    llm = _langchain(smollm2_server, stream_usage=True)
    whole = llm.invoke("Name a colour.")
    total = None
    for chunk in llm.stream("Name a colour."):
        total = chunk if total is None else total + chunk
    assert total is not None and total.usage_metadata == whole.usage_metadata


def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city."""
    return f"22 degrees {unit} and sunny in {city}"


def test_langchain_bind_tools_round_trip(smollm2_server):
    """bind_tools: the model calls the tool, its result goes back, the model answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _langchain(smollm2_server)
    history = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([weather], tool_choice="required").invoke(history)
    assert first.tool_calls and first.tool_calls[0]["name"] == "get_weather"
    call = first.tool_calls[0]
    history += [first, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([weather]).invoke(history)
    assert final.content and not final.tool_calls


def test_litellm_with_tools_round_trip(smollm2_server):
    """litellm (as an OpenAI-compatible provider): a tool call, the result back, an answer."""
    import litellm

    litellm.telemetry = False
    args = dict(model=f"openai/{MODEL}", api_base=smollm2_server.url + "/v1", api_key="unused", max_tokens=60)
    messages = list(ASK_WEATHER)
    first = litellm.completion(messages=messages, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, **args)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
    result = get_weather(**json.loads(call.function.arguments))
    messages += [first.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = litellm.completion(messages=messages, tools=[WEATHER_TOOL], temperature=0, **args)
    assert final.choices[0].message.content


def test_openai_agents_agent_with_one_function_tool(smollm2_server):
    """An openai-agents Agent with one function tool: called, its result fed back, a final answer
    (the SDK resets tool_choice after the forced call, so the model then answers)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=_async_client(smollm2_server)),
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls and isinstance(result.final_output, str) and result.final_output
