"""/v1/responses in the API worker, against the fake GPU: the translation onto the chat route (input
items, instructions, tools, text.format become the chat prompt and grammar), the response object
and the typed stream events in order for text, tool-call, incomplete, cancelled and failure
answers, stored responses per tenant, and the fields refused or ignored."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.responses_events import check_event_order, response_events

pytestmark = pytest.mark.asyncio

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL_TEXT = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}


def _answer(codec, text: str, eot: int):
    """A fake-GPU script: `text`, then the end-of-turn token."""
    ids = codec.encode(text, add_special_tokens=False) + [eot]
    return lambda submit, index: itertools.chain(ids, itertools.repeat(ids[0]))


async def _served(serve, codec, template, text: str, **kw):
    fake = FakeGpu(script=_answer(codec, text, template.end_of_turn_ids[0]), **kw)
    return await serve(fake=fake, app_kw={"chat_template": template})


def _prompt(served, codec, i: int = -1) -> str:
    return codec.decode(served.fake.submits[i].prompt_ids, False)


def _shape(items: list[dict]) -> list[tuple]:
    """Items without their generated ids."""
    return [
        ("message", i["content"][0]["text"]) if i["type"] == "message" else ("call", i["name"], i["arguments"])
        for i in items
    ]


async def test_text_answer_streams_in_order_and_equals_the_whole_answer(serve, codec, chat_template):
    """A text answer: one message item whose streamed deltas, done events and final response all
    hold the text the non-streamed request returns; usage counts the tokens."""
    served = await _served(serve, codec, chat_template, "Hello there")
    body = {"input": "hi", "max_output_tokens": 20}
    whole = await (await served.client.post("/v1/responses", json=body)).json()
    assert whole["object"] == "response" and whole["status"] == "completed" and whole["id"].startswith("resp_")
    assert _shape(whole["output"]) == [("message", "Hello there")]
    answer = len(codec.encode("Hello there", add_special_tokens=False)) + 1  # and the end of turn
    usage = whole["usage"]
    assert usage["output_tokens"] == answer and usage["input_tokens"] == len(served.fake.submits[0].prompt_ids)
    resp = await served.client.post("/v1/responses", json={**body, "stream": True})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = response_events(await resp.read())
    assert _shape(check_event_order(events)) == [("message", "Hello there")]
    assert events[-1]["type"] == "response.completed"


async def test_tool_call_answer_streams_a_message_then_a_function_call(serve, codec, tools_template):
    """Hermes markup becomes a function_call item (call_id, name, arguments) after the message of
    the text before it; streamed and whole answers have the same items."""
    served = await _served(serve, codec, tools_template, CALL_TEXT)
    body = {"input": "weather?", "tools": [TOOL], "max_output_tokens": 60}
    whole = await (await served.client.post("/v1/responses", json=body)).json()
    expected = [("message", "Sure. "), ("call", "get_weather", '{"city": "Paris"}')]
    assert _shape(whole["output"]) == expected and whole["status"] == "completed"
    call = whole["output"][1]
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_") and call["status"] == "completed"
    assert '"name": "get_weather"' in _prompt(served, codec)  # the tool reached the template
    resp = await served.client.post("/v1/responses", json={**body, "stream": True})
    events = response_events(await resp.read())
    assert _shape(check_event_order(events)) == expected
    assert [e["type"] for e in events].count("response.function_call_arguments.delta") >= 1


async def test_forced_tool_choice_is_a_grammar_and_answers_only_calls(serve, codec, tools_template):
    """tool_choice required (the Responses spelling of a named function too) is forced by a
    grammar; the answer is the call, no message."""
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    served = await _served(serve, codec, tools_template, text)
    body = {"input": "weather?", "tools": [TOOL], "tool_choice": "required"}
    whole = await (await served.client.post("/v1/responses", json=body)).json()
    assert _shape(whole["output"]) == [("call", "get_weather", '{"city": "Rome"}')]
    assert served.fake.submits[-1].sampling.grammar
    named = {**body, "tool_choice": {"type": "function", "name": "get_weather"}}
    resp = await served.client.post("/v1/responses", json=named)
    assert resp.status == 200 and served.fake.submits[-1].sampling.grammar


async def test_text_format_json_schema_becomes_the_grammar_chat_would_send(serve, codec, chat_template):
    """text.format json_schema is the same grammar as chat's response_format with that schema."""
    served = await _served(serve, codec, chat_template, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    await served.client.post("/v1/responses", json={"input": "hi", "text": {"format": fmt}})
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    await served.client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "response_format": rf}
    )
    grammars = [s.sampling.grammar for s in served.fake.submits]
    assert grammars[0] and grammars[0] == grammars[1]


async def test_input_items_and_instructions_render_as_the_chat_conversation(serve, codec, tools_template):
    """Instructions are the system message; messages with input_text parts, an assistant's
    output_text, its function_call and the function_call_output render as the chat route renders
    the equivalent messages."""
    served = await _served(serve, codec, tools_template, "ok")
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = await served.client.post("/v1/responses", json={"instructions": "Be brief.", "input": items, "tools": [TOOL]})
    assert r.status == 200, await r.text()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    r = await served.client.post("/v1/chat/completions", json={"messages": messages, "tools": [chat_tool]})
    assert r.status == 200, await r.text()
    assert served.fake.submits[0].prompt_ids == served.fake.submits[1].prompt_ids


async def test_max_output_tokens_ends_incomplete(serve, codec, chat_template):
    """Cut by max_output_tokens: status incomplete, reason max_output_tokens, response.incomplete."""
    served = await _served(serve, codec, chat_template, "one two three four five six seven")
    body = {"input": "hi", "max_output_tokens": 2}
    whole = await (await served.client.post("/v1/responses", json=body)).json()
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete"
    events = response_events(await (await served.client.post("/v1/responses", json={**body, "stream": True})).read())
    check_event_order(events)
    assert events[-1]["type"] == "response.incomplete"


async def test_gpu_restart_mid_stream_ends_with_response_failed(serve):
    """A GPU-process restart after tokens: the stream ends with response.failed carrying the
    gpu_process_restart code and the tokens streamed; the order holds up to it."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake, ready=lambda: fake.ready)
    resp = await served.client.post("/v1/responses", json={"input": "abc", "max_output_tokens": 1000, "stream": True})
    head = b"".join([await resp.content.readuntil(b"\n\n") for _ in range(6)])
    fake.restart()
    events = response_events(head + await asyncio.wait_for(resp.read(), 5))
    check_event_order(events)
    failed = events[-1]
    assert failed["type"] == "response.failed"
    error = failed["response"]["error"]
    assert error["code"] == "gpu_process_restart" and error["tokens_streamed"] > 0
    assert failed["response"]["output"][0]["type"] == "message"  # the text so far


async def test_delete_request_cancels_a_streamed_response(serve):
    """DELETE /v1/requests/{x-request-id} cancels it as on chat: response.incomplete, reason
    cancelled, and the GPU row is cancelled."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/responses", json={"input": "abc", "max_output_tokens": 1000, "stream": True})
    head = b"".join([await resp.content.readuntil(b"\n\n") for _ in range(6)])
    gone = await served.client.delete(f"/v1/requests/{resp.headers['x-request-id']}")
    assert gone.status == 200
    events = response_events(head + await asyncio.wait_for(resp.read(), 5))
    check_event_order(events)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["incomplete_details"] == {"reason": "cancelled"}
    assert final["request_id"] == resp.headers["x-request-id"]
    assert fake.running == 0


# stored responses ------------------------------------------------------------------------------
async def test_stored_response_is_read_deleted_and_private_to_its_key(serve, codec, chat_template):
    """store (the default) keeps the response: its key reads it back as answered and deletes it;
    another key gets 404 for reading, deleting and continuing it; store false keeps nothing."""
    served = await _served(serve, codec, chat_template, "Hello there")
    whole = await (await served.client.post("/v1/responses", json={"input": "hi"}, headers=KEY_A)).json()
    rid = whole["id"]
    got = await served.client.get(f"/v1/responses/{rid}", headers=KEY_A)
    assert got.status == 200 and await got.json() == whole
    for method, path, body in (
        ("GET", f"/v1/responses/{rid}", None),
        ("DELETE", f"/v1/responses/{rid}", None),
        ("POST", "/v1/responses", {"input": "more", "previous_response_id": rid}),
    ):
        r = await served.client.request(method, path, json=body, headers=KEY_B)
        err = (await r.json())["error"]
        assert r.status == 404 and err["code"] in ("response_not_found", "previous_response_not_found"), err
    assert len(served.fake.submits) == 1  # the refused continuation never ran
    deleted = await served.client.delete(f"/v1/responses/{rid}", headers=KEY_A)
    assert deleted.status == 200 and (await deleted.json())["deleted"] is True
    assert (await served.client.get(f"/v1/responses/{rid}", headers=KEY_A)).status == 404
    unkept = await (await served.client.post("/v1/responses", json={"input": "hi", "store": False})).json()
    assert unkept["store"] is False
    assert (await served.client.get(f"/v1/responses/{unkept['id']}")).status == 404
    served.state.response_store.check_integrity()


async def test_previous_response_id_continues_the_conversation(serve, codec, tools_template):
    """The continuation's prompt is the first request's input and output (its function call too)
    followed by the new input; the first request's instructions are not carried over."""
    served = await _served(serve, codec, tools_template, CALL_TEXT)
    first = await (
        await served.client.post(
            "/v1/responses", json={"instructions": "Be brief.", "input": "Weather in Paris?", "tools": [TOOL]}
        )
    ).json()
    call = first["output"][1]
    streamed = await served.client.post(
        "/v1/responses",
        json={
            "previous_response_id": first["id"],
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
            "tools": [TOOL],
            "stream": True,
        },
    )
    check_event_order(response_events(await streamed.read()))
    prompt = _prompt(served, codec)
    assert "Weather in Paris?" in prompt and "tool\nsunny" in prompt and "Be brief." not in prompt
    assert '"arguments": {"city": "Paris"}' in prompt and call["call_id"] in prompt
    assert prompt.index("Weather in Paris?") < prompt.index("Sure. ") < prompt.index("sunny")


# fields -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"reasoning": {"budget": 9}}, "reasoning.budget"),
        ({"reasoning": {"effort": 5}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2}, "n"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        (
            {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"previous_response_id": "resp_/../x"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
    ],
)
async def test_fields_that_cannot_be_honoured_are_400_naming_them(serve, tools_template, extra, param):
    served = await serve(app_kw={"chat_template": tools_template})
    resp = await served.client.post("/v1/responses", json={"input": "hi", **extra})
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["param"] == param


async def test_neutral_and_hint_fields_are_accepted_and_unknown_ones_named(serve, codec, chat_template):
    """What the openai SDK and agent frameworks send at their defaults is accepted; unknown fields
    are ignored and named in x-ringserve-ignored-fields."""
    served = await _served(serve, codec, chat_template, "ok")
    body = {
        "input": "hi",
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": None, "summary": None},
        "truncation": "disabled",
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "top_logprobs": 0,
        "parallel_tool_calls": True,
        "metadata": {"app": "test"},
        "user": "u1",
        "seed": 3,
        "top_k": 5,
        "future_field": 1,
    }
    resp = await served.client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    assert resp.headers["x-ringserve-ignored-fields"] == "future_field"
    out = await resp.json()
    assert out["metadata"] == {"app": "test"} and out["user"] == "u1"
    assert served.fake.submits[0].sampling.seed == 3 and served.fake.submits[0].sampling.top_k == 5


async def test_a_store_that_fails_answers_anyway_and_reads_are_503(serve, codec, chat_template, tmp_path, caplog):
    """A database that cannot be written: the response is still answered (the failure logged);
    reading it is a 503 with Retry-After, not a 500."""
    from ringserve.api.responses.store import ResponseStore

    caplog.set_level(logging.WARNING, logger="ringserve.api.responses.store")
    broken = ResponseStore(str(tmp_path / "missing" / "db"), ttl_s=60, tenant_bytes=1 << 20, total_bytes=1 << 20)
    fake = FakeGpu(script=_answer(codec, "ok", chat_template.end_of_turn_ids[0]))
    served = await serve(fake=fake, app_kw={"response_store": broken})
    resp = await served.client.post("/v1/responses", json={"input": "hi"})
    assert resp.status == 200 and "a response was not stored" in caplog.text
    got = await served.client.get(f"/v1/responses/{(await resp.json())['id']}")
    assert got.status == 503 and got.headers["Retry-After"] == "1"
    assert (await got.json())["error"]["code"] == "response_store_unavailable"
