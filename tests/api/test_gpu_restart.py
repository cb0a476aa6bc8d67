"""What clients see when the GPU process restarts under them, on the in-process fake GPU: the
error event for streams that had tokens, transparent resubmission for requests that had none
(including the Submit a restarted process discards), 503 + Retry-After while not ready."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from ringserve.api.errors import ApiError
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.gpu_client import GpuClient
from ringserve.api.restart_hold import MAX_RESUBMITS, QUARANTINE_ERROR, RESTART_ERROR
from ringserve.shm.messages import Accepted, Error, Finish, Rejected, SamplingParams, Submit, Token, fingerprint
from tests.helpers.fake_api import prompt_text_of
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio


def _status(reload_s: float = 5.0, restart_status: dict | None = None):
    """A `serve(status=...)` factory: the fake's status with a measured load time and a restart
    status, as a supervised worker reads them from the control block."""

    class Scripted(FakeStatus):
        def reload_s(self) -> float:
            return reload_s

        def restart_status(self) -> dict | None:
            return restart_status

    return Scripted


class _Control:
    """The control block as `ControlStatus` reads it, with facts that are missing or unreadable."""

    gpu_state = 0  # not READY
    refusals_sequence = 0  # no tenant refused at once

    def __init__(self, facts) -> None:
        self.facts = facts

    def refusals(self):
        return 0, 0.0, {}

    def worker_stats(self, slot: int):
        return self  # its stats region too: publishing this worker's stats goes nowhere

    def update(self, values) -> None:
        pass

    def publish(self) -> None:
        pass

    def worker_heartbeat(self, slot: int) -> None:
        pass

    def model_facts(self):
        if isinstance(self.facts, Exception):
            raise self.facts
        return self.facts


def _submit(rid: int, deadline_s: float = 60.0) -> Submit:
    now = time.time()
    return Submit(
        rid=rid,
        request_id=f"r{rid}",
        tenant="t",
        prompt_ids=[5, 6, 7],
        max_tokens=6,
        sampling=SamplingParams(),
        arrival_ts=now,
        deadline_ts=now + deadline_s,
    )


async def _until(cond, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def _collect(stream) -> list:
    """Every record of a stream until all its samples finished or it failed."""
    items: list = []
    async with asyncio.timeout(5):
        while not any(isinstance(i, (Finish, Error)) for i in items):
            items += await stream.next_batch()
    return items


# GpuClient -------------------------------------------------------------------------------------
async def test_streamed_request_gets_restart_error_with_its_rid():
    """A request that already had a token is failed with the gpu_process_restart error."""
    fake = FakeGpu(step_interval_s=0.01, paused=False)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    await client.submit(stream, _submit(stream.rid))
    first = await stream.next_batch()
    assert isinstance(first[0], Token)
    fake.restart()
    items = await _collect(stream)
    errors = [i for i in items if isinstance(i, Error)]
    assert errors and errors[0].code == RESTART_ERROR and errors[0].rid == stream.rid
    assert client.resubmitted == 0
    client.close()


async def test_request_without_tokens_is_resubmitted_under_a_new_rid():
    """Admitted but no token yet at the restart: resubmitted once READY, same tokens come out."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    old_rid = stream.rid
    await client.submit(stream, _submit(old_rid))
    fake.restart()
    await asyncio.sleep(0.12)  # a few readiness polls: nothing may be sent while not ready
    assert fake.discarded == [] and len(fake.submits) == 1
    fake.paused = False
    fake.come_back()
    items = await _collect(stream)
    assert stream.rid != old_rid and client.resubmitted == 1
    assert [i.token_id for i in items if isinstance(i, Token)] == [5, 6, 7, 5, 6, 7]
    assert isinstance(items[-1], Finish) and items[-1].reason == "length"
    assert [s.rid for s in fake.submits] == [old_rid, stream.rid]
    client.close()


async def test_request_quarantined_at_a_restart_fails_instead_of_being_resubmitted():
    """Resubmitted once, then quarantined by the supervisor at the next death (it was in the step
    both times): it gets the request_quarantined error, not a second resubmission, and its
    admission answer is 422 (a request that crashes the GPU process must not crash it forever)."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready, quarantined=lambda: fake.quarantined)
    client.start()
    stream = client.open_stream()
    await client.submit(stream, _submit(stream.rid))
    fake.restart()
    fake.come_back()
    await _until(lambda: client.resubmitted == 1)
    fake.restart(quarantine=(stream.submit.fingerprint,))
    fake.come_back()
    items = await _collect(stream)
    assert isinstance(items[-1], Error) and items[-1].code == QUARANTINE_ERROR
    assert "refused for 600 s" in items[-1].message
    assert client.resubmitted == 1 and len(fake.submits) == 2
    client.close()


async def test_queued_request_is_resubmitted_at_every_restart_up_to_the_cap():
    """A request never blamed for a death (queued, not in the step) is resubmitted at each one, up
    to MAX_RESUBMITS times; held through one more, it fails with the restart error."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready, quarantined=lambda: fake.quarantined)
    client.start()
    stream = client.open_stream()
    await client.submit(stream, _submit(stream.rid))
    for n in range(1, MAX_RESUBMITS + 1):
        fake.restart()
        fake.come_back()
        await _until(lambda n=n: client.resubmitted == n)
    fake.restart()
    fake.come_back()
    items = await _collect(stream)
    assert isinstance(items[-1], Error) and items[-1].code == RESTART_ERROR
    assert len(fake.submits) == MAX_RESUBMITS + 1
    client.close()


async def test_resend_of_a_quarantined_request_is_refused_before_the_ring():
    """The same request again (same tenant, prompt and parameters, another request id) while it is
    quarantined: 422 request_quarantined with the time left as Retry-After, nothing sent; a request
    that differs in one parameter, or comes from another tenant, is not refused."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready, quarantined=lambda: fake.quarantined)
    client.start()
    fake.quarantined[fingerprint(_submit(0), b"")] = time.time() + 30.0
    stream = client.open_stream()
    with pytest.raises(ApiError) as info:
        await client.submit(stream, msgspec.structs.replace(_submit(stream.rid), request_id="again"))
    assert info.value.status == 422 and info.value.code == QUARANTINE_ERROR == info.value.type
    assert 29 <= info.value.retry_after_s <= 30 and fake.submits == []
    for other in (msgspec.structs.replace(_submit(0), max_tokens=7), msgspec.structs.replace(_submit(0), tenant="u")):
        s = client.open_stream()
        assert isinstance(await client.submit(s, msgspec.structs.replace(other, rid=s.rid)), Accepted)
    client.close()


async def test_submit_discarded_after_the_fence_is_resubmitted():
    """The race: a Submit pushed after the fence but before the worker noticed it is discarded by
    the new process; the worker resubmits it once READY instead of waiting forever."""
    fake = FakeGpu()
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    fake.ready = False  # fenced: what is pushed now, the next process discards
    admission = asyncio.ensure_future(client.submit(stream, _submit(stream.rid)))
    await _until(lambda: fake.discarded)
    fake.restart()  # only now does the worker see the generation change
    fake.come_back()
    answer = await asyncio.wait_for(admission, 5)
    assert isinstance(answer, Accepted) and answer.rid == stream.rid
    items = await _collect(stream)
    assert isinstance(items[-1], Finish) and items[-1].reason == "length"
    assert len(fake.discarded) == 1 and client.resubmitted == 1
    client.close()


async def test_submit_while_restarting_waits_for_ready():
    """A Submit made after the restart was seen is held, not pushed onto doomed rings."""
    fake = FakeGpu()
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    fake.restart()
    await asyncio.sleep(0.01)  # the restart notice is delivered
    stream = client.open_stream()
    admission = asyncio.ensure_future(client.submit(stream, _submit(stream.rid)))
    await asyncio.sleep(0.12)
    assert fake.discarded == [] and fake.submits == [] and not admission.done()
    fake.come_back()
    assert isinstance(await asyncio.wait_for(admission, 5), Accepted)
    client.close()


async def test_held_request_past_its_deadline_fails_with_restart_error():
    """Resubmission is only within the request's deadline; after it the admission fails."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    admission = asyncio.ensure_future(client.submit(stream, _submit(stream.rid, deadline_s=0.05)))
    fake.restart()
    await asyncio.sleep(0.1)
    fake.come_back()
    with pytest.raises(ApiError) as err:
        await asyncio.wait_for(admission, 5)
    assert err.value.status == 503 and err.value.type == RESTART_ERROR
    assert err.value.body()["error"]["tokens_streamed"] == 0
    assert client.resubmitted == 0
    client.close()


# through the app -----------------------------------------------------------------------------
async def test_sse_restart_error_event_carries_type_request_id_and_tokens(serve):
    """The error event: type gpu_process_restart, the request id, tokens streamed; then [DONE]."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake, ready=lambda: fake.ready)
    resp = await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1000, "stream": True})
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    fake.restart()
    events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    err = events[-2]
    tokens = 3 + sum(1 for e in events[:-2] if e["choices"])
    assert err["error"]["type"] == "gpu_process_restart" == err["error"]["code"]
    assert err["error"]["tokens_streamed"] == tokens
    assert err["request_id"] == resp.headers["x-request-id"]


async def test_non_streaming_restart_is_503_with_the_same_error_object(serve):
    """A plain request that had tokens gets 503, the error object and Retry-After (load time)."""
    fake = FakeGpu(step_interval_s=0.005)
    served = await serve(fake=fake, ready=lambda: fake.ready, status=_status(reload_s=7.2))
    pending = asyncio.ensure_future(served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1000}))
    await _until(lambda: any(r.generated[0] > 2 for r in fake._rows.values()))
    fake.restart()
    resp = await asyncio.wait_for(pending, 5)
    body = await resp.json()
    assert resp.status == 503 and resp.headers["Retry-After"] == "8"
    assert body["error"]["type"] == "gpu_process_restart" and body["error"]["tokens_streamed"] > 2
    assert resp.headers["x-request-id"]


async def test_stream_without_tokens_completes_after_restart(serve, codec):
    """A stream queued (no token) at the restart completes normally once the GPU is back."""
    fake = FakeGpu(paused=True)
    served = await serve(fake=fake, ready=lambda: fake.ready)
    pending = asyncio.ensure_future(
        served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True})
    )
    await _until(lambda: fake.submits)
    fake.restart()
    await asyncio.sleep(0.06)
    fake.paused = False
    fake.come_back()
    resp = await asyncio.wait_for(pending, 5)
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ids = prompt_text_of(codec, "hello")
    text = "".join(e["text"] for e in events[:-1] if "text" in e)
    assert text == codec.decode((ids * 4)[:4])
    assert served.state.client.resubmitted == 1 and len(fake.submits) == 2


async def test_not_ready_is_503_with_retry_after_from_load_time(serve):
    """While the GPU is not ready, /ready and new requests are 503 with Retry-After ≈ load_s."""
    fake = FakeGpu()
    fake.ready = False
    served = await serve(fake=fake, ready=lambda: fake.ready, status=_status(reload_s=2.4))
    ready = await served.client.get("/ready")
    resp = await served.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ready.status == 503 and ready.headers["Retry-After"] == "3"
    assert resp.status == 503 and resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"]["code"] == "gpu_not_ready"


async def test_retry_after_falls_back_when_load_time_unknown(serve):
    """No published load time or a failing control-block read: Retry-After is the default, never 500."""
    from ringserve.api.gpu_status import ControlStatus

    for facts in ({}, OSError("torn")):
        control = _Control(facts)
        served = await serve(status=lambda fake, ready, control=control: ControlStatus(control, 0, 0.0))
        resp = await served.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status == 503 and resp.headers["Retry-After"] == "5"


async def test_cancelled_request_is_not_resubmitted():
    """A request cancelled before its first token is not brought back by a restart."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    await client.submit(stream, _submit(stream.rid))
    client.cancel(stream.rid, "disconnect")
    fake.restart()
    fake.come_back()
    await asyncio.sleep(0.15)
    assert client.resubmitted == 0 and len(fake.submits) == 1
    client.close()


async def test_held_request_gets_an_error_when_the_gpu_is_not_back_in_time():
    """A request held across a restart waits at most hold_s for the new GPU process, then fails
    with the restart error quoting how the last one ended (issue 15: held requests went
    unanswered when no GPU process came back)."""
    fake = FakeGpu()
    client = GpuClient(fake, ready=lambda: fake.ready, hold_s=0.2, down_reason=lambda: "was killed by SIGKILL")
    client.start()
    fake.restart()
    await asyncio.sleep(0.01)
    stream = client.open_stream()
    t0 = time.monotonic()
    with pytest.raises(ApiError) as info:
        await asyncio.wait_for(client.submit(stream, _submit(stream.rid)), 5)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert info.value.status == 503 and info.value.code == RESTART_ERROR
    assert "it was killed by SIGKILL" in info.value.message and "within 0.2 s" in info.value.message
    client.close()


async def test_draining_worker_fails_what_it_holds_at_once():
    """Once the worker drains no GPU process is started for it: held requests, and those a later
    restart would hold, get the server_shutdown error at once."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    first, second = client.open_stream(), client.open_stream()
    await client.submit(first, _submit(first.rid))
    fake.restart()
    await asyncio.sleep(0.01)
    client.restart_hold.stop_holding("server_shutdown", "shutting down")
    assert (await _collect(first))[-1].code == "server_shutdown"
    with pytest.raises(ApiError) as info:  # the restart is still in progress: it would be held
        await asyncio.wait_for(client.submit(second, _submit(second.rid)), 5)
    assert info.value.code == "server_shutdown" and info.value.status == 503
    client.close()


async def test_not_ready_503_quotes_the_last_error_and_the_backoff(serve):
    """While the supervisor restarts the GPU process, a request gets 503 at once quoting how the
    last process ended, with Retry-After = the backoff still to wait + the measured load time."""
    status = {
        "state": "restarting",
        "last_error": "exited with status 1: CheckpointError: /m: model directory not found",
        "failures": 4,
        "retry_at": time.time() + 10.0,
    }
    served = await serve(ready=lambda: False, status=_status(reload_s=3.0, restart_status=status))
    for path, method in (("/v1/completions", "post"), ("/ready", "get")):
        resp = await getattr(served.client, method)(path, json={"prompt": "x"} if method == "post" else None)
        assert resp.status == 503
        err = (await resp.json())["error"]
        assert err["code"] == "gpu_not_ready"
        assert "it exited with status 1: CheckpointError: /m: model directory not found" in err["message"]
        assert "4 failures" in err["message"]
        assert 12 <= int(resp.headers["Retry-After"]) <= 13


async def test_quarantined_requests_through_the_app(serve):
    """Through the routes: a plain request quarantined while held answers 422 with the error
    object; a stream that had started gets the request_quarantined error event, then [DONE]; a
    resend of either is 422 with Retry-After before anything is submitted."""
    fake = FakeGpu(paused=True)
    served = await serve(fake=fake, ready=lambda: fake.ready)
    plain = asyncio.ensure_future(served.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 4}))
    streamed = asyncio.ensure_future(
        served.client.post("/v1/completions", json={"prompt": "s", "max_tokens": 4, "stream": True})
    )
    await _until(lambda: len(fake.submits) == 2)
    fake.restart(quarantine=tuple(s.fingerprint for s in fake.submits))
    fake.come_back()
    resp = await asyncio.wait_for(plain, 5)
    body = await resp.json()
    assert resp.status == 422 and body["error"]["code"] == "request_quarantined" == body["error"]["type"]
    assert "Retry-After" not in resp.headers and resp.headers["x-request-id"]
    resp = await asyncio.wait_for(streamed, 5)
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert resp.status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_quarantined" and events[-2]["error"]["tokens_streamed"] == 0
    for body in ({"prompt": "p", "max_tokens": 4}, {"prompt": "s", "max_tokens": 4, "stream": True}):
        again = await served.client.post("/v1/completions", json=body)
        assert again.status == 422 and 590 <= int(again.headers["Retry-After"]) <= 600
        assert (await again.json())["error"]["code"] == "request_quarantined"
    assert len(fake.submits) == 2 and served.state.client.resubmitted == 0


async def test_resubmission_refused_by_the_restarted_process_ends_the_request():
    """Admitted before the restart, refused (429) when resubmitted to the restarted process: the
    request ends with the restart error quoting the refusal; it does not wait forever for tokens
    that will never come (the refusal used to be dropped: its admission was already answered)."""
    fake = FakeGpu(paused=True)
    client = GpuClient(fake, ready=lambda: fake.ready)
    client.start()
    stream = client.open_stream()
    await client.submit(stream, _submit(stream.rid))
    fake.restart()
    fake.admit = lambda msg: Rejected(rid=msg.rid, status=429, code="overloaded", message="queue full", retry_after_s=3)
    fake.come_back()
    items = await _collect(stream)
    assert isinstance(items[-1], Error) and items[-1].code == RESTART_ERROR
    assert "queue full" in items[-1].message and client.resubmitted == 1
    client.close()
