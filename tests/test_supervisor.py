"""The supervisor: restart policy, systemd notifications, crash-loop exit, and cleanup after its
own SIGKILL. (GPU-process and worker restarts under load are the drills: tests/tools/harness/test_drill.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ringserve.restart_policy import BACKOFF_BASE_S, BACKOFF_MAX_S, RestartPolicy
from ringserve.shm.segment import list_segments, pid_alive
from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.net import free_port
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(180)


def test_restart_policy_backs_off_then_gives_up():
    """Backoff doubles per crash in the window; the limit-th crash gives up."""
    p = RestartPolicy(limit=4, window_s=60.0)
    assert p.record_crash(0.0) == BACKOFF_BASE_S
    assert p.record_crash(1.0) == BACKOFF_BASE_S * 2
    assert p.record_crash(2.0) == BACKOFF_BASE_S * 4
    assert p.record_crash(3.0) is None


def test_restart_policy_forgets_crashes_outside_the_window():
    """Crashes older than the window no longer count toward the limit or the backoff."""
    p = RestartPolicy(limit=2, window_s=10.0)
    assert p.record_crash(0.0) == BACKOFF_BASE_S
    assert p.record_crash(20.0) == BACKOFF_BASE_S
    assert p.recent == 1


def test_restart_policy_backoff_is_capped():
    """However many crashes the window tolerates, no restart waits longer than BACKOFF_MAX_S."""
    p = RestartPolicy(limit=100, window_s=1e9)
    delays = [p.record_crash(float(i)) for i in range(30)]
    assert max(delays) == BACKOFF_MAX_S


def test_restart_policy_without_limit_never_gives_up_and_stays_at_the_cap():
    """limit 0 (the default) never gives up; in a crash loop whose attempts each take longer than
    the cap, the backoff stays at the cap rather than falling back as old crashes age out."""
    p = RestartPolicy(limit=0, window_s=60.0)
    now, delays = 0.0, []
    for _ in range(12):
        delay = p.record_crash(now)
        assert delay is not None
        delays.append(delay)
        now += delay + 5.0  # the next attempt loads for 5 s and fails again
    assert delays[:3] == [BACKOFF_BASE_S, BACKOFF_BASE_S * 2, BACKOFF_BASE_S * 4]
    assert delays[-3:] == [BACKOFF_MAX_S] * 3
    assert p.record_crash(now + 61.0 + BACKOFF_MAX_S) == BACKOFF_BASE_S  # ran a whole window


def test_ready_and_watchdog_reach_notify_socket(tiny_model_dir, tmp_path, monkeypatch):
    """Under a fake systemd the supervisor sends READY=1 once serving, then WATCHDOG=1 pings."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(1.0)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    messages: list[str] = []
    done = threading.Event()

    def receive() -> None:  # keep the queue empty, as systemd would
        while not done.is_set():
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                pass

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (any("READY=1" in m for m in messages) and "WATCHDOG=1" in messages):
            time.sleep(0.05)
    done.set()
    reader.join(5)
    sock.close()
    ready = next(m for m in messages if "READY=1" in m)
    assert "STATUS=serving" in ready
    assert "WATCHDOG=1" in messages
    assert any(m.startswith("STATUS=loading") for m in messages)  # before READY, while loading


def test_crash_loop_gives_up_with_nonzero_exit(tmp_path):
    """A GPU process that fails at every start (no model there) is restarted with backoff until
    restart_limit, then the supervisor exits 1 with a clear log line."""
    (tmp_path / "shm").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringserve",
            "serve",
            "--model",
            str(tmp_path / "no-model"),
            "--port",
            str(free_port()),
            "--shm-dir",
            str(tmp_path / "shm"),
            "--workers",
            "1",
            "--restart-limit",
            "2",
            "--restart-window-s",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "restarting it in" in done.stderr
    assert "failed 2 times within 120 s" in done.stderr and "giving up" in done.stderr
    assert not list_segments(str(tmp_path / "shm"))  # shared memory unlinked on the way out


def test_children_exit_when_supervisor_is_killed_and_next_start_cleans_up(tiny_model_dir, tmp_path):
    """SIGKILL the supervisor: the GPU process and workers exit on their own (parent-death
    signal); the next start removes the segments the dead supervisor left behind."""
    shm = tmp_path / "shm"
    with ServerProcess(tiny_model_dir, shm, workers=2, drain_timeout_s=2) as srv:
        old = find_instance(str(shm))
        seg, control = attach_control(str(shm), old)
        children = [control.gpu_pid] + [control.worker_slot(i)["pid"] for i in range(2)]
        seg.close()
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        deadline = time.monotonic() + 20
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in children), "children outlived the supervisor"
        assert any(s.instance == old for s in list_segments(str(shm)))  # left behind
    with ServerProcess(tiny_model_dir, shm, workers=1) as srv2:
        assert srv2.url
        instances = {s.instance for s in list_segments(str(shm))}
        assert old not in instances and len(instances) == 1
        assert srv2.stop() == 0
    assert not list_segments(str(shm))


def test_stuck_worker_is_killed_and_replaced(tiny_model_dir, tmp_path):
    """A worker whose heartbeat stops (SIGSTOP) is killed after watchdog_timeout_s and restarted
    in its slot; the server serves again."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=2, watchdog_timeout_s=1.5) as srv:
        seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
        deadline = time.monotonic() + 30
        while control.worker_slot(1)["heartbeat_age_s"] is None and time.monotonic() < deadline:
            time.sleep(0.05)  # /ready answered from one worker; wait for the other to listen
        old = control.worker_slot(1)
        os.kill(old["pid"], signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            slot = control.worker_slot(1)
            if slot["generation"] > old["generation"] and slot["heartbeat_age_s"] is not None:
                break
            time.sleep(0.05)
        assert slot["generation"] > old["generation"] and slot["pid"] not in (0, old["pid"]), srv.log()
        assert not pid_alive(old["pid"])
        assert "API worker 1" in srv.log() and "sent no heartbeat" in srv.log()
        seg.close()
        assert srv.stop() == 0
