"""`ringserve shm` shows a live instance held by another process and cleans stale ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from ringserve.tools.commands import shm_inspect

_HOLDER = textwrap.dedent("""
    import sys
    from ringserve.shm.instance import ShmInstance
    from ringserve.shm.layout import GpuState
    shm = ShmInstance.create(ring_bytes=64 * 1024, n_workers=1, directory=sys.argv[1])
    shm.control.set_gpu_state(GpuState.READY, pid=1)
    shm.control.set_model_facts({"name": "tiny-test"})
    req, out = shm.worker_rings(0)
    assert req.try_push(b"x" * 100)
    print(shm.instance, flush=True)
    sys.stdin.read()  # hold until the test closes our stdin
    shm.unlink()
""")


@pytest.fixture
def holder():
    """Start a process holding an instance; yield (directory, instance, process)."""
    directory = tempfile.mkdtemp(prefix="ringserve-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    instance = proc.stdout.readline().strip()
    assert instance, "holder failed to start"
    yield directory, instance, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


def test_json_shows_the_live_ring(holder, capsys):
    """--json lists the holder's control and ring segments with live state."""
    directory, instance, _ = holder
    assert shm_inspect.main(["--json", "--dir", directory]) == 0
    report = json.loads(capsys.readouterr().out)
    segs = {s["part"]: s for s in report["segments"]}
    assert set(segs) == {"control", "req.0", "out.0"}
    assert all(s["instance"] == instance and s["owner_alive"] for s in segs.values())
    req = segs["req.0"]["ring"]
    assert req["capacity"] == 64 * 1024 and req["used_bytes"] == 112 and req["tail"] == 0
    assert req["producer_alive"] and req["integrity"] == "ok"
    assert req["producer_heartbeat_age_s"] >= 0
    control = segs["control"]["control"]
    assert control["gpu_state"] == "ready" and control["model_facts"] == {"name": "tiny-test"}


def test_table_through_the_cli(holder):
    """`ringserve shm` (the console command) prints the instance and its rings as a table."""
    directory, instance, _ = holder
    out = subprocess.run(
        [sys.executable, "-m", "ringserve", "shm", "--dir", directory], capture_output=True, text=True, check=True
    ).stdout
    assert f"instance {instance}" in out and "alive" in out
    assert "req.0" in out and "65,536" in out and "tiny-test" in out


def test_clean_removes_a_dead_holders_segments(holder, capsys):
    """After the holder is SIGKILLed its segments are stale; --clean removes them."""
    directory, instance, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert shm_inspect.main(["--dir", directory]) == 0
    assert "DEAD" in capsys.readouterr().out
    assert shm_inspect.main(["--json", "--clean", "--dir", directory]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["removed"]) == 3 and report["segments"] == []
    assert os.listdir(directory) == []


def test_default_directory_is_dev_shm(capsys):
    """Without --dir the inspector reads /dev/shm (an instance there is listed)."""
    from ringserve.shm.instance import ShmInstance

    shm = ShmInstance.create(ring_bytes=4096, n_workers=1)
    try:
        assert shm_inspect.main(["--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["directory"] == "/dev/shm"
        assert {s["part"] for s in report["segments"] if s["instance"] == shm.instance} == {"control", "req.0", "out.0"}
    finally:
        shm.unlink()
        shm.close()


def test_watch_redraws_and_shows_pool_and_slots(holder, capsys):
    """--watch prints one snapshot per interval (JSON lines with --json); the table shows KV pool
    use, queue depth and every worker slot."""
    directory, instance, _ = holder
    assert shm_inspect.watch(directory, 0.01, as_json=True, iterations=2) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    snaps = [json.loads(line) for line in lines]
    assert all(any(s["instance"] == instance for s in snap["segments"]) for snap in snaps)
    assert shm_inspect.watch(directory, 0.01, iterations=1) == 0
    out = capsys.readouterr().out
    assert "kv blocks 0/0 used" in out and "queue depth 0" in out and "worker 0: pid" in out
    assert "prefix cache hit rate -" in out and "mean accepted length -" in out


def test_prefix_cache_hit_rate():
    """The hit rate is hits over lookups, and a dash before any lookup."""
    from ringserve.tools.commands.shm_inspect import _hit_rate

    assert _hit_rate({"prefix_cache_queries": 200.0, "prefix_cache_hits": 150.0}) == "75.0%"
    assert _hit_rate({"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}) == "-"


def test_speculation_mean_accepted_length():
    """Tokens a drafting row emits per verifying step: 1 + kept draft tokens per draft; a dash
    before any draft."""
    from ringserve.tools.commands.shm_inspect import _accepted_length

    assert _accepted_length({"spec_decode_num_drafts": 10.0, "spec_decode_num_accepted_tokens": 23.0}) == "3.30"
    assert _accepted_length({"spec_decode_num_drafts": 0.0}) == "-"
