"""sd_notify over AF_UNIX: datagrams reach a fake NOTIFY_SOCKET; nothing happens without one."""

from __future__ import annotations

import os
import socket

import pytest

from ringserve.sdnotify import Notifier, watchdog_interval_s


def _fake_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    return sock


def test_ready_and_status_reach_a_path_socket(tmp_path):
    """READY=1 and STATUS= arrive as one datagram of KEY=value lines."""
    sock = _fake_socket(str(tmp_path / "notify"))
    n = Notifier(str(tmp_path / "notify"))
    assert n.ready("serving tiny on :8000")
    assert sock.recv(4096).decode().split("\n") == ["READY=1", "STATUS=serving tiny on :8000"]
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.extend_timeout(2.5)
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
    n.close()
    sock.close()


def test_abstract_socket_name():
    """An '@' address is an abstract socket (systemd's notation for a leading NUL)."""
    name = f"@ringserve-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name[1:])
    sock.settimeout(5)
    n = Notifier(name)
    assert n.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    sock.close()


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch):
    """Outside systemd the notifier is disabled and sends nothing."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert n.ready("x") is False


def test_a_vanished_socket_is_logged_not_raised(tmp_path):
    """A send that fails (the manager went away) returns False instead of raising."""
    n = Notifier(str(tmp_path / "gone"))
    assert n.watchdog() is False


def test_relative_address_is_refused():
    """NOTIFY_SOCKET must be absolute or abstract."""
    with pytest.raises(ValueError, match="absolute"):
        Notifier("relative/path")


def test_watchdog_interval_is_half_watchdog_usec(monkeypatch):
    """WATCHDOG_USEC=4 s asks for a ping every 2 s, unless WATCHDOG_PID names another process."""
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None


@pytest.mark.timeout(10)
def test_a_full_receiver_queue_never_blocks(tmp_path):
    """Nobody reading the socket: sends fail fast (False) instead of stalling the supervisor."""
    sock = _fake_socket(str(tmp_path / "notify"))
    n = Notifier(str(tmp_path / "notify"))
    sent = [n.watchdog() for _ in range(500)]
    assert sent[0] and not all(sent)  # the queue filled and later sends were refused
    sock.close()
