"""End to end through a real server (tiny model, CPU): SIGKILL the GPU process while two streams
and a /v1/responses stream run and a seeded one waits in the queue. The running streams get the
gpu_process_restart error event (request id, tokens streamed) and [DONE] (the Responses stream:
response.failed with that code); the queued one, which had no token yet, is resubmitted to the
restarted GPU process and completes with the same tokens as a fresh run. Meanwhile /ready is 503
with Retry-After from the GPU process's measured load time. A response stored before the crash
is still there after it, and gone with the server."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time

import aiohttp
import pytest

from ringserve.restart_policy import BACKOFF_BASE_S
from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.responses_events import check_event_order, response_events
from tests.helpers.server import ServerProcess
from tests.helpers.sse import iter_sse

LONG = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True}
LONG_RESPONSE = {"input": "long", "max_output_tokens": 1000, "ignore_eos": True, "stream": True}
SEEDED = {"prompt": "seeded", "max_tokens": 12, "ignore_eos": True, "stream": True, "temperature": 1.0, "seed": 1234}


class _Reader:
    """One streaming request's events as they arrive."""

    def __init__(self) -> None:
        self.events: list = []
        self.request_id = ""
        self.tokens = 0
        self.error_t: float | None = None

    async def run(self, session: aiohttp.ClientSession, url: str, body: dict) -> None:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            self.request_id = resp.headers["x-request-id"]
            async for ev in iter_sse(resp):
                self.events.append(ev)
                if ev == "[DONE]":
                    return
                if "error" in ev:
                    self.error_t = time.monotonic()
                elif ev["choices"] and ev["choices"][0]["finish_reason"] is None:
                    self.tokens += 1

    def token_ids(self) -> list[int]:
        return [e["token_id"] for e in self.events if isinstance(e, dict) and "token_id" in e]


class _ResponseReader:
    """One streamed /v1/responses request's raw body, and its text deltas so far."""

    def __init__(self) -> None:
        self.raw = b""
        self.tokens = 0

    async def run(self, session: aiohttp.ClientSession, url: str, body: dict) -> None:
        async with session.post(url + "/v1/responses", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for chunk in resp.content.iter_any():
                self.raw += chunk
                self.tokens = self.raw.count(b"event: response.output_text.delta")


async def _until(cond, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def _scenario(url: str, control) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", json={"input": "remember", "max_output_tokens": 2}) as r:
            stored = await r.json()
        longs = [_Reader(), _Reader()]
        tasks = [asyncio.create_task(r.run(session, url, LONG)) for r in longs]
        answer = _ResponseReader()
        tasks.append(asyncio.create_task(answer.run(session, url, LONG_RESPONSE)))
        await _until(lambda: all(r.tokens >= 2 for r in [*longs, answer]), 30)
        seeded = _Reader()
        tasks.append(asyncio.create_task(seeded.run(session, url, SEEDED)))
        await _until(lambda: control.gpu_stats.read()["queue_depth"] >= 1, 10)
        assert seeded.tokens == 0  # both rows are taken: it waits, with no token yet
        load_s = control.model_facts()["load_s"]
        generation = control.gpu_generation
        kill_t = time.monotonic()
        os.kill(control.gpu_pid, signal.SIGKILL)
        await _until(lambda: control.gpu_generation != generation, 10)
        async with session.get(url + "/ready") as ready:
            # Not ready at once; Retry-After: the restart backoff still to wait (the first crash's
            # BACKOFF_BASE_S at most) plus the measured load time, in whole seconds, >= 1.
            assert ready.status == 503
            assert (
                max(1, math.ceil(load_s))
                <= int(ready.headers["Retry-After"])
                <= max(1, math.ceil(load_s + BACKOFF_BASE_S))
            )
        async with asyncio.timeout(90):
            await asyncio.gather(*tasks)
        for r in longs:
            assert r.events[-1] == "[DONE]"
            err = r.events[-2]["error"]
            assert err["type"] == "gpu_process_restart" == err["code"], r.events[-2]
            assert err["tokens_streamed"] == r.tokens > 0
            assert r.events[-2]["request_id"] == r.request_id
            assert r.error_t - kill_t < 2.0  # the bound is 1 s; slack for a loaded CI box
        events = response_events(answer.raw)
        check_event_order(events)
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"]["code"] == "gpu_process_restart"
        async with session.get(url + f"/v1/responses/{stored['id']}") as r:
            assert r.status == 200 and await r.json() == stored  # the API side kept it
        more = {"input": "again", "previous_response_id": stored["id"], "max_output_tokens": 2}
        async with session.post(url + "/v1/responses", json=more) as r:
            assert r.status == 200, await r.text()
        assert seeded.events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in seeded.events)
        assert seeded.tokens == 12
        fresh = _Reader()
        await asyncio.wait_for(fresh.run(session, url, SEEDED), 30)
        assert fresh.token_ids() == seeded.token_ids()


@pytest.mark.timeout(150)
def test_gpu_kill_errors_streaming_requests_and_resubmits_queued_one(tiny_model_dir, tmp_path):
    """Running streams get the restart error event; a queued seeded one completes, same tokens."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1, queue_limit_s=600, max_rows=3) as srv:
        instance = find_instance(srv.shm_dir)
        seg, control = attach_control(srv.shm_dir, instance)
        try:
            asyncio.run(_scenario(srv.url, control))
        finally:
            seg.close()
        assert any(".responses" in name for name in os.listdir(srv.shm_dir))
    assert not [name for name in os.listdir(srv.shm_dir) if instance in name]  # the store went with the rings
