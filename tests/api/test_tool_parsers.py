"""The tool-call parsers over model output as it streams: whatever the chunking, the content and
the calls are those of the whole text, and the stream's pieces are what the openai SDK's
accumulator builds calls from."""

from __future__ import annotations

import json

import pytest

from ringserve.api.chat.tool_parsers import Delta, make_parser, parse_all

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def _accumulate(deltas: list[Delta]) -> tuple[str, list[dict]]:
    """What the openai SDK's stream accumulator makes of the pieces: content, and per index a
    call (id, name from the first piece; arguments appended)."""
    content, calls = "", {}
    for d in deltas:
        if d.index is None:
            content += d.text
            continue
        if d.id is not None:
            assert d.index not in calls and d.index == len(calls), "a call's first piece opens the next index"
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": d.arguments}
        else:
            calls[d.index]["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


def _stream(kind: str, text: str, size: int, **kw) -> tuple[str, list[dict]]:
    p = make_parser(kind, **kw)
    deltas: list[Delta] = []
    for i in range(0, len(text), size):
        deltas += p.feed(text[i : i + size])
    return _accumulate(deltas + p.finish())


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_and_content_whatever_the_chunking(size):
    content, calls = _stream("hermes", HERMES, size)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"city": "Paris"}),
    ]
    assert all(c["id"].startswith("call_") for c in calls)


def test_hermes_text_that_only_looks_like_a_call_is_content():
    """A prefix of <tool_call> that goes elsewhere, broken JSON inside the tags: all content."""
    text = "<tool_response>\n20 degrees\n</tool_response> and <tool_call>not json</tool_call> <tool_c"
    for size in (1, 4, 100):
        content, calls = _stream("hermes", text, size)
        assert content == text and calls == []


def test_hermes_call_left_open_at_the_end_is_still_a_call():
    content, calls = _stream("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', 5)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1})]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_calls(size):
    content, calls = _stream("llama3_json", LLAMA, size)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_llama3_json_text_answer_is_content():
    for text in ("The weather is fine.", '{"not": "a call"}', "  {broken"):
        content, calls = _stream("llama3_json", text, 3)
        assert content == text and calls == [], text


def test_named_choice_streams_arguments_as_they_come():
    """A named function's answer is its arguments: the header first, then every piece of text."""
    p = make_parser("hermes", named="get_weather")
    first = p.feed('{"city"')
    assert first[0] == Delta(index=0, id=first[0].id, name="get_weather") and first[1].arguments == '{"city"'
    assert p.feed(': "Paris"}') == [Delta(index=0, arguments=': "Paris"}')]
    assert p.finish() == [] and p.called


@pytest.mark.parametrize("size", [1, 6, 1000])
def test_required_choice_sends_each_call_once_complete(size):
    text = '[{"name": "a", "parameters": {"x": "}, ]"}}, {"name": "b", "parameters": {}}]'
    content, calls = _stream("required", text, size)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("a", {"x": "}, ]"}),
        ("b", {}),
    ]


def test_parse_all_builds_openai_message_calls():
    reasoning, content, calls = parse_all(make_parser("hermes"), HERMES)
    assert reasoning is None
    assert content.strip() == "Let me check."
    assert calls[0]["type"] == "function" and json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}
