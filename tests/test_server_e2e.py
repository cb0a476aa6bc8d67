"""The whole server on loopback: supervisor, GPU process and two API workers on the tiny model,
driven by real HTTP clients (the `openai` package, aiohttp, urllib)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.helpers.net import http_json
from tests.helpers.server import ServerProcess
from tests.helpers.sse import iter_sse

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # A long queue limit: these tests submit hundreds of requests at once and want none refused.
    with ServerProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("shm"),
        workers=2,
        queue_limit_s=600,
        max_rows=32,
        slow_reader_s=3,
        model_name="tiny-llama",
    ) as srv:
        yield srv
        assert srv.stop() == 0, srv.log()


def _body(prompt, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return {"prompt": prompt, **kw}


async def _stream(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed completion: its events (parsed), text, token ids and request id header."""
    events, text, token_ids = [], "", []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        rid = resp.headers["x-request-id"]
        async for ev in iter_sse(resp):
            events.append(ev)
            if ev == "[DONE]":
                break
            if ev["choices"] and ev["choices"][0]["finish_reason"] is None:
                text += ev["choices"][0]["text"]
                token_ids.append(ev["token_id"])
    return {"events": events, "text": text, "token_ids": token_ids, "request_id": rid}


def _run(coro):
    return asyncio.run(coro)


async def _many(url: str, bodies: list[dict]) -> list[dict]:
    conn = aiohttp.TCPConnector(limit=len(bodies) + 8)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        return await asyncio.gather(*(_stream(session, url, b) for b in bodies))


def test_openai_client_streaming_and_not(server):
    """The official openai client gets the same text streamed and not streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="anything")
    full = client.completions.create(model="tiny-llama", prompt="The river runs", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = client.completions.create(
        model="tiny-llama", prompt="The river runs", max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    assert streamed


def test_sse_event_sequence(server):
    """Token events, then one finish event per sample, then usage/timing (asked for), then [DONE]."""
    (res,) = _run(
        _many(server.url, [_body("Once upon a time", max_tokens=5, n=2, stream_options={"include_usage": True})])
    )
    events = res["events"]
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    assert set(final["timing"]) >= {"queue_ms", "ttft_ms"}
    tokens = [e for e in events[:-2] if e["choices"][0]["finish_reason"] is None]
    finishes = [e for e in events[:-2] if e["choices"][0]["finish_reason"] is not None]
    assert len(tokens) == 10 and sorted(e["index"] for e in finishes) == [0, 1]
    for e in tokens:
        assert e["object"] == "text_completion" and e["request_id"] == res["request_id"] == e["id"]
        assert {"index", "text", "token_id", "logprob"} <= set(e)
    assert all(e["choices"][0]["finish_reason"] == "length" for e in finishes)


def test_concurrent_streams_equal_solo(server):
    """200 concurrent greedy streams of mixed lengths each equal the same request run alone."""
    prompts = [f"Story {i}: " + "the quick brown fox " * (i % 13) for i in range(200)]
    bodies = [_body(p, max_tokens=4 + i % 9) for i, p in enumerate(prompts)]
    together = _run(_many(server.url, bodies))
    sample = list(range(0, 200, 10))
    alone = [_run(_many(server.url, [bodies[i]]))[0] for i in sample]
    for i, solo in zip(sample, alone):
        assert together[i]["token_ids"] == solo["token_ids"], f"request {i} differs in a batch"
    assert all(len(r["token_ids"]) == b["max_tokens"] for r, b in zip(together, bodies))
    server.wait_metric("ringserve_kv_blocks_free", lambda v: v == server.metrics()["ringserve_kv_blocks_total"])


def test_markers_never_cross(server):
    """1,000 concurrent requests with unique markers: no event carries another request's id or
    marker, and sampled requests produce exactly their solo output."""
    markers = [f"MARK{i:04d}Q" for i in range(1000)]
    bodies = [_body(f"{m} remember {m}", max_tokens=3) for m in markers]
    results = _run(_many(server.url, bodies))
    ids = {r["request_id"] for r in results}
    assert len(ids) == 1000
    for i, r in enumerate(results):
        for ev in r["events"][:-1]:
            assert ev["request_id"] == r["request_id"]
        others = [m for m in markers if m in r["text"] and m != markers[i]]
        assert not others
    for i in (0, 333, 999):
        assert _run(_many(server.url, [bodies[i]]))[0]["token_ids"] == results[i]["token_ids"]


def test_delete_and_disconnect_return_blocks(server):
    """DELETE /v1/requests/{id} and a client disconnect both free every KV block."""
    total = server.metrics()["ringserve_kv_blocks_total"]

    async def scenario():
        async with aiohttp.ClientSession() as session:
            body = _body("Cancel me " * 20, max_tokens=900, ignore_eos=True, stream=True)
            async with session.post(server.url + "/v1/completions", json=body) as resp:
                rid = resp.headers["x-request-id"]
                await resp.content.readline()
                async with session.delete(f"{server.url}/v1/requests/{rid}") as d:
                    assert d.status == 200
                lines = [line async for line in resp.content]
            assert any(b'"finish_reason":"cancelled"' in line for line in lines)
            async with session.delete(f"{server.url}/v1/requests/no-such-request") as d:
                assert d.status == 404
            resp = await session.post(server.url + "/v1/completions", json=body)
            await resp.content.readline()
            resp.close()  # disconnect mid-stream

    _run(scenario())
    server.wait_metric("ringserve_kv_blocks_free", lambda v: v == total)
    server.wait_metric("ringserve_running_rows", lambda v: v == 0)


def test_error_statuses(server):
    """Bad JSON, bad fields and an over-long request are 400 with the offending field named."""
    import urllib.request

    req = urllib.request.Request(
        server.url + "/v1/completions", data=b"{not json", headers={"content-type": "application/json"}
    )
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("bad JSON was accepted")
    except urllib.error.HTTPError as err:
        assert err.code == 400 and "error" in json.loads(err.read())
    status, body, _ = http_json(server.url + "/v1/completions", _body("hi", temperature="hot"))
    assert status == 400 and body["error"]["param"] == "temperature"
    status, body, _ = http_json(server.url + "/v1/completions", _body("hi", max_tokens=0))
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body, _ = http_json(server.url + "/v1/completions", {"prompt_token_ids": [5] * 7500, "max_tokens": 1000})
    assert status == 400 and "8192" in body["error"]["message"].replace(",", "")


def test_stop_string_spanning_tokens(server):
    """A stop string across a token boundary truncates the text there and finishes with `stop`."""
    (base,) = _run(_many(server.url, [_body("Far away", max_tokens=12)]))
    text = base["text"]
    events = [e for e in base["events"][:-1] if e["choices"][0]["finish_reason"] is None]
    # Two characters around the boundary between the 3rd and 4th token's text.
    cut = len("".join(e["text"] for e in events[:3]))
    stop = text[cut - 1 : cut + 1]
    assert len(stop) == 2
    (res,) = _run(_many(server.url, [_body("Far away", max_tokens=12, stop=[stop])]))
    assert res["text"] == text[: text.index(stop)]
    finishes = [e for e in res["events"][:-1] if e["choices"][0]["finish_reason"] is not None]
    assert finishes[0]["choices"][0]["finish_reason"] == "stop"


def test_metrics_and_probes(server):
    """/metrics parses with prometheus_client and carries the gateway names; probes answer."""
    m = server.metrics()
    for name in (
        "ringserve_queue_depth",
        "ringserve_running_rows",
        "ringserve_kv_blocks_free",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in m
    assert any(k.startswith("vllm:cache_config_info{") for k in m)
    assert m["ringserve_requests_total"] > 0
    status, health, _ = http_json(server.url + "/health")
    # The CPU engine's compiled kernels serve every attention op (the start-up check is CUDA's).
    assert status == 200 and health["attention"]["ops"] == dict.fromkeys(
        ("write_kv", "decode", "prefill", "mixed"), "cpu"
    )
    assert m['ringserve_attention_backend_info{backend="cpu",op="decode"}'] == 1.0
    assert m["ringserve_attention_check_failures"] == 0
    assert http_json(server.url + "/ready")[0] == 200
    status, models, _ = http_json(server.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"]


def test_sigterm_unlinks_shared_memory(tiny_model_dir, tmp_path):
    """Stopping the server exits 0 and leaves no segment behind."""
    with ServerProcess(tiny_model_dir, tmp_path, workers=1) as srv:
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ringserve.")]
        assert srv.stop() == 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ringserve.")]
