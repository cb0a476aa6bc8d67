"""/v1/responses against the real model (SmolLM2, the session's 2-worker server) through the
clients that call it by default: the openai SDK (`responses.create` plain and streamed with its
event helpers, a function tool round trip, `text.format` json_schema, `responses.parse`),
openai-agents' default `OpenAIResponsesModel`, LangChain's `ChatOpenAI(use_responses_api=True)`;
and stored responses continued with `previous_response_id` from either worker, private to their
key. Nothing here reaches the network (the agents SDK's tracing and LangSmith are off).

A 135M model does not call tools by itself: the round trips force the first call with
`tool_choice: required` (as the clients allow) and let the model answer freely after the tool's
result, as tests/test_structured_e2e.py does on the chat route.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from tests.helpers.responses_events import check_event_order, response_events

MODEL = "smollm2-135m-instruct"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
ASK = "What is the weather in Paris?"


def _client(server, key: str = "key-a"):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _worker_of(request_id: str) -> int:
    """The API worker that served a request, from its generated id (`cmpl-<worker>-...`)."""
    return int(request_id.split("-")[1])


def test_create_plain_and_streamed_with_the_sdk_helpers(smollm2_server):
    """`responses.create` answers a message; `responses.stream` (the SDK's event helpers and
    accumulator) gives the same text, and the raw stream passes the structural order check."""
    client = _client(smollm2_server)
    kwargs = dict(model=MODEL, input="What is the capital of France?", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    deltas = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == whole.output_text
    raw = httpx.post(smollm2_server.url + "/v1/responses", json={**kwargs, "stream": True}, timeout=60)
    items = check_event_order(response_events(raw.content))
    assert items[0]["content"][0]["text"] == whole.output_text


def test_function_tool_round_trip_through_function_call_output(smollm2_server):
    """A forced call of a function tool, its result sent back as a function_call_output item with
    the call's items, and the model's answer; both streams pass the order check."""
    client = _client(smollm2_server)
    first = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}
    history = [
        {"role": "user", "content": ASK},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 degrees and sunny"},
    ]
    final = client.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=40, temperature=0)
    assert final.output_text and final.output[0].type == "message"
    for body in (
        {"input": ASK, "tools": [WEATHER], "tool_choice": "required"},
        {"input": history, "tools": [WEATHER]},
    ):
        raw = httpx.post(
            smollm2_server.url + "/v1/responses",
            json={"model": MODEL, "max_output_tokens": 40, "temperature": 0, "stream": True, **body},
            timeout=60,
        )
        check_event_order(response_events(raw.content))


def test_text_format_json_schema_and_parse_with_pydantic(smollm2_server):
    """text.format json_schema gives JSON that validates; `responses.parse(text_format=Model)`
    returns an instance of the model."""
    import jsonschema
    from pydantic import BaseModel, Field

    client = _client(smollm2_server)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "coastal": {"type": "boolean"}},
        "required": ["city", "coastal"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population_millions: int = Field(ge=0, le=99)

    parsed = client.responses.parse(
        model=MODEL, input="Describe Paris as JSON.", text_format=City, max_output_tokens=80, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


def test_previous_response_id_from_either_worker_and_private_to_its_key(smollm2_server):
    """A stored response is continued by requests that land on the other worker too (new
    connections, SO_REUSEPORT spreads them); another key can neither read nor continue it."""
    url = smollm2_server.url + "/v1/responses"
    key_a = {"Authorization": "Bearer key-a"}
    first = httpx.post(
        url, json={"model": MODEL, "input": "My name is Ada.", "max_output_tokens": 8}, headers=key_a, timeout=60
    )
    assert first.status_code == 200, first.text
    stored_by = _worker_of(first.headers["x-request-id"])
    rid = first.json()["id"]
    served_by = set()
    for _ in range(24):  # each on a new connection; P(24 on one worker) = 2^-23
        with httpx.Client(timeout=60) as fresh:
            got = fresh.get(f"{url}/{rid}", headers=key_a)
            assert got.status_code == 200 and got.json()["id"] == rid
            more = fresh.post(
                url,
                json={"model": MODEL, "input": "What is my name?", "previous_response_id": rid, "max_output_tokens": 2},
                headers=key_a,
            )
        assert more.status_code == 200, more.text
        assert more.json()["previous_response_id"] == rid
        served_by.add(_worker_of(more.headers["x-request-id"]))
        if served_by - {stored_by}:
            break
    assert served_by - {stored_by}, "no continuation reached the other worker"
    other = _client(smollm2_server, "key-b")
    from openai import NotFoundError

    with pytest.raises(NotFoundError):
        other.responses.retrieve(rid)
    with pytest.raises(NotFoundError):
        other.responses.create(model=MODEL, input="What is my name?", previous_response_id=rid, max_output_tokens=2)
    continued = _client(smollm2_server).responses.create(
        model=MODEL, input="What is my name?", previous_response_id=rid, max_output_tokens=2
    )
    assert continued.usage.input_tokens > first.json()["usage"]["input_tokens"]  # the history is in the prompt


def test_openai_agents_default_responses_model_runs_a_tool_agent(smollm2_server):
    """openai-agents' default model (OpenAIResponsesModel, from its OpenAI provider) runs an agent
    with one function tool: called (forced on the first turn), its result fed back as a
    function_call_output, a final answer."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"22 degrees and sunny in {city}"

    provider = OpenAIProvider(
        openai_client=AsyncOpenAI(base_url=smollm2_server.url + "/v1", api_key="key-a", max_retries=0)
    )
    assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[weather],
        model=MODEL,
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )
    result = asyncio.run(Runner.run(agent, ASK, max_turns=4, run_config=RunConfig(model_provider=provider)))
    assert calls and isinstance(result.final_output, str) and result.final_output


def test_langchain_use_responses_api_invoke_and_stream(smollm2_server):
    """ChatOpenAI(use_responses_api=True): invoke answers, and the streamed chunks add up to the
    same text and usage."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=smollm2_server.url + "/v1",
        api_key="key-a",
        temperature=0,
        max_tokens=24,
        max_retries=0,
        use_responses_api=True,
    )
    whole = llm.invoke("Name a colour.")
    assert whole.text and whole.response_metadata["id"].startswith("resp_")
    total = None
    for chunk in llm.stream("Name a colour."):
        total = chunk if total is None else total + chunk
    assert total is not None and total.text == whole.text
    assert total.usage_metadata["total_tokens"] == whole.usage_metadata["total_tokens"]


def test_reasoning_settings_as_codex_and_reasoning_setups_send_them(smollm2_server):
    """The openai SDK with `reasoning_effort` on chat and `reasoning` on Responses (Codex CLI sends
    `{"effort", "summary"}` on every request): answered; SmolLM2's template reads neither, so both
    are named as ignored (`api/chat/reasoning.py`)."""
    client = _client(smollm2_server)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, reasoning_effort="low"
    )
    assert raw.headers["x-ringserve-ignored-fields"] == "reasoning_effort"
    assert raw.parse().choices[0].message.content is not None
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=4, reasoning={"effort": "medium", "summary": "auto"}
    )
    assert raw.headers["x-ringserve-ignored-fields"] == "reasoning.effort, reasoning.summary"
    answer = raw.parse()
    assert answer.output_text is not None and answer.reasoning.effort == "medium"
