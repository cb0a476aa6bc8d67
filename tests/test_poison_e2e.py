"""A request that crashes or stalls the GPU process, through a real server (tiny model, CPU,
`docs/design.md#failure-semantics`). The faults are planted with `sitecustomize` in the GPU
process only, inside the step (after the forward, before the samples are folded in), where a
real poison request (a kernel fault, an endless grammar, a step too long for the watchdog) strikes:

* a poison request kills the GPU process whenever it is in the step: it is resubmitted once,
  kills it again, and then is answered `request_quarantined` (an SSE error event, or 422) instead
  of a third resubmission; a resend is refused with 422 by every worker; an innocent request
  queued meanwhile is resubmitted and completes; and with `--restart-limit 2` the supervisor
  stays up through two such requests of one tenant (four deaths, one counted);
* a long step on a slowed box (an 1,800-token prompt in one 2,048-token step, 2 ms a token more,
  against a 1 s watchdog) still computes, so it is not killed; a step that stalls without
  computing is a hang, and is killed (twice, then quarantined); and a start-up whose first step
  (a warm-up or calibration step) computes for 1.5 s against that watchdog is not killed either.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.server import ServerProcess
from tests.helpers.sse import iter_sse

pytestmark = pytest.mark.timeout(300)

POISON = [301, 302, 303, 304]  # a prompt starting with these ids kills the GPU process in its step
STALL = [311, 312, 313, 314]  # ... makes its step wait 3 s without computing (a hang)

# Test only, in the GPU process: the step's requests come from Scheduler.step_requests on the
# batch schedule() built; the fault strikes in observe_step_time, which the loop calls between
# the forward and the update, while the step-in-flight record names the step.
FAULTS = f"""
import sys
if "ringserve.gpu_proc.main" in sys.orig_argv:
    import os
    import signal
    import time

    from ringserve.gpu_proc import scheduler

    _schedule = scheduler.Scheduler.schedule
    _observe = scheduler.Scheduler.observe_step_time

    def _scheduled(self, *args, **kwargs):
        self.planted_batch = _schedule(self, *args, **kwargs)
        return self.planted_batch

    def _observed(self, ms, *args, **kwargs):
        prompts = [r.prompt_ids[:4] for r in self.step_requests(self.planted_batch)]
        if {POISON!r} in prompts:
            os.kill(os.getpid(), signal.SIGKILL)
        if {STALL!r} in prompts:
            time.sleep(3.0)
        if self.last_shape.prefill >= 1000:  # a slow box: 2 ms more per prompt token, computing
            end = time.monotonic() + 0.002 * self.last_shape.prefill
            while time.monotonic() < end:
                sum(range(1000))
        return _observe(self, ms, *args, **kwargs)

    scheduler.Scheduler.schedule = _scheduled
    scheduler.Scheduler.observe_step_time = _observed

    from ringserve.gpu_proc import step  # no torch: this runs before the GPU process's first heartbeat

    _init = step.StepBatch.__init__

    def _first_step_slow(self, *args, **kwargs):  # the first step built (at start-up) computes 1.5 s
        _init(self, *args, **kwargs)
        if not step.planted_slow:
            step.planted_slow = True
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                sum(range(1000))

    step.planted_slow = False
    step.StepBatch.__init__ = _first_step_slow
"""


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, list, dict]:
    """(status, JSON body or {}, SSE events, headers) of one completion request."""
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200 or not body.get("stream"):
            return resp.status, await resp.json(), [], dict(resp.headers)
        return resp.status, {}, [ev async for ev in iter_sse(resp)], dict(resp.headers)


async def _until_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.1)


def _generation(srv: ServerProcess) -> int:
    seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
    try:
        return control.gpu_generation
    finally:
        seg.close()


async def _poison_scenario(srv: ServerProcess) -> None:
    url = srv.url
    filler = list(range(400, 440))
    async with aiohttp.ClientSession() as session:
        innocent = asyncio.create_task(
            _post(session, url, {"prompt": "an innocent bystander", "max_tokens": 8, "ignore_eos": True})
        )
        status, _, events, _ = await _post(
            session, url, {"prompt": POISON + filler, "max_tokens": 8, "stream": True, "ignore_eos": True}
        )
        # Admitted (200), in the step at two deaths: an explicit error event, no third try.
        assert status == 200 and events[-1] == "[DONE]", events
        err = events[-2]["error"]
        assert err["code"] == "request_quarantined" == err["type"] and err["tokens_streamed"] == 0, err
        assert _generation(srv) == 3  # two deaths
        status, body, _, _ = await asyncio.wait_for(innocent, 60)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        # The same request again, plain or streamed, on whichever worker: refused before the ring
        # (once the GPU process is back: while it restarts, every request is a 503 before any work).
        await _until_ready(session, url)
        for stream in (False, True, False, True):
            status, body, _, headers = await _post(
                session, url, {"prompt": POISON + filler, "max_tokens": 8, "stream": stream, "ignore_eos": True}
            )
            assert status == 422 and body["error"]["code"] == "request_quarantined", body
            assert 500 <= int(headers["Retry-After"]) <= 600
        # A second poison of the same tenant, not streamed: 422 once it is quarantined; its two
        # deaths count toward nothing (the tenant was in the step at two deaths already).
        status, body, _, _ = await _post(session, url, {"prompt": POISON + filler[:-1], "max_tokens": 8})
        assert status == 422 and body["error"]["code"] == "request_quarantined", body
        assert _generation(srv) == 5
        await _until_ready(session, url)
        status, body, _, _ = await _post(session, url, {"prompt": "still serving", "max_tokens": 4})
        assert status == 200, body


def test_poison_request_is_quarantined_after_two_deaths_and_the_supervisor_stays_up(tiny_model_dir, tmp_path):
    """Two poison requests of one tenant kill the GPU process four times under --restart-limit 2:
    each is quarantined at its second death, a resend is 422, an innocent request completes, and
    the supervisor never gives up (one death counted)."""
    with ServerProcess(
        tiny_model_dir,
        tmp_path / "shm",
        workers=2,
        max_rows=1,
        restart_limit=2,
        restart_window_s=300,
        sitecustomize=FAULTS,
    ) as srv:
        asyncio.run(_poison_scenario(srv))
        assert srv.proc.poll() is None, srv.log()[-3000:]
        log = srv.log()
        assert log.count("is not run again, and a resend of it") == 2, log[-3000:]
        assert "not counted toward --restart-limit" in log
        assert "innocent bystander" not in log and "still serving" not in log  # no prompt text in a log
        assert srv.stop() == 0


async def _slow_and_stalled(srv: ServerProcess) -> None:
    async with aiohttp.ClientSession() as session:
        long_prompt = [500 + i % 1000 for i in range(1800)]  # 1,800 tokens: one 2,048-token step
        t0 = time.monotonic()
        status, body, _, _ = await _post(session, srv.url, {"prompt": long_prompt, "max_tokens": 4, "ignore_eos": True})
        assert status == 200, body
        assert time.monotonic() - t0 > 3.0  # its step did outlast the watchdog, computing
        assert _generation(srv) == 1
        status, body, _, _ = await _post(session, srv.url, {"prompt": STALL + list(range(600, 640)), "max_tokens": 4})
        assert status == 422 and body["error"]["code"] == "request_quarantined", body
        assert _generation(srv) == 3


def test_long_step_that_computes_is_not_killed_but_a_stalled_one_is(tiny_model_dir, tmp_path):
    """A 1 s watchdog: a 1.5 s step at start-up and a 3.6 s step that computes complete
    in the same GPU process; a step that stalls for 3 s without computing is killed, resubmitted,
    killed again, and quarantined."""
    with ServerProcess(
        tiny_model_dir,
        tmp_path / "shm",
        workers=1,
        prefill_budget=2048,
        watchdog_timeout_s=1,
        sitecustomize=FAULTS,
    ) as srv:
        assert _generation(srv) == 1, srv.log()[-3000:]  # the slow start-up step was not killed
        asyncio.run(_slow_and_stalled(srv))
        log = srv.log()
        assert "is still computing" in log, log[-3000:]
        assert len(re.findall(r"GPU process \d+ sent no heartbeat .*; killing it", log)) == 2, log[-3000:]
        assert srv.stop() == 0
