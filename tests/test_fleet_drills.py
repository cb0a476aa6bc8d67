"""Fleet drills through the real Envoy: three tiny-model replicas (`ringserve fleet`) under a steady
closed-loop load, on loopback, while one fault at a time is injected. Every request must end in a
full answer, an explicit error event or a 429/503 with Retry-After (a stream on a replica killed
whole breaks its connection: counted as dropped, and only allowed there). Each drill prints its
figures: time to eject, time to readmit, requests retried by Envoy.

Bounded for a 2-core box: one API worker per replica, short answers, a few clients; the module
runs in about two minutes. Skipped only when no Envoy binary can be found (the `fleet` extra,
which `make install` installs, brings one)."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

import aiohttp
import pytest

from ringserve.shm.segment import instance_id
from ringserve.tools.fleet.probe import FleetProcess, free_port_run
from ringserve.tools.fleet.replicas import FleetError, envoy_binary
from ringserve.tools.harness.drill import attach_control
from ringserve.tools.harness.otlp_receiver import OtlpReceiver
from tests.helpers.fleet_load import VIOLATIONS, ClosedLoop, Outcome, RouteWatch, one_request, wait_ready
from tests.helpers.net import metrics

try:
    envoy_binary()
except FleetError as exc:  # pragma: no cover - the fleet extra is part of `make install`
    pytest.skip(f"no Envoy binary to drill through: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

CLIENTS = 6
TOKENS = 16
EJECT_BOUND_S = 5.0  # health checks every 1 s, 2 failures; outlier detection after 3 5xx
READMIT_BOUND_S = 3.0  # one passing health check after the replica's own /ready says 200
WATCHDOG_S = 2.0  # the replicas' watchdog: how long a hung GPU process is given


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    base = free_port_run(5)
    serve = [
        "--shm-dir",
        str(tmp),
        "--max-rows",
        "8",
        "--watchdog-timeout-s",
        str(WATCHDOG_S),
        "--drain-timeout-s",
        "10",
    ]
    # traces of the requests whose client asks (sample rate 0 otherwise): the traceparent drill
    serve += ["--otlp-traces-endpoint", "", "--otlp-traces-sample-rate", "0"]
    with OtlpReceiver() as receiver:
        serve[-3] = receiver.url
        with FleetProcess(
            tmp / "run", replicas=3, model="tiny", ports=(base, base + 2, base + 1), serve_args=serve
        ) as proc:
            proc.shm_dir = str(tmp)
            proc.receiver = receiver
            yield proc


def _host(fleet, index: int) -> str:
    return fleet.replica_urls()[index].removeprefix("http://")


def _supervisor(fleet, index: int) -> int:
    return fleet.state()["replicas"][index]["pid"]


def _gpu_pid(fleet, index: int) -> int:
    seg, control = attach_control(fleet.shm_dir, instance_id(_supervisor(fleet, index)))
    try:
        return control.gpu_pid
    finally:
        seg.close()


def _retries(fleet) -> float:
    return fleet.cluster_stats().get("upstream_rq_retry", 0.0)


def _report(name: str, load: ClosedLoop, since: float, **figures) -> None:
    counts = dict(load.counts(since))
    codes = {o.code for o in load.outcomes if o.start >= since and o.code}
    if codes:
        counts["codes"] = sorted(codes)
    shown = ", ".join(f"{k} {v:.2f} s" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    print(f"\n[fleet drill] {name}: {shown}; outcomes {counts}")


def _assert_nothing_lost(load: ClosedLoop, since: float, allow: tuple[str, ...] = ()) -> None:
    counts = load.counts(since)
    assert counts["completed"] > 0
    assert not any(counts[k] for k in VIOLATIONS), counts
    unexpected = {k: v for k, v in counts.items() if k not in ("completed", "error_event", "refused", *allow)}
    assert not unexpected, counts


async def _fault_and_recover(fleet, index: int, inject, name: str, allow=()) -> dict:
    """Steady load; inject the fault on replica `index`; measure eject and readmit; settle."""
    host = _host(fleet, index)
    retried0 = _retries(fleet)
    async with (
        ClosedLoop(fleet.url, clients=CLIENTS, max_tokens=TOKENS) as load,
        RouteWatch(fleet.admin_url, host) as watch,
    ):
        await asyncio.sleep(1.5)
        t0 = time.monotonic()
        inject()
        ejected = await watch.wait(False, t0, timeout_s=15)
        ready = await wait_ready(fleet.replica_urls()[index], ejected, timeout_s=30)
        readmitted = await watch.wait(True, ready - 0.5, timeout_s=15)
        await asyncio.sleep(1.0)
    figures = {
        "time to eject": ejected - t0,
        "time to readmit": max(0.0, readmitted - ready),
        "down for": readmitted - t0,
        "requests retried": int(_retries(fleet) - retried0),
    }
    _report(name, load, t0 - 1.5, **figures)
    _assert_nothing_lost(load, 0.0, allow)
    assert figures["time to eject"] < EJECT_BOUND_S
    assert figures["time to readmit"] < READMIT_BOUND_S
    return figures


async def test_sigkill_gpu_process(fleet):
    """The killed GPU's streams get error events, its queued requests are resubmitted or retried
    elsewhere, Envoy ejects the replica and readmits it once ready."""
    await _fault_and_recover(fleet, 0, lambda: os.kill(_gpu_pid(fleet, 0), signal.SIGKILL), "SIGKILL GPU process")


async def test_sigstop_gpu_process(fleet):
    """A hung GPU: the replica's watchdog kills it after WATCHDOG_S; then as above."""
    await _fault_and_recover(fleet, 1, lambda: os.kill(_gpu_pid(fleet, 1), signal.SIGSTOP), "SIGSTOP GPU process")


async def test_sigkill_whole_replica(fleet):
    """Supervisor, GPU process and workers killed at once: connect failures are retried on the
    others; only the streams that replica was running break (dropped)."""
    await _fault_and_recover(
        fleet, 2, lambda: os.killpg(_supervisor(fleet, 2), signal.SIGKILL), "SIGKILL whole replica", allow=("dropped",)
    )


async def test_disconnect_passes_through_envoy(fleet):
    """A client that leaves mid-stream through Envoy is seen by its replica (the row is cancelled)."""

    def disconnects() -> float:
        total = 0.0
        for url in fleet.replica_urls():
            total += metrics(url).get("ringserve_disconnects_total", 0.0)
        return total

    before = disconnects()
    body = {"prompt": "leave", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(fleet.url + "/v1/completions", json=body) as resp:
            async for _ in resp.content:
                break  # the first event, then hang up
        deadline = time.monotonic() + 10
        while disconnects() <= before:
            assert time.monotonic() < deadline, "no replica saw the client leave"
            await asyncio.sleep(0.1)


async def test_a_clients_traceparent_passes_through_envoy(fleet):
    """W3C trace context from the client reaches the replica unchanged: the replica's server span
    hangs off the client's parent in the client's trace, with its tracestate, and nothing else of
    the drills' load (unsampled) is traced."""
    trace_id, parent = os.urandom(16), os.urandom(8)
    headers = {"traceparent": f"00-{trace_id.hex()}-{parent.hex()}-01", "tracestate": "fleet=1"}
    body = {"prompt": "trace me through envoy", "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        async with session.post(fleet.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    spans = fleet.receiver.trace(trace_id, want_spans=6)
    (server,) = [s for s in spans if s.parent_span_id == parent]
    assert server.name.startswith("text_completion ") and server.trace_state == "fleet=1"
    assert {s.trace_id for s in fleet.receiver.spans} == {trace_id}


async def test_rolling_restart_fails_nothing(fleet):
    """SIGTERM one replica at a time, wait until Envoy routes to it again: every request completes."""
    retried0 = _retries(fleet)
    times = []
    async with ClosedLoop(fleet.url, clients=CLIENTS, max_tokens=TOKENS) as load:
        await asyncio.sleep(1.0)
        t_start = time.monotonic()
        for index in range(3):
            async with RouteWatch(fleet.admin_url, _host(fleet, index)) as watch:
                old = _supervisor(fleet, index)
                t0 = time.monotonic()
                os.kill(old, signal.SIGTERM)
                out = await watch.wait(False, t0, timeout_s=15)
                deadline = time.monotonic() + 30
                while _supervisor(fleet, index) == old:  # the fleet restarts it once it has drained
                    assert time.monotonic() < deadline, "the fleet did not restart the replica"
                    await asyncio.sleep(0.1)
                back = await watch.wait(True, out, timeout_s=30)
                times.append((out - t0, back - t0))
        await asyncio.sleep(1.0)
    _report(
        "rolling restart",
        load,
        t_start,
        **{f"replica {i} out / back": f"{a:.2f} / {b:.2f} s" for i, (a, b) in enumerate(times)},
        requests_retried=int(_retries(fleet) - retried0),
    )
    counts = load.counts()
    assert counts["completed"] > 0 and set(counts) == {"completed"}, counts


async def test_flooded_replica_serves_the_light_tenant_its_share_promptly(fleet):
    """A heavy tenant floods replica 0 directly, past its rows, so requests wait there; the fleet's
    light tenant, routed by Envoy, is still answered there as promptly as on the other replicas
    (fair admission gives it rows at once), and least-request neither piles its load onto replica 0
    nor starves it. The split is of the answers each replica gave (Envoy's x-ringserve-replica
    header), before and during the flood.

    Not a check that the flooded replica takes less: with fair admission it is not slower for the
    light tenant, so nothing needs to move (docs/design.md#fleet). On this 2-core box it was often
    the faster one, its GPU loop already awake, and a closed loop then gets more answers from it:
    19-39 % of them in six runs (2026-12-07), where an older bound of < 38 % failed CI once."""
    hosts = [_host(fleet, i) for i in range(3)]
    flooded = fleet.replica_urls()[0]

    async def flood(stop: asyncio.Event) -> None:
        body = {"prompt": "heavy", "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one() -> None:
                while not stop.is_set():
                    await one_request(session, flooded, body, 60, {"Authorization": "Bearer heavy"})

            tasks = [asyncio.create_task(one()) for _ in range(24)]
            await stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def answered(since: float, until: float) -> list[Outcome]:
        return [o for o in load.outcomes if o.kind == "completed" and since <= o.start < until]

    def split(since: float, until: float) -> list[float]:
        done = [o.replica for o in answered(since, until)]
        return [done.count(h) / max(1, len(done)) for h in hosts]

    def p50_ms(outcomes: list[Outcome]) -> float:
        return 1000 * statistics.median(o.end - o.start for o in outcomes) if outcomes else float("inf")

    retried0 = _retries(fleet)
    async with ClosedLoop(fleet.url, clients=CLIENTS, max_tokens=TOKENS) as load:
        await asyncio.sleep(3.0)
        stop = asyncio.Event()
        t_flood = time.monotonic()
        flooding = asyncio.create_task(flood(stop))
        await asyncio.sleep(3.0)
        sample = await asyncio.to_thread(metrics, flooded)
        await asyncio.sleep(2.0)
        t_end = time.monotonic()
        stop.set()
        await flooding
    waiting = sum(v for k, v in sample.items() if k.startswith("vllm:num_requests_waiting"))
    before, during = split(0.0, t_flood), split(t_flood + 1.0, t_end)
    light = answered(t_flood + 1.0, t_end)
    on_flooded = [o for o in light if o.replica == hosts[0]]
    elsewhere = [o for o in light if o.replica != hosts[0]]
    _report(
        "heavy tenant on replica 0",
        load,
        0.0,
        split_before=" / ".join(f"{x:.0%}" for x in before),
        split_during=" / ".join(f"{x:.0%}" for x in during),
        light_p50_ms_flooded_elsewhere=f"{p50_ms(on_flooded):.0f} / {p50_ms(elsewhere):.0f}",
        waiting_on_flooded=int(waiting),
        requests_retried=int(_retries(fleet) - retried0),
    )
    _assert_nothing_lost(load, 0.0)
    assert waiting > 0, sample  # the flood is on: more streams than replica 0 has rows
    assert min(before) > 0.2  # balanced before
    # An even split is a third; 0.45 is four standard deviations of a share of the window's ~300
    # answers above it, and 0.05 is a replica the balancer left all but idle.
    assert 0.05 < during[0] < 0.45, during
    # Replica 0's median against the others' was 0.5-2.6x in five runs here; with the light tenant
    # queued behind the flood (no fair admission: planted, every request of one tenant) it was 27x
    # (1,657 against 61 ms), though its share only fell to 18 %. 8x lies about 3x from both.
    assert p50_ms(on_flooded) < 8 * p50_ms(elsewhere), (p50_ms(on_flooded), p50_ms(elsewhere))


async def test_retry_budget_holds_with_two_replicas_down(fleet):
    """Two of three replicas die and stay down (the fleet that would restart them is paused):
    Envoy ejects them, the survivor overflows, clients get 429 with Retry-After, and Envoy's
    retries stay within the budget instead of retrying every refusal twice."""
    stats0 = fleet.cluster_stats()
    os.kill(fleet.proc.pid, signal.SIGSTOP)  # no restarts while two are down
    try:
        # 64 long answers for one replica's 8 rows: far more queued work than its 2 s limit. (32
        # sat near it once the cost model priced this CPU's steps: one run in four refused none,
        # and where few were refused, their retries, answered at once, never overlapped enough to
        # reach the budget, so each refusal was retried twice.)
        async with ClosedLoop(fleet.url, clients=64, max_tokens=300) as load:
            await asyncio.sleep(1.0)
            async with RouteWatch(fleet.admin_url, _host(fleet, 1)) as watch:
                t0 = time.monotonic()
                for index in (1, 2):
                    os.killpg(_supervisor(fleet, index), signal.SIGKILL)
                ejected = await watch.wait(False, t0, timeout_s=15)
            await asyncio.sleep(6.0)
            t1 = time.monotonic()
        stats1 = fleet.cluster_stats()
    finally:
        os.kill(fleet.proc.pid, signal.SIGCONT)

    def delta(name: str) -> float:
        return stats1.get(name, 0.0) - stats0.get(name, 0.0)

    downstream = delta("downstream.downstream_rq_total")
    retried, overflow = delta("upstream_rq_retry"), delta("upstream_rq_retry_overflow")
    refused = sum(o.kind == "refused" for o in load.outcomes if ejected <= o.start <= t1)
    _report(
        "two of three replicas down",
        load,
        0.0,
        time_to_eject=ejected - t0,
        requests=int(downstream),
        retried=int(retried),
        retries_over_budget=int(overflow),
        refused_with_retry_after=refused,
    )
    _assert_nothing_lost(load, 0.0, allow=("dropped",))
    assert refused > 0  # the survivor did overflow, and said when to come back
    assert overflow > 0  # the budget, not the retry count, is what stopped retries
    # No storm: with the budget off the same drill retried 1.7 times per request (every refusal
    # twice); with it, 0.31-0.41. A retry holds its place in the budget through its
    # back-off: at Envoy's 25 ms default the instant 429s reused each place so fast that this sat
    # at 0.95 here and failed at 1.17 on the CI machine.
    assert retried < 0.7 * downstream


def _worker_generations(fleet) -> list[int]:
    """Each replica's worker slot generation (it grows when the worker is restarted)."""
    out = []
    for index in range(3):
        seg, control = attach_control(fleet.shm_dir, instance_id(_supervisor(fleet, index)))
        try:
            out.append(control.worker_slot(0)["generation"])
        finally:
            seg.close()
    return out


async def test_a_grammar_too_complex_is_refused_at_once_not_retried_round_the_fleet(fleet):
    """The issue's 5,000-rule GBNF (and a 2,200-rule one under the size cap, and the 450-pattern
    schema) through Envoy: a 400 grammar_too_complex within seconds, while every replica's /health
    answers within 1 s; no worker is restarted, Envoy retries nothing, the steady load loses
    nothing. (Before: the conversion ran on the worker's event loop, its watchdog killed it, and
    Envoy retried the reset onto every replica in turn.)"""
    from tests.helpers.grammars import gbnf_chain, pattern_schema

    bodies = [
        {"prompt": "x", "max_tokens": 4, "guided_grammar": gbnf_chain(5000)},
        {"prompt": "x", "max_tokens": 4, "guided_grammar": gbnf_chain(2200)},
        {"prompt": "x", "max_tokens": 4, "guided_json": pattern_schema(450)},
    ]
    for index, url in enumerate(fleet.replica_urls()):  # the drill before may have left some restarting
        await wait_ready(url, 0.0, timeout_s=60)
        async with RouteWatch(fleet.admin_url, _host(fleet, index)) as watch:
            await watch.wait(True, 0.0, timeout_s=30)
    generations, retried0 = _worker_generations(fleet), _retries(fleet)
    health: list[float] = []

    async def probe(session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for url in fleet.replica_urls():
                t0 = time.monotonic()
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    await resp.read()
                health.append(time.monotonic() - t0)
            await asyncio.sleep(0.05)

    answers = []
    async with ClosedLoop(fleet.url, clients=CLIENTS, max_tokens=TOKENS) as load, aiohttp.ClientSession() as session:
        await asyncio.sleep(1.0)
        t_start = time.monotonic()
        stop = asyncio.Event()
        probing = asyncio.create_task(probe(session, stop))
        for body in bodies:
            t0 = time.monotonic()
            async with session.post(fleet.url + "/v1/completions", json=body) as resp:
                answers.append((resp.status, (await resp.json())["error"]["code"], time.monotonic() - t0))
        await asyncio.sleep(1.0)
        stop.set()
        await probing
    _report(
        "grammars over the caps",
        load,
        t_start,
        answers=[f"{s} {c} in {t:.2f} s" for s, c, t in answers],
        slowest_health=max(health),
        requests_retried=int(_retries(fleet) - retried0),
    )
    assert all(status == 400 and code == "grammar_too_complex" and took < 3.0 for status, code, took in answers)
    assert max(health) < 1.0
    assert _worker_generations(fleet) == generations and _retries(fleet) == retried0
    _assert_nothing_lost(load, t_start)
