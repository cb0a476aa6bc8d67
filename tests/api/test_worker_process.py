"""Worker processes end to end over real shared memory: two workers share one port
(SO_REUSEPORT), the test plays the GPU process on the rings, a DELETE reaches the request's worker
whichever worker receives it, SIGTERM drains and exits 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from ringserve.config import Config
from ringserve.shm import layout as L
from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import Accepted, Finish, StepOutput, Submit, Token, decode, encode
from tests.helpers.net import free_port
from tests.helpers.sse import sse_events

HOLD_TOKENS = 500


class _EchoGpu(threading.Thread):
    """Answers each Submit on any request ring: Accepted, then the prompt ids as tokens."""

    def __init__(self, shm: ShmInstance) -> None:
        super().__init__(daemon=True)
        self.shm = shm
        self.ins, self.outs = shm.gpu_rings(shm.control.gpu_generation)
        self.stop = threading.Event()
        self.submits: list[tuple[int, Submit]] = []
        self.held: dict[int, set[int]] = {}  # slot -> rids kept running until cancelled

    def run(self) -> None:
        while not self.stop.is_set():
            self.shm.input_bell.wait(0.05)
            for slot, ring in enumerate(self.ins):
                while (raw := ring.pop()) is not None:
                    msg = decode(raw)
                    if isinstance(msg, Submit):
                        self.submits.append((slot, msg))
                        self._answer(slot, msg)
                    elif msg.rid in self.held.get(slot, set()):  # a Cancel
                        self.held[slot].discard(msg.rid)
                        self._push(slot, StepOutput(step=2, finishes=[Finish(msg.rid, 0, "cancelled", 1, 1, 0.2, 3.0)]))

    def _push(self, slot: int, msg) -> None:
        if not self.outs[slot].try_push(encode(msg)):
            raise RuntimeError("output ring full")
        self.shm.output_bells[slot].ring()

    def _answer(self, slot: int, sub: Submit) -> None:
        if sub.max_tokens >= HOLD_TOKENS:  # a long answer: one token, then wait for a Cancel
            self.held.setdefault(slot, set()).add(sub.rid)
            self._push(slot, Accepted(rid=sub.rid, est_gpu_ms=1.0))
            self._push(slot, StepOutput(step=1, tokens=[Token(sub.rid, 0, sub.prompt_ids[-1], -0.1)]))
            return
        ids = sub.prompt_ids[: sub.max_tokens]
        for msg in (
            Accepted(rid=sub.rid, est_gpu_ms=1.0),
            StepOutput(
                step=1,
                tokens=[Token(sub.rid, 0, t, -0.25) for t in ids],
                finishes=[Finish(sub.rid, 0, "length", len(sub.prompt_ids), len(ids), 0.2, 3.0)],
            ),
        ):
            if not self.outs[slot].try_push(encode(msg)):
                raise RuntimeError("output ring full")
        self.shm.output_bells[slot].ring()


def _delete_mid_stream(port: int) -> None:
    """Open a long stream, DELETE it on a fresh connection (whichever worker takes that one),
    and see the stream end cancelled."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": "long", "max_tokens": HOLD_TOKENS, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    request_id = resp.getheader("x-request-id")
    assert resp.read(6) == b"data: "  # the first token event is out: the request is open
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/requests/{request_id}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10) as deleted:
        assert deleted.status == 200
    rest = resp.read().decode()
    conn.close()
    assert '"finish_reason":"cancelled"' in rest and rest.rstrip().endswith("data: [DONE]")


def _post(port: int, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _wait_serving(procs, logs, timeout: float = 60.0) -> None:
    """Until every worker has logged that it serves (its socket is listening)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a worker exited during start-up: {[log.read_text() for log in logs]}")
        if all("serving" in log.read_text() for log in logs):
            return
        time.sleep(0.05)
    raise AssertionError("workers did not start")


@pytest.mark.timeout(90)
def test_two_workers_over_shared_memory(tmp_path, tiny_model_dir, codec):
    """Requests through either worker reach the GPU side over rings and stream back correct text;
    /ready follows the control block; DELETE works across workers; SIGTERM ends both cleanly."""
    shm = ShmInstance.create(ring_bytes=1 << 16, n_workers=2, directory=str(tmp_path))
    gpu = _EchoGpu(shm)
    gpu.start()
    port = free_port()
    # As the supervisor hands it over: the whole Config as JSON in the environment.
    env = {**os.environ, "RINGSERVE_CONFIG_JSON": Config(port=port, workers=2, drain_timeout_s=5.0).to_json()}
    fds = shm.bell_fds()
    logs = [tmp_path / f"worker{slot}.log" for slot in (0, 1)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ringserve.api.worker",
                "--tokenizer",
                str(tiny_model_dir),
                "--attach",
                shm.instance,
                "--slot",
                str(slot),
                "--bell-fds",
                ",".join(map(str, fds)),
                "--shm-dir",
                str(tmp_path),
                "--model-name",
                "tiny",
            ],
            env=env,
            pass_fds=fds,
            stdout=logs[slot].open("w"),
            stderr=subprocess.STDOUT,
        )
        for slot in (0, 1)
    ]
    for slot, proc in enumerate(procs):  # as the supervisor does: the slot names its worker's pid
        shm.control.start_worker_slot(slot, proc.pid)
    try:
        _wait_serving(procs, logs)
        status, body = _post(port, {"prompt": "x"})
        assert status == 503  # the GPU process has not said READY yet
        shm.control.set_gpu_state(L.GpuState.READY)
        text = "Hello 世界 🎉"
        n = len(codec.encode(text))
        for _ in range(12):
            status, body = _post(port, {"prompt": text, "max_tokens": n})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["text"] == text
        status, body = _post(port, {"prompt": text, "max_tokens": n, "stream": True})
        events = sse_events(body)
        assert events[-1] == "[DONE]"
        assert "".join(e.get("text", "") for e in events[:-2]) == text
        assert {slot for slot, _ in gpu.submits} <= {0, 1} and len(gpu.submits) == 13
        # Each DELETE takes a fresh connection: about half land on the other worker than the
        # stream's, and must still cancel it.
        for _ in range(8):
            _delete_mid_stream(port)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
        gpu.stop.set()
        gpu.join(timeout=5)
        shm.close()
        shm.unlink()
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
