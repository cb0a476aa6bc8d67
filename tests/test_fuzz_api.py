"""Bad input never hurts the server: requests generated from docs/openapi.yaml (valid ones and
type-confused ones) plus hand-picked nasties against a real server on the tiny model. Every answer
is a valid completion or a 4xx with the OpenAI error object; afterwards no process restarted, every
KV block is free and the server still serves."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.net import http_json
from tests.helpers.responses_events import check_event_order, response_events
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(300)

SPEC = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml").read_text())
# Keep generated work small on a CPU: the spec's ranges, clamped for these fields only.
CLAMP = {
    "max_tokens": (0, 4),
    "max_completion_tokens": (1, 4),
    "n": (1, 2),
    "logprobs": (0, 3),
    "min_tokens": (0, 2),
    "prompt_logprobs": (0, 3),
    "truncate_prompt_tokens": (-1, 8),
    "top_logprobs": (0, 3),
    "max_output_tokens": (1, 4),
}
MAX_TEXT = 40
MAX_ITEMS = 6


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        node = SPEC
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict, name: str | None = None) -> st.SearchStrategy:
    """A hypothesis strategy for the JSON-schema subset docs/openapi.yaml uses."""
    schema = _resolve(schema)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of(*(from_schema(s, name) for s in schema["oneOf"]))
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = CLAMP.get(name, (schema.get("minimum"), schema.get("maximum")))
        return st.integers(lo, hi)
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(lo, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", MAX_TEXT), MAX_TEXT))
    if kind == "array":
        return st.lists(
            from_schema(schema["items"], name),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS),
        )
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, k) for k, v in props.items() if k in required},
            optional={k: from_schema(v, k) for k, v in props.items() if k not in required},
        )
    raise ValueError(f"schema construct not supported by the fuzz strategies: {schema}")


REQUEST = SPEC["components"]["schemas"]["CompletionRequest"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
# Valid bodies (always with a prompt), and bodies where one field holds any JSON value at all.
valid_bodies = from_schema(REQUEST).map(
    lambda b: (
        b
        if ("prompt" in b) != ("prompt_token_ids" in b)
        else {**{k: v for k, v in b.items() if k != "prompt_token_ids"}, "prompt": "fuzz"}
    )
)
confused_bodies = st.builds(
    lambda b, k, v: {**b, k: v},
    valid_bodies,
    st.sampled_from(sorted(REQUEST["properties"]) + ["unknown_field"]),
    json_values,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # max_tokens_limit: a confused body's `max_tokens: null` asks for the whole context; 64 keeps it short.
    with ServerProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("shm"),
        workers=2,
        queue_limit_s=600,
        max_body_bytes=1 << 20,
        max_tokens_limit=64,
    ) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        srv.generations = lambda: (
            control.gpu_generation,
            tuple(control.worker_slot(i)["generation"] for i in range(2)),
        )
        srv.blocks = lambda: (control.gpu_stats.read()["kv_blocks_free"], control.gpu_stats.read()["kv_blocks_total"])
        before = srv.generations()
        yield srv
        assert srv.generations() == before, "a process restarted during the fuzz run:\n" + srv.log()
        seg.close()
        assert srv.stop() == 0, srv.log()


def _check_answer(status: int, body, body_sent) -> None:
    assert status < 500, (status, body, body_sent)
    if status == 200:
        if isinstance(body, dict) and body.get("object") in ("text_completion", "chat.completion"):
            assert all(c["finish_reason"] in ("stop", "length", "cancelled") for c in body["choices"])
        if isinstance(body, dict) and body.get("object") == "response":
            assert body["status"] in ("completed", "incomplete") and body["output"], body
        return
    assert 400 <= status < 500 and isinstance(body, dict), (status, body, body_sent)
    err = body["error"]
    assert {"message", "type", "param", "code"} <= err.keys() and err["message"], body


OUTCOMES = {"completion": 0, "4xx": 0}  # so the last test can tell the fuzz exercised both paths


def _post(srv, body, path: str = "/v1/completions") -> None:
    req = urllib.request.Request(
        srv.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, kind, raw = resp.status, resp.headers.get("content-type", ""), resp.read()
    except urllib.error.HTTPError as err:
        status, kind, raw = err.code, err.headers.get("content-type", ""), err.read()
    if path == "/v1/messages":
        _check_message_answer(status, kind, raw, body)
    elif status == 200 and kind.startswith("text/event-stream") and path == "/v1/responses":
        # A well-formed Responses stream that did not fail (nothing failed on the server).
        events = response_events(raw)
        check_event_order(events)
        assert events[-1]["type"] != "response.failed", (events[-1], body)
    elif status == 200 and kind.startswith("text/event-stream"):
        # A stream must end with [DONE] and carry no error event (nothing failed on the server).
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw, (raw[-500:], body)
    else:
        _check_answer(status, json.loads(raw), body)
    OUTCOMES["completion" if status == 200 else "4xx"] += 1


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=st.one_of(valid_bodies, confused_bodies))
def test_generated_requests_get_a_completion_or_a_4xx(server, body):
    """Bodies generated from the spec: never a 5xx; errors carry the error object."""
    _post(server, body)


CHAT_REQUEST = SPEC["components"]["schemas"]["ChatCompletionRequest"]
# Valid chat bodies always cap the answer (unset, it may run to the context limit).
valid_chat_bodies = from_schema(CHAT_REQUEST).map(
    lambda b: b if "max_tokens" in b or "max_completion_tokens" in b else {**b, "max_tokens": 3}
)
confused_chat_bodies = st.builds(
    lambda b, k, v: {**b, k: v},
    valid_chat_bodies,
    st.sampled_from(sorted(CHAT_REQUEST["properties"]) + ["tools"]),
    json_values,
)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=st.one_of(valid_chat_bodies, confused_chat_bodies))
def test_generated_chat_requests_get_a_completion_or_a_4xx(server, body):
    """Chat bodies generated from the spec (random roles, parts, options): never a 5xx."""
    _post(server, body, "/v1/chat/completions")


RESPONSES_REQUEST = SPEC["components"]["schemas"]["ResponsesRequest"]
# Valid bodies always cap the answer; confused ones may still run to --max-tokens-limit.
valid_responses_bodies = from_schema(RESPONSES_REQUEST).map(lambda b: {"max_output_tokens": 3, **b})
confused_responses_bodies = st.builds(
    lambda b, k, v: {**b, k: v},
    valid_responses_bodies,
    st.sampled_from(sorted(RESPONSES_REQUEST["properties"]) + ["reasoning", "background"]),
    json_values,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=st.one_of(valid_responses_bodies, confused_responses_bodies))
def test_generated_responses_requests_get_a_response_or_a_4xx(server, body):
    """/v1/responses bodies generated from the spec (input items, tools, formats, stored and
    continued ids): never a 5xx; a stream passes the event-order check."""
    _post(server, body, "/v1/responses")


def _check_message_answer(status: int, kind: str, raw: bytes, body_sent) -> None:
    """A /v1/messages answer: a message, a stream that ends with message_stop and no error event,
    or a 4xx in Anthropic's error shape."""
    assert status < 500, (status, raw[-500:], body_sent)
    if status == 200 and kind.startswith("text/event-stream"):
        assert raw.rstrip().endswith(b'data: {"type":"message_stop"}') and b"event: error" not in raw, raw[-500:]
        return
    body = json.loads(raw)
    if status == 200:
        assert body["type"] == "message" and body["stop_reason"] in (
            "end_turn",
            "max_tokens",
            "stop_sequence",
            "tool_use",
        )
        return
    assert 400 <= status < 500 and body["type"] == "error", (status, body, body_sent)
    assert body["error"]["type"] and body["error"]["message"], body


MESSAGES_REQUEST = SPEC["components"]["schemas"]["MessagesRequest"]
# Valid bodies leave the model out (any generated name is a 404) and ask for a token at least.
valid_messages_bodies = from_schema(MESSAGES_REQUEST).map(
    lambda b: {**{k: v for k, v in b.items() if k != "model"}, "max_tokens": max(1, b["max_tokens"])}
)
confused_messages_bodies = st.builds(
    lambda b, k, v: {**b, k: v},
    valid_messages_bodies,
    st.sampled_from(sorted(MESSAGES_REQUEST["properties"]) + ["mcp_servers", "container"]),
    json_values,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=st.one_of(valid_messages_bodies, confused_messages_bodies))
def test_generated_messages_requests_get_a_message_or_a_4xx(server, body):
    """/v1/messages bodies generated from the spec (blocks, tools, thinking): never a 5xx; errors
    are Anthropic-shaped, a stream ends with message_stop."""
    _post(server, body, "/v1/messages")


def _raw(srv, payload: bytes, read: bool = True, timeout: float = 20.0) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(payload)
        if not read:
            return b""
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks)


def _http(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',  # invalid UTF-8
        b'{"prompt": "x", "max_tokens": 1e400}',  # a float that overflows
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # a 5000-digit integer
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,  # deeply nested
        b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
        b"",
        b"null",
        b'{"prompt": "x", "prompt": [1, 2]}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',  # a lone surrogate
    ],
)
def test_nasty_bodies_get_4xx(server, raw):
    """Malformed, huge-number, NaN, deeply nested bodies: a 4xx (or a completion), never a 5xx."""
    reply = _raw(server, _http(raw))
    status = int(reply.split(b" ", 2)[1])
    assert status < 500, reply[:500]
    if status != 200:
        assert b'"error"' in reply, reply[:500]


def test_ten_megabyte_body_is_413(server):
    """A body over max_body_bytes is refused with 413 and the error object."""
    reply = _raw(server, _http(b'{"prompt": "' + b"a" * (10 << 20) + b'"}'))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b'"error"' in reply


def test_half_sent_requests_and_idle_connections_do_not_block_others(server):
    """Connections that stop mid-body or never send anything: a normal request still completes."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    half = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(_http(b'{"prompt": "x", "max_tokens": 1}')[:-10])  # body cut short
        half.append(s)
    try:
        t0 = time.monotonic()
        _post(server, {"prompt": "still serving", "max_tokens": 2})
        assert time.monotonic() - t0 < 30
    finally:
        for s in idle + half:
            s.close()


def test_server_is_whole_after_the_fuzz(server):
    """Last: /ready is 200, every KV block is back (no leak from any refused request), and the
    generated requests produced both completions and refusals."""
    assert OUTCOMES["completion"] > 0 and OUTCOMES["4xx"] > 0, OUTCOMES
    assert http_json(server.url + "/ready")[0] == 200
    deadline = time.monotonic() + 10
    while server.blocks()[0] != server.blocks()[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    free, total = server.blocks()
    assert free == total > 0
