"""Request traces through the real server to a real OTLP receiver (issue 37).

Six streamed, constrained (`guided_regex`) requests share a KV pool too small for all of them, so
rows are preempted and recomputed. Each carries its own W3C `traceparent`. For each one the
exported trace must: hang its server span off the client's parent; hold tokenize (with the
grammar conversion), queue, prefill (its chunks, whose tokens and the cached prefix add up to the
prompt), decode and
respond in that order, tiling the server span, whose duration is the client's measured latency
within 60 ms; say what the GenAI conventions say (model, tokens as the client's usage counted
them, finish reasons, the request id the client got); and a preempted one shows its preemption.
No byte exported anywhere holds the prompt, the answer or the API key.
"""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest

from ringserve.api.auth import tenant_of
from ringserve.tools.harness.otlp_receiver import OtlpReceiver, attributes
from tests.helpers.server import ServerProcess

KEY = "sk-trace-tenant-1"
PROMPT = "Trace me: the quick brown fox jumps over the lazy dog"
REQUESTS = 6
TOKENS = 48
LATENCY_TOLERANCE_S = 0.06  # client-measured vs the server span: the client's HTTP, SSE parsing, loopback
ORDER = ["ringserve.tokenize", "ringserve.queue", "ringserve.prefill", "ringserve.decode", "ringserve.respond"]


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracing")
    (root / "keys").write_text(KEY + "\n")
    with (
        OtlpReceiver() as receiver,
        ServerProcess(
            tiny_model_dir,
            root / "shm",
            workers=1,
            num_blocks=14,
            max_rows=8,
            queue_limit_s=600,
            api_keys_file=root / "keys",
            otlp_traces_endpoint=receiver.url,
        ) as srv,
    ):
        yield srv, receiver


def _model(srv) -> str:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY).models.list().data[0].id


def _stream(srv, model: str, i: int, results: list) -> None:
    trace_id, parent = os.urandom(16), os.urandom(8)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    t0 = time.monotonic()
    raw = client.completions.with_raw_response.create(
        model=model,
        prompt=f"{PROMPT} #{i}",
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"guided_regex": "[a-z ]+", "ignore_eos": True},
        extra_headers={"traceparent": f"00-{trace_id.hex()}-{parent.hex()}-01", "tracestate": "vendor=x"},
    )
    chunks = list(raw.parse())
    took = time.monotonic() - t0
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)
    results.append((trace_id, parent, took, raw.headers["x-request-id"], text, usage))


def test_each_streamed_preempted_constrained_request_is_one_trace_that_adds_up(traced):
    srv, receiver = traced
    model = _model(srv)
    results: list = []
    threads = [threading.Thread(target=_stream, args=(srv, model, i, results)) for i in range(REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == REQUESTS
    preempted = 0
    for trace_id, parent, took, request_id, _text, usage in results:
        spans = receiver.trace(trace_id, want_spans=6)
        by_name: dict[str, list] = {}
        for s in spans:
            by_name.setdefault(s.name, []).append(s)
        (server,) = [s for s in spans if s.parent_span_id == parent]
        assert server.kind == server.SPAN_KIND_SERVER and server.name.startswith("text_completion ")
        assert server.trace_state == "vendor=x"
        attrs = attributes(server)
        assert attrs["gen_ai.request.model"] and attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == TOKENS
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert attrs["gen_ai.response.id"] == request_id and attrs["http.response.status_code"] == 200
        assert attrs["ringserve.tenant"] == tenant_of(KEY)
        assert [e.name for e in server.events] == ["first_token"]
        # the phases, in order, tiling the server span
        phases = [by_name[name][0] for name in ORDER]
        assert all(p.parent_span_id == server.span_id for p in phases)
        assert phases[0].start_time_unix_nano == server.start_time_unix_nano
        assert phases[-1].end_time_unix_nano == server.end_time_unix_nano
        for before, after in zip(phases, phases[1:]):
            assert before.start_time_unix_nano <= before.end_time_unix_nano <= after.start_time_unix_nano + 1000
        server_s = (server.end_time_unix_nano - server.start_time_unix_nano) / 1e9
        parts_s = sum(p.end_time_unix_nano - p.start_time_unix_nano for p in phases) / 1e9
        assert abs(parts_s - server_s) < 0.002, (parts_s, server_s)
        assert abs(took - server_s) < LATENCY_TOLERANCE_S, (took, server_s)
        # the worker's grammar conversion sits in tokenize; the GPU's prompt chunks in prefill
        (convert,) = by_name["ringserve.grammar.convert"]
        assert convert.parent_span_id == phases[0].span_id
        prefill, decode = phases[2], phases[3]
        chunks = [s for s in by_name["ringserve.prefill.chunk"] if s.parent_span_id == prefill.span_id]
        cached = attributes(prefill)["ringserve.cached_tokens"]
        assert chunks and sum(attributes(c)["ringserve.tokens"] for c in chunks) + cached == usage.prompt_tokens
        for c in chunks:
            assert prefill.start_time_unix_nano <= c.start_time_unix_nano <= c.end_time_unix_nano
            assert c.end_time_unix_nano <= prefill.end_time_unix_nano + 1000
        events = [e.name for e in decode.events]
        count = attributes(decode)["ringserve.preemptions"]
        assert events.count("preempt") == count and events.count("resume") == count
        if count:
            preempted += 1
            assert by_name.get("ringserve.recompute.chunk"), "a preempted request recomputes"
    assert preempted >= 1, "the pool was meant to be too small for every row"
    # the dashboards' series, from the same requests, measured on the GPU
    m = srv.metrics()
    assert m["vllm:request_prefill_time_seconds_count"] >= REQUESTS  # (the reader drops model_name)
    assert m["vllm:request_prefill_time_seconds_sum"] > 0 and m["vllm:request_decode_time_seconds_sum"] > 0
    assert m["vllm:num_preemptions_total"] >= preempted
    assert m[f'ringserve_tenant_requests_total{{tenant="{tenant_of(KEY)}"}}'] >= REQUESTS
    exported = b"".join(receiver.bodies)
    assert PROMPT.encode() not in exported and b"quick brown" not in exported and KEY.encode() not in exported
    for *_, text, _ in results:
        assert text.encode() not in exported


def test_a_request_without_a_sampled_parent_is_not_traced_when_its_client_says_so(traced):
    """The client's sampled flag is honoured: 00 (not sampled) makes no trace."""
    srv, receiver = traced
    trace_id = os.urandom(16)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    client.completions.create(
        model=_model(srv),
        prompt="x",
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id.hex()}-{os.urandom(8).hex()}-00"},
    )
    time.sleep(1.5)  # two export periods
    assert receiver.trace(trace_id, want_spans=1, timeout_s=0.1) == []


def test_traces_go_over_otlp_grpc_to_a_bare_host_port(tiny_model_dir, tmp_path):
    """`--otlp-traces-protocol grpc` to `host:port` (how collectors listen: plaintext): a chat
    request's server span arrives under the client's parent, with its phases."""
    with (
        OtlpReceiver(protocol="grpc") as receiver,
        ServerProcess(
            tiny_model_dir, tmp_path / "shm", workers=1, otlp_traces_endpoint=receiver.url, otlp_traces_protocol="grpc"
        ) as srv,
    ):
        trace_id, parent = os.urandom(16), os.urandom(8)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"traceparent": f"00-{trace_id.hex()}-{parent.hex()}-01"},
        )
        spans = receiver.trace(trace_id, want_spans=6)
    (server,) = [s for s in spans if s.parent_span_id == parent]
    assert server.name.startswith("chat ") and attributes(server)["gen_ai.response.id"] == reply.id
    assert {s.name for s in spans} >= set(ORDER)
    assert PROMPT.encode() not in b"".join(receiver.bodies)
