"""`ringserve drill {kill-gpu,hang-gpu,kill-worker,term} --url URL`: inject a fault under load.

The drill (its HTTP side is `drill_client.py`) opens N streaming completions against a running server, waits until every stream has
its first token, injects the fault, and measures what clients saw:

    kill-gpu     SIGKILL the GPU process           every stream completes or gets the error event
    hang-gpu     SIGSTOP the GPU process           the watchdog kills it; same as kill-gpu
    kill-worker  SIGKILL API worker 0              its connections drop; other workers' streams complete
    term         SIGTERM the supervisor            drain: streams complete, new requests get 503,
                                                   exit, every shared-memory segment unlinked

It finds the processes in the instance's control segment (read-only): the supervisor is the
segment's owner, the GPU pid and worker pids are recorded there. Exit status 0 when every
must-hold line holds (requests lost 0, KV blocks all free again, no leaked segment), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from ringserve.shm import layout as L
from ringserve.shm.control import Control
from ringserve.shm.segment import Segment, list_segments, owner_alive, pid_alive, segment_name
from ringserve.tools.harness.drill_client import StreamResult, http_status, probe_drain, stream_completion, wait_ready

FAULTS = ("kill-gpu", "hang-gpu", "kill-worker", "term")


class DrillError(Exception):
    """The drill could not run (no server, no instance, streams never started)."""


@dataclass
class DrillReport:
    fault: str
    streams_open: int
    completed: int
    error_events: int
    dropped: int  # connection closed under the client (the killed worker's streams)
    rejected: int  # refused at admission (429/503 with the error object) before the fault
    lost: int  # neither completed nor told: hung, or closed without [DONE]
    error_latency_p50_s: float | None
    error_latency_max_s: float | None
    ready_again_s: float | None
    drain_new_request_status: int | None
    kv_blocks_free: int | None
    kv_blocks_total: int | None
    leaked_segments: int
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


# -- finding the server's processes --------------------------------------------------------------


def find_instance(shm_dir: str, instance: str | None = None) -> str:
    """The one live instance under `shm_dir` (or check the named one)."""
    live = sorted({s.instance for s in list_segments(shm_dir) if s.part == "control" and s.owner_alive})
    if instance is not None:
        if instance not in live:
            raise DrillError(f"no live instance {instance} under {shm_dir} (live: {live or 'none'})")
        return instance
    if len(live) != 1:
        raise DrillError(
            f"found {len(live)} live ringserve instances under {shm_dir} ({live}); name one with --instance"
        )
    return live[0]


def attach_control(shm_dir: str, instance: str) -> tuple[Segment, Control]:
    seg = Segment.attach(segment_name(instance, "control"), shm_dir, writable=False)
    return seg, Control(seg.buf)


_OWNER_PID = next(f for f in L.CONTROL_FIELDS if f.name == "owner_pid")


async def _wait_workers(control: Control, timeout_s: float) -> None:
    """Every worker slot listening (one /ready answer only proves that one worker is)."""
    deadline = time.monotonic() + timeout_s
    while any(control.worker_slot(i)["heartbeat_age_s"] is None for i in range(control.n_workers)):
        if time.monotonic() > deadline:
            raise DrillError(f"not every API worker was listening within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


# -- the drill -------------------------------------------------------------------------------------


def _inject(fault: str, seg: Segment, control: Control) -> int:
    """Send the fault's signal; the pid it went to."""
    if fault in ("kill-gpu", "hang-gpu"):
        pid, sig = control.gpu_pid, signal.SIGKILL if fault == "kill-gpu" else signal.SIGSTOP
    elif fault == "kill-worker":
        pid, sig = control.worker_slot(0)["pid"], signal.SIGKILL
    else:
        pid, sig = _OWNER_PID.read(seg.buf), signal.SIGTERM  # the supervisor created the segment
    if pid <= 0:
        raise DrillError(f"the control segment records no pid for the {fault} target")
    os.kill(pid, sig)
    return pid


async def run_drill(
    fault: str,
    url: str,
    shm_dir: str,
    *,
    streams: int = 8,
    max_tokens: int = 200,
    instance: str | None = None,
    ready_timeout_s: float = 120.0,
    stream_timeout_s: float = 120.0,
) -> DrillReport:
    """Run one drill against the server at `url` whose shared memory lives in `shm_dir`."""
    if fault not in FAULTS:
        raise DrillError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    instance = find_instance(shm_dir, instance)
    seg, control = attach_control(shm_dir, instance)
    body = {"prompt": "drill", "max_tokens": max_tokens, "stream": True, "temperature": 1.0, "ignore_eos": True}
    target: int | None = None
    conn = aiohttp.TCPConnector(limit=streams + 8, force_close=True)
    try:
        async with aiohttp.ClientSession(connector=conn) as session:
            if not await wait_ready(session, url, ready_timeout_s):
                raise DrillError(f"{url}/ready did not answer 200 within {ready_timeout_s:.0f} s")
            await _wait_workers(control, ready_timeout_s)
            results = [StreamResult() for _ in range(streams)]
            events = [asyncio.Event() for _ in range(streams)]
            tasks = [
                asyncio.create_task(stream_completion(session, url, body, r, e, stream_timeout_s))
                for r, e in zip(results, events)
            ]
            try:
                async with asyncio.timeout(30):
                    await asyncio.gather(*(e.wait() for e in events))
            except TimeoutError:
                raise DrillError("the streams did not all start within 30 s") from None
            before = _generation(fault, control)
            t_fault = time.monotonic()
            target = _inject(fault, seg, control)
            recovery = None
            if fault != "term":
                recovery = asyncio.create_task(
                    _recovered(session, url, control, fault, before, t_fault, ready_timeout_s)
                )
            drain_status = await probe_drain(session, url) if fault == "term" else None
            await asyncio.gather(*tasks)
            ready_s = await recovery if recovery is not None else None
            free, total = await _blocks_settled(control, fault)
    finally:
        seg.close()
        if fault == "hang-gpu" and target is not None and pid_alive(target):
            # The watchdog did not kill the stopped process (the table says so); do not leave
            # the server hung behind us.
            os.kill(target, signal.SIGCONT)
    leaked = await _leaked_segments(shm_dir, instance, fault, target)
    return _report(fault, results, t_fault, ready_s, drain_status, free, total, leaked)


def _generation(fault: str, control: Control) -> int:
    """The generation the fault replaces: the GPU process's, or worker slot 0's."""
    return control.worker_slot(0)["generation"] if fault == "kill-worker" else control.gpu_generation


async def _recovered(
    session: aiohttp.ClientSession,
    url: str,
    control: Control,
    fault: str,
    before: int,
    t_fault: float,
    timeout_s: float,
) -> float | None:
    """Seconds from the fault until the replacement process serves and /ready says 200."""
    deadline = t_fault + timeout_s
    while time.monotonic() < deadline:
        if fault == "kill-worker":
            slot = control.worker_slot(0)
            replaced = slot["generation"] > before and slot["heartbeat_age_s"] is not None
        else:
            replaced = control.gpu_generation > before and control.gpu_state == L.GpuState.READY
        if replaced and await http_status(session, url, "/ready") == 200:
            return time.monotonic() - t_fault
        await asyncio.sleep(0.05)
    return None


async def _blocks_settled(control: Control, fault: str) -> tuple[int | None, int | None]:
    """KV blocks (free, total) once every block is back, or after 10 s of waiting."""
    if fault == "term":
        return None, None
    deadline = time.monotonic() + 10.0
    while True:
        stats = control.gpu_stats.read()
        free, total = int(stats["kv_blocks_free"]), int(stats["kv_blocks_total"])
        if (free == total and total > 0) or time.monotonic() > deadline:
            return free, total
        await asyncio.sleep(0.05)


async def _leaked_segments(shm_dir: str, instance: str, fault: str, supervisor: int) -> int:
    """Segments no live server owns; after `term`, every segment the instance still has."""
    if fault == "term":
        deadline = time.monotonic() + 60.0
        while pid_alive(supervisor) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return sum(1 for s in list_segments(shm_dir) if s.instance == instance)
    return sum(1 for s in list_segments(shm_dir) if not owner_alive(s.instance))


def _report(
    fault: str,
    results: list[StreamResult],
    t_fault: float,
    ready_s: float | None,
    drain_status: int | None,
    free: int | None,
    total: int | None,
    leaked: int,
) -> DrillReport:
    count = {
        k: sum(r.outcome == k for r in results) for k in ("completed", "error_event", "dropped", "rejected", "lost")
    }
    lat = sorted(r.error_t - t_fault for r in results if r.error_t is not None)
    rep = DrillReport(
        fault=fault,
        streams_open=len(results),
        completed=count["completed"],
        error_events=count["error_event"],
        dropped=count["dropped"],
        rejected=count["rejected"],
        lost=count["lost"] + sum(r.outcome == "open" for r in results),
        error_latency_p50_s=statistics.median(lat) if lat else None,
        error_latency_max_s=lat[-1] if lat else None,
        ready_again_s=ready_s,
        drain_new_request_status=drain_status,
        kv_blocks_free=free,
        kv_blocks_total=total,
        leaked_segments=leaked,
    )
    v = rep.violations
    if rep.lost:
        v.append(f"{rep.lost} requests lost (neither completed nor got an explicit error)")
    if rep.leaked_segments:
        v.append(f"{rep.leaked_segments} shared-memory segments leaked")
    if fault != "term":
        if ready_s is None:
            v.append("/ready did not return to 200")
        if free is None or free != total:
            v.append(f"KV blocks free {free} != total {total}")
    if fault in ("kill-gpu", "hang-gpu"):
        if rep.dropped:
            v.append(f"{rep.dropped} streams dropped without an error event")
        if not rep.error_events:
            v.append("no stream got the error event (were they all finished before the fault?)")
    if fault == "kill-worker":
        bad = [r for r in results if r.worker not in (None, 0) and r.outcome != "completed"]
        if bad:
            v.append(f"{len(bad)} streams of surviving workers did not complete")
    if fault == "term":
        # Streams longer than the drain timeout end with the server_shutdown error event, which is
        # the promised outcome; a stream cut off or never told is the failure.
        told = sum(r.outcome == "error_event" and r.error_code == "server_shutdown" for r in results)
        unfinished = rep.streams_open - rep.completed - rep.rejected - told
        if unfinished:
            v.append(f"{unfinished} streams neither finished during the drain nor got the server_shutdown error event")
        if drain_status != 503:
            v.append(f"a new request during the drain got {drain_status}, not 503")
    return rep


# -- output ----------------------------------------------------------------------------------------


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    return str(value)


def format_table(rep: DrillReport) -> str:
    rows: list[tuple[str, object]] = [
        ("streams open", rep.streams_open),
        ("streams completed", rep.completed),
        ("streams with the error event", rep.error_events),
        ("streams dropped (connection closed)", rep.dropped),
        ("refused at admission, before the fault", rep.rejected),
        ("fault -> error event, p50", rep.error_latency_p50_s),
        ("fault -> error event, max", rep.error_latency_max_s),
        ("fault -> /ready again", rep.ready_again_s),
    ]
    if rep.fault == "term":
        rows.append(("new request while draining", rep.drain_new_request_status))
    rows += [
        ("requests lost (must be 0)", rep.lost),
        (
            "KV blocks free / total",
            None if rep.kv_blocks_total is None else f"{rep.kv_blocks_free} / {rep.kv_blocks_total}",
        ),
        ("leaked shm segments (must be 0)", rep.leaked_segments),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"drill {rep.fault}", *(f"  {name:<{width}}  {_fmt(val)}" for name, val in rows)]
    if rep.rejected:
        lines.append(
            f"  note: {rep.rejected} streams were refused before the fault (queue full): "
            "lower --streams or --max-tokens to put them all under the fault"
        )
    lines.append("  PASS" if rep.ok else "  FAIL: " + "; ".join(rep.violations))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve drill", description=__doc__.split("\n\n")[0])
    p.add_argument("fault", choices=FAULTS)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--streams", type=int, default=8, help="streams open when the fault hits")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens each stream asks for")
    p.add_argument("--shm-dir", default=L.DEFAULT_DIRECTORY, help="the server's shared-memory directory")
    p.add_argument("--instance", help="instance id, when several servers share --shm-dir")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /ready")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.streams < 1 or args.max_tokens < 1:
        p.error("--streams and --max-tokens must be >= 1")
    try:
        rep = asyncio.run(
            run_drill(
                args.fault,
                args.url.rstrip("/"),
                args.shm_dir,
                streams=args.streams,
                max_tokens=args.max_tokens,
                instance=args.instance,
                ready_timeout_s=args.ready_timeout,
            )
        )
    except DrillError as exc:
        print(f"ringserve drill: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(rep), "ok": rep.ok}))
    else:
        print(format_table(rep))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
