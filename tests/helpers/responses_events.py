"""A /v1/responses stream as a client reads it, and the structural check of its event order
(OpenAI's Responses API): what any test of a streamed response runs over the events it got."""

from __future__ import annotations

import json

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def response_events(raw: bytes | str) -> list[dict]:
    """Parse a whole Responses SSE body: every block is `event: <type>` then `data: <json>` whose
    `type` is that event type; no `[DONE]`."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            raise AssertionError(f"not an `event:` + `data:` block: {block!r}")
        data = json.loads(lines[1][len("data: ") :])
        if data.get("type") != lines[0][len("event: ") :]:
            raise AssertionError(f"event line and data type differ: {block!r}")
        events.append(data)
    return events


def check_event_order(events: list[dict]) -> list[dict]:
    """Raise AssertionError unless `events` are a well-formed Responses stream: created, in_progress,
    then each output item in turn, opened and closed in order (a message: output_item.added,
    content_part.added, output_text.delta..., output_text.done, content_part.done,
    output_item.done; a function call: output_item.added, function_call_arguments.delta...,
    function_call_arguments.done, output_item.done), the done events repeating what the deltas
    built, then one terminal event whose response holds exactly those items (a failure may leave
    the last item open). `sequence_number` counts from 0. Returns the items the stream built."""
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), kinds
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in TERMINAL and not any(k in TERMINAL for k in kinds[:-1]), kinds
    response_id = events[0]["response"]["id"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    items: list[dict] = []
    state = None  # None: between items; else (phase, item) of the open one
    built = ""
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert state is None, f"{kind} while item {len(items) - 1} is open"
            assert e["output_index"] == len(items), e
            item = e["item"]
            assert item["status"] == "in_progress" and item["type"] in ("message", "function_call"), e
            items.append(item)
            built = ""
            state = "part" if item["type"] == "message" else "arguments"
            if item["type"] == "message":
                assert item["content"] == [] and item["role"] == "assistant", e
            else:
                assert item["arguments"] == "" and item["call_id"] and item["name"], e
            continue
        assert state is not None, f"{kind} outside an item"
        item = items[-1]
        assert e["output_index"] == len(items) - 1, e
        if kind != "response.output_item.done":
            assert e["item_id"] == item["id"], e
        if kind == "response.content_part.added":
            assert state == "part" and e["content_index"] == 0 and e["part"]["text"] == "", e
            state = "text"
        elif kind == "response.output_text.delta":
            assert state == "text" and e["content_index"] == 0, e
            built += e["delta"]
        elif kind == "response.output_text.done":
            assert state == "text" and e["text"] == built, (e, built)
            state = "text_done"
        elif kind == "response.content_part.done":
            assert state == "text_done" and e["part"]["text"] == built, e
            state = "part_done"
        elif kind == "response.function_call_arguments.delta":
            assert state == "arguments", e
            built += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert state == "arguments" and e["arguments"] == built and e["name"] == item["name"], (e, built)
            state = "arguments_done"
        elif kind == "response.output_item.done":
            assert state in ("part_done", "arguments_done"), f"{kind} in state {state}"
            done = e["item"]
            assert done["id"] == item["id"] and done["status"] in ("completed", "incomplete"), e
            if done["type"] == "message":
                assert [p["text"] for p in done["content"]] == [built], e
            else:
                assert done["arguments"] == built and done["call_id"] == item["call_id"], e
            items[-1] = done
            state = None
        else:
            raise AssertionError(f"unexpected event {kind}")
    last = events[-1]
    response = last["response"]
    assert response["id"] == response_id
    if last["type"] == "response.failed":
        assert response["status"] == "failed" and response["error"]["code"], response
        return items
    assert state is None, f"{last['type']} while item {len(items) - 1} is open"
    assert response["output"] == items, (response["output"], items)
    assert response["status"] == ("completed" if last["type"] == "response.completed" else "incomplete"), response
    assert response["usage"]["total_tokens"] == response["usage"]["input_tokens"] + response["usage"]["output_tokens"]
    return items
