"""`ringserve bench ring [--json] [--scale X]`: our shared-memory ring against pyzmq `ipc://`
PUSH/PULL (what vLLM and SGLang use between these processes) and `multiprocessing.Queue`, in the
same run on the same machine.

* Throughput, one way, sender and receiver in separate processes: raw byte records of 64 B,
  1 KiB and 16 KiB, and ~1 KiB msgspec messages (`Submit`, encoded by the sender and decoded by
  the receiver, both counted). Time runs from the sender's start to the receiver's last record.
* Round-trip latency of one 1 KiB record each way, p50 / p99, every receiver blocked in the
  kernel until woken (the ring by its eventfd doorbell; no busy spinning).

The ratios `ring_vs_zmq_*` are ours over theirs: for latency lower is better (goal <= 0.2), for
throughput higher is better (goals: 16 KiB >= 3, messages >= 1). Every figure is the best of
`--repeat` interleaved runs (see `run`). The ring side uses the product's API as the server
does: `try_push` per record, a doorbell ring per 64 records, `pop_many` / zero-copy `pop_views`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from ringserve.shm import messages
from ringserve.shm.instance import ShmInstance
from ringserve.shm.ring import Ring

_CTX = multiprocessing.get_context("fork")
TRANSPORTS = ("ring", "zmq", "mpq")
# case -> (payload bytes or "msg", records at scale 1)
CASES: dict[str, tuple[int | str, int]] = {
    "64B": (64, 100_000),
    "1KiB": (1024, 50_000),
    "16KiB": (16384, 10_000),
    "msg_1KiB": ("msg", 30_000),
}
LATENCY_ROUNDS = 3_000
RING_BYTES = 4 * 1024 * 1024  # the server's default ring size
BATCH = 64  # ring: records per pop, and pushes per doorbell ring


def _message() -> messages.Submit:
    """A Submit whose msgpack encoding is about 1 KiB (300 token ids of 3 bytes)."""
    return messages.Submit(
        rid=1,
        request_id="cmpl-0123456789abcdef",
        tenant="bench",
        prompt_ids=list(range(30_000, 30_300)),
        max_tokens=256,
        sampling=messages.SamplingParams(temperature=0.7, top_p=0.9),
        arrival_ts=time.time(),
        deadline_ts=time.time() + 600,
    )


# --- endpoints: each returns (send, recv_batch, close) built inside the child process ----------
class _RingEnd:
    """One direction of the ring with its doorbells; `space` wakes a producer on a full ring."""

    def __init__(self, env: dict, sending: bool, direction: int = 0):
        shm = ShmInstance.attach(env["instance"], directory=env["dir"], bell_fds=env["fds"])
        seg = (shm.request_segments if direction == 0 else shm.output_segments)[0]
        bell = shm.input_bell if direction == 0 else shm.output_bells[0] if shm.output_bells else None
        if bell is None:
            raise RuntimeError("the ring bench attaches with its doorbells")
        self.bell = bell
        self.space = env["space"][direction]
        self.ring = Ring.producer(seg.buf) if sending else Ring.consumer(seg.buf)
        self.flush = self.bell.ring  # the doorbell, rung once per batch of pushes
        self.backed_up = False

    def send(self, data) -> None:
        if not self.ring.try_push(data):
            self._wait_for_space(data)

    def _wait_for_space(self, data) -> None:
        self.bell.ring()  # the consumer must be awake to make room
        while not self.ring.try_push(data):
            self.space.wait(0.001)

    def recv_batch(self, views: bool):
        ring = self.ring
        while True:
            # Small batches hand space back to the producer early instead of after a whole ring.
            batch = ring.pop_views(BATCH) if views else ring.pop_many(BATCH)
            if batch:
                # A full batch means the ring was backed up: the producer may be waiting for
                # space. Waking it only then keeps the syscall off the common path; views free
                # their space only on release(), so wake it there.
                self.backed_up = len(batch) == BATCH
                if self.backed_up and not views:
                    self.space.ring()
                return batch
            self.bell.wait(0.05)

    def recv_reply(self):
        """Latency mode: sleep on the doorbell first (the reply always rings it), then pop.

        `wait(None)` is one blocking read; the parent kills us if the peer never answers.
        """
        ring, bell = self.ring, self.bell
        while True:
            bell.wait(None)
            rec = ring.pop()  # ping-pong: one record in flight
            if rec is not None:
                return (rec,)

    def release(self) -> None:
        self.ring.release()
        if self.backed_up:
            self.space.ring()


class _ZmqEnd:
    def __init__(self, env: dict, sending: bool, direction: int = 0):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH if sending else zmq.PULL)
        addr = f"ipc://{env['dir']}/zmq{direction}"
        self.sock.bind(addr) if sending else self.sock.connect(addr)
        self.send = self.sock.send

    def flush(self) -> None:
        pass

    def recv_batch(self, views: bool = False):
        return [self.sock.recv()]

    recv_reply = recv_batch

    def release(self) -> None:
        pass


class _QueueEnd:
    def __init__(self, env: dict, sending: bool, direction: int = 0):
        self.q = env["queues"][direction]
        self.send = self.q.put

    def flush(self) -> None:
        pass

    def recv_batch(self, views: bool = False):
        return [self.q.get()]

    recv_reply = recv_batch

    def release(self) -> None:
        pass


_ENDS: dict[str, Any] = {"ring": _RingEnd, "zmq": _ZmqEnd, "mpq": _QueueEnd}  # one duck-typed interface


# --- child processes ---------------------------------------------------------------------------
def _sender(transport: str, env: dict, case: str, n: int, barrier, conn) -> None:
    end = _ENDS[transport](env, sending=True)
    size, _ = CASES[case]
    end.send(b"warm-up")  # connection set-up (zmq) and feeder-thread start (mpq) are not timed
    end.flush()
    barrier.wait()
    t0 = time.monotonic_ns()
    send, flush = end.send, end.flush  # flush: the ring's doorbell; a no-op for the others
    if size == "msg":
        msg, encode = _message(), messages.encode
        for i in range(n):
            send(encode(msg))
            if i % BATCH == 0:
                flush()
    else:
        payload = os.urandom(int(size))
        for i in range(n):
            send(payload)
            if i % BATCH == 0:
                flush()
    flush()
    conn.send(t0)
    conn.recv()  # keep sockets and queues open until the receiver has everything


def _receiver(transport: str, env: dict, case: str, n: int, barrier, conn) -> None:
    end = _ENDS[transport](env, sending=False)
    decoding = CASES[case][0] == "msg"
    decode = messages.decode
    if len(end.recv_batch(views=False)) != 1:  # the warm-up record, alone
        raise RuntimeError("warm-up record missing")
    barrier.wait()
    got = nbytes = 0
    while got < n:
        batch = end.recv_batch(views=decoding)
        got += len(batch)
        if decoding:
            for rec in batch:
                nbytes += len(rec)
                decode(rec)
            end.release()
        else:
            nbytes += sum(map(len, batch))
    conn.send((time.monotonic_ns(), got, nbytes))


def _pinger(transport: str, env: dict, rounds: int, barrier, conn) -> None:
    out, back = _ENDS[transport](env, True, 0), _ENDS[transport](env, False, 1)
    send, flush, recv = out.send, out.flush, back.recv_reply
    payload = os.urandom(1024)
    clock = time.perf_counter_ns
    barrier.wait()
    lat = []
    for _ in range(rounds):
        t0 = clock()
        send(payload)
        flush()
        reply = recv()
        lat.append(clock() - t0)
        if len(reply) != 1 or len(reply[0]) != 1024:
            raise RuntimeError("round trip returned the wrong record")
    conn.send(lat)


def _ponger(transport: str, env: dict, rounds: int, barrier, conn) -> None:
    inbound, out = _ENDS[transport](env, False, 0), _ENDS[transport](env, True, 1)
    send, flush, recv = out.send, out.flush, inbound.recv_reply
    barrier.wait()
    for _ in range(rounds):
        for rec in recv():
            send(rec)
        flush()
    conn.send(None)
    conn.recv()


def _run_pair(transport: str, env: dict, targets, args) -> tuple:
    barrier = _CTX.Barrier(2)
    pipes = [_CTX.Pipe() for _ in targets]
    procs = [
        _CTX.Process(target=t, args=(transport, env, *args, barrier, child), daemon=True)
        for t, (_, child) in zip(targets, pipes)
    ]
    for p in procs:
        p.start()
    try:
        results = []
        for parent, _ in pipes:
            if not parent.poll(300):
                raise RuntimeError(f"{transport} benchmark process did not finish")
            results.append(parent.recv())
        for parent, _ in pipes:
            parent.send(None)
        return tuple(results)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _environment(directory: str, transport: str):
    env: dict = {"dir": directory}
    shm = None
    if transport == "ring":
        shm = ShmInstance.create(ring_bytes=RING_BYTES, n_workers=1, directory=directory)
        from ringserve.shm.doorbell import Doorbell

        env.update(instance=shm.instance, fds=shm.bell_fds(), space=[Doorbell.create(), Doorbell.create()])
    elif transport == "mpq":
        env["queues"] = [_CTX.Queue(), _CTX.Queue()]
    return env, shm


def _measure_throughput(transport: str, directory: str, case: str, n: int) -> dict:
    env, shm = _environment(directory, transport)
    try:
        t0, (t1, got, nbytes) = _run_pair(transport, env, (_sender, _receiver), (case, n))
    finally:
        if shm is not None:
            shm.unlink()
            shm.close()
    secs = (t1 - t0) / 1e9
    return {
        "records": got,
        "seconds": round(secs, 4),
        "records_per_s": round(got / secs),
        "mb_per_s": round(nbytes / secs / 1e6, 1),
    }


def _measure_latency(transport: str, directory: str, rounds: int) -> dict:
    env, shm = _environment(directory, transport)
    try:
        lat, _ = _run_pair(transport, env, (_pinger, _ponger), (rounds + 100,))
    finally:
        if shm is not None:
            shm.unlink()
            shm.close()
    lat = sorted(lat[100:])  # drop warm-up
    return {
        "rounds": len(lat),
        "p50_us": round(lat[len(lat) // 2] / 1e3, 1),
        "p99_us": round(lat[int(len(lat) * 0.99)] / 1e3, 1),
    }


def run(scale: float = 1.0, transports=TRANSPORTS, repeat: int = 3) -> dict:
    """Every case for every transport, `repeat` times interleaved; returns the `--json` object.

    Each figure is the best of the repeats (highest rate; the latency run with the lowest p50):
    on a shared machine, other load only ever makes a run slower, so the best run is the one
    least disturbed, and interleaving gives every transport the same chances.
    """
    throughput: dict = {t: {} for t in transports}
    latency: dict = {}
    directory = tempfile.mkdtemp(prefix="ringserve-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for _ in range(repeat):
            for transport in transports:
                for case, (_, count) in CASES.items():
                    got = _measure_throughput(transport, directory, case, max(100, int(count * scale)))
                    best = throughput[transport].get(case)
                    if best is None or got["records_per_s"] > best["records_per_s"]:
                        throughput[transport][case] = got
                got = _measure_latency(transport, directory, max(200, int(LATENCY_ROUNDS * scale)))
                if transport not in latency or got["p50_us"] < latency[transport]["p50_us"]:
                    latency[transport] = got
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "scale": scale,
        "repeat": repeat,
        "throughput": throughput,
        "latency": latency,
    }
    if "ring" in transports and "zmq" in transports:
        report.update(_ratios(throughput, latency, with_mpq="mpq" in transports))
        report["goals"] = {
            "p50_latency_at_most_1/5_of_zmq": report["ring_vs_zmq_p50_latency_1k"] <= 0.2,
            "throughput_16k_at_least_3x_zmq": report["ring_vs_zmq_throughput_16k"] >= 3,
            "msg_throughput_not_below_zmq": report["ring_vs_zmq_throughput_msg_1k"] >= 1,
        }
    return report


_CASE_KEYS = {"64B": "64b", "1KiB": "1k", "16KiB": "16k", "msg_1KiB": "msg_1k"}


def _ratios(throughput: dict, latency: dict, with_mpq: bool) -> dict[str, float]:
    """`ring_vs_<other>_*`: ours over theirs (latency: lower is better; throughput: higher)."""
    out: dict[str, float] = {}
    for pct in ("p50", "p99"):
        ours, theirs = latency["ring"][f"{pct}_us"], latency["zmq"][f"{pct}_us"]
        out[f"ring_vs_zmq_{pct}_latency_1k"] = round(ours / theirs, 3)
    for case, key in _CASE_KEYS.items():
        for other in ("zmq", "mpq") if with_mpq else ("zmq",):
            ours, theirs = (throughput[t][case]["records_per_s"] for t in ("ring", other))
            out[f"ring_vs_{other}_throughput_{key}"] = round(ours / theirs, 2)
    return out


def format_report(report: dict) -> str:
    lines = [
        f"ring benchmark (scale {report['scale']}, best of {report['repeat']}, {report['machine']['cpus']} CPUs)",
        "",
        f"{'throughput':<12}" + "".join(f"{t:>32}" for t in report["throughput"]),
    ]
    for case in CASES:
        cells = "".join(
            f"{r[case]['records_per_s']:>16,} rec/s {r[case]['mb_per_s']:>6,.0f} MB/s"
            for r in report["throughput"].values()
        )
        lines.append(f"{case:<12}{cells}")
    rtts = (f"p50 {v['p50_us']:.1f} us  p99 {v['p99_us']:.1f} us" for v in report["latency"].values())
    lines += ["", f"{'1 KiB RTT':<12}" + "".join(f"{cell:>32}" for cell in rtts)]
    ratios = {k: v for k, v in report.items() if k.startswith("ring_vs_")}
    if ratios:
        lines += ["", "ratios (ours / theirs):"] + [f"  {k:<36}{v}" for k, v in ratios.items()]
        lines += ["goals:"] + [f"  {k:<36}{'met' if ok else 'NOT met'}" for k, ok in report["goals"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringserve bench ring", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every record count (default %(default)s; tests use 0.01)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="interleaved repetitions; each figure is the best (default %(default)s)"
    )
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated subset of %(default)s")
    args = parser.parse_args(argv)
    transports = tuple(t for t in args.transports.split(",") if t)
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}")
    if args.scale <= 0 or args.repeat < 1:
        parser.error("--scale must be > 0 and --repeat >= 1")
    report = run(args.scale, transports, args.repeat)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
