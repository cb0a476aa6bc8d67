"""systemd/ringserve.service: the settings the operations notes promise, and `systemd-analyze verify`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "systemd" / "ringserve.service"


def _settings() -> dict[str, list[str]]:
    """Key -> every value it is given (systemd allows repeated keys), across sections."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def test_unit_declares_notify_restart_and_drain_settings():
    """Type=notify, restarts, mixed kill, OOM policy and a stop timeout above the drain."""
    s = _settings()
    assert s["Type"] == ["notify"]
    assert s["Restart"] == ["always"]
    assert s["KillMode"] == ["mixed"]
    assert s["OOMPolicy"] == ["continue"]
    assert int(s["WatchdogSec"][0]) > 0
    assert int(s["LimitNOFILE"][0]) >= 65536
    from ringserve.config import Config

    assert int(s["TimeoutStopSec"][0]) > Config().drain_timeout_s
    # The supervisor gives up on a crash loop (exit 1) only when asked; the unit asks, so systemd
    # restarts the whole service.
    assert "--restart-limit 5" in s["ExecStart"][0] and Config().restart_limit == 0


def test_unit_runs_as_system_user_with_nvidia_devices():
    """A dedicated user (logind keeps its IPC objects), NVIDIA device access, RemoveIPC set."""
    s = _settings()
    assert s["User"] == ["ringserve"]
    assert s["RemoveIPC"] == ["yes"]
    allowed = " ".join(s["DeviceAllow"])
    for dev in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"):
        assert dev in allowed
    # CUDA maps JIT-compiled code: W^X must not be enforced, nor /dev/shm made private.
    assert "MemoryDenyWriteExecute" not in s and "PrivateIPC" not in s


@pytest.mark.timeout(60)
def test_unit_passes_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` accepts the unit (ExecStart pointed at a binary that exists)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text().replace("/opt/ringserve/.venv/bin/ringserve", shutil.which("true") or "/bin/true")
    unit = tmp_path / "ringserve.service"
    unit.write_text(text)
    done = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ringserve.service" not in done.stderr, done.stderr  # no warning names our unit
