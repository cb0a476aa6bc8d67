"""Issue 15's breaks, scaled down, against real `ringserve serve` instances on loopback: large
prompts, a full open-file table, a second instance on the port, crash loops (kept up with the
last error, or given up with every held request answered) and a load that hangs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.net import free_port, http_json
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(240)


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[object, dict | str, dict]:
    """(status, JSON body or SSE text, headers), or ("dropped", repr, {}) if the connection broke
    without an answer."""
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            return resp.status, raw if body.get("stream") else json.loads(raw), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null"), dict(err.headers)
    except (OSError, urllib.error.URLError) as exc:
        return "dropped", repr(exc), {}


def _in_threads(fn, args_list) -> tuple[list, list[threading.Thread]]:
    results: list = []
    threads = [threading.Thread(target=lambda a=a: results.append(fn(*a))) for a in args_list]
    for t in threads:
        t.start()
    return results, threads


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_next_gpu(control, old_pid: int, sig=signal.SIGKILL, timeout_s: float = 60.0) -> int:
    """Signal the next GPU process as soon as the supervisor has spawned it; its pid."""
    _wait(lambda: control.gpu_pid not in (0, old_pid), timeout_s, "a new GPU process")
    pid = control.gpu_pid
    os.kill(pid, sig)
    return pid


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("shm"), workers=2, watchdog_timeout_s=3) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        _wait(lambda: all(control.worker_slot(i)["heartbeat_age_s"] is not None for i in range(2)), 30, "both workers")
        yield srv, control
        seg.close()


def test_large_prompts_neither_freeze_nor_kill_a_worker(server):
    """Eight 3.9 MB prompts, four at a time, are 400s at once; /health keeps answering and no
    worker is killed (before: /health took 13 s and repeats got the worker killed)."""
    srv, control = server
    generations = [control.worker_slot(i)["generation"] for i in range(2)]
    text = ("The quick brown fox jumps over the lazy dog. " * 90000)[:3_900_000]
    worst, done = [0.0], threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            assert http_json(srv.url + "/health", timeout=30)[0] == 200
            worst[0] = max(worst[0], time.monotonic() - t)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    for _ in range(2):
        results, threads = _in_threads(_post, [(srv.url, {"prompt": text, "max_tokens": 4})] * 4)
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [400] * 4
        assert all(r[1]["error"]["code"] == "context_length_exceeded" for r in results)
    done.set()
    prober.join()
    assert worst[0] < 2.0
    assert [control.worker_slot(i)["generation"] for i in range(2)] == generations


def test_second_instance_on_the_port_refuses_to_start(server, tiny_model_dir, tmp_path):
    """A second `ringserve serve` on a port in use exits 1 at once with a clear message instead
    of sharing the port through SO_REUSEPORT."""
    srv, _ = server
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringserve",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(srv.port),
            "--shm-dir",
            str(tmp_path),
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert f"port {srv.port} is already served by another ringserve" in done.stderr
    assert not os.listdir(tmp_path)  # it stopped before creating any shared memory


def test_port_held_by_another_program_refuses_too(tiny_model_dir, tmp_path):
    """A port some other program listens on is refused the same way."""
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringserve",
                "serve",
                "--model",
                str(tiny_model_dir),
                "--port",
                str(port),
                "--shm-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        other.close()
    assert done.returncode == 1 and "already in use by another process" in done.stderr


def test_ring_too_small_for_the_context_refuses_to_start(tiny_model_dir, tmp_path):
    """A ring that cannot take the largest legal request is a start-up error naming the size
    needed, not a 500 for that request later."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringserve",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(free_port()),
            "--shm-dir",
            str(tmp_path),
            "--ring-bytes",
            "65536",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "raise --ring-bytes to at least" in done.stderr


def test_full_open_file_table_still_serves_and_says_so(tiny_model_dir, tmp_path):
    """With the worker's open-file limit at 256, 300 idle connections do not lock clients out:
    the oldest idle ones make room for new ones, and the worker logs it (before: every probe was
    reset and nothing was logged)."""
    with ServerProcess(
        tiny_model_dir, tmp_path / "shm", workers=1, header_timeout_s=60, rlimit_nofile=(256, 256)
    ) as srv:
        idle = []
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.5)
        assert [http_json(srv.url + "/health", timeout=5)[0] for _ in range(5)] == [200] * 5
        for s in idle:
            s.close()
        assert "to make room for new ones" in srv.log()


def test_crash_loop_keeps_the_api_up_with_the_last_error(tiny_model_dir, tmp_path):
    """By default the supervisor never gives up: while every restart fails, requests get 503
    quoting the GPU process's own error with a Retry-After, a request held across the restart
    gets an explicit error after restart_hold_s, and the server recovers once the fault clears."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    with ServerProcess(model, tmp_path / "shm", workers=1, restart_hold_s=2) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        pid = control.gpu_pid
        os.kill(pid, signal.SIGSTOP)  # admissions stall: the next requests wait in the worker
        held, threads = _in_threads(_post, [(srv.url, {"prompt": "hi", "max_tokens": 2})] * 2)
        time.sleep(0.5)
        model.rename(tmp_path / "gone")  # every restart now fails while loading
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join()
        for status, body, _ in held:
            assert status == 503 and body["error"]["code"] == "gpu_process_restart"
            assert "was not back within 2 s" in body["error"]["message"]
        _wait(lambda: (control.restart_status() or {}).get("failures", 0) >= 3, 90, "3 failures")
        status, body, headers = _post(srv.url, {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "gpu_not_ready"
        assert "model directory not found" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        assert srv.proc.poll() is None
        (tmp_path / "gone").rename(model)
        _wait(lambda: http_json(srv.url + "/ready", timeout=5)[0] == 200, 90, "recovery")
        assert _post(srv.url, {"prompt": "hi", "max_tokens": 2})[0] == 200
        seg.close()


def test_giving_up_answers_every_held_request(tiny_model_dir, tmp_path):
    """With --restart-limit the supervisor gives up and exits 1, but every request it had
    accepted gets an explicit error first (before: 18 held requests saw the connection drop)."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1, restart_limit=2, restart_window_s=120) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        pid = control.gpu_pid
        os.kill(pid, signal.SIGSTOP)
        bodies = [{"prompt": "hi", "max_tokens": 4, "stream": stream} for stream in (True, False) * 2]
        results, threads = _in_threads(_post, [(srv.url, b) for b in bodies])
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        _kill_next_gpu(control, pid)  # the second crash within the window: give up
        for t in threads:
            t.join()
        assert srv.proc.wait(30) == 1
        assert len(results) == 4
        for status, body, _ in results:
            assert status == 503, body
            assert body["error"]["code"] in ("server_shutdown", "gpu_process_restart")
        assert "giving up" in srv.log()
        seg.close()


def test_hang_while_loading_is_caught_by_the_watchdog(tiny_model_dir, tmp_path):
    """A GPU process stopped while it loads is killed by the same watchdog as a hung step and
    restarted (before: only a 900 s load timeout, 503s all along)."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1, watchdog_timeout_s=2) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        pid = control.gpu_pid
        os.kill(pid, signal.SIGKILL)
        _kill_next_gpu(control, pid, sig=signal.SIGSTOP)
        _wait(lambda: http_json(srv.url + "/ready", timeout=5)[0] == 200, 60, "ready again")
        assert "made no loading progress" in srv.log()
        seg.close()
