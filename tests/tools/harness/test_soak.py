"""The soak tool: its process and shared-memory probes, and a short soak of `ringserve serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ringserve.tools.harness import soak


def test_server_pids_finds_grandchildren():
    """The process tree includes children of children (the supervisor's GPU process and workers)."""
    code = "import subprocess, sys; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True); p.wait()"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        pids = soak.server_pids(os.getpid())
        assert child.pid in pids and grandchild in pids
        assert soak.fd_count(os.getpid()) > 0 and soak.rss_bytes(os.getpid()) > 0
    finally:
        os.kill(grandchild, 15)
        child.wait(timeout=10)


def test_shm_segments_are_matched_by_supervisor_pid(tmp_path):
    """Only this instance's segments count, not another supervisor's."""
    for name in ("ringserve.123-456.control", "ringserve.123-456.ring0", "ringserve.1234-9.control", "other"):
        (tmp_path / name).write_bytes(b"")
    assert soak.shm_segments(str(tmp_path), 123) == {"ringserve.123-456.control", "ringserve.123-456.ring0"}


def test_cost_model_check_fails_on_what_issue_21_saw():
    """NaN constants, a reset, or estimates far from the measured steps each fail the check."""
    good = {
        "ringserve_cost_prefill_ms": 0.05,
        "ringserve_cost_decode_ms": 0.2,
        "ringserve_cost_model_resets_total": 0.0,
    }
    steps = [(3.0, 2.5), (3.2, 3.0), (2.9, 3.1)]
    assert soak.cost_model_check(steps, good)[0]
    assert not soak.cost_model_check(steps, good | {"ringserve_cost_decode_ms": float("nan")})[0]
    assert not soak.cost_model_check(steps, good | {"ringserve_cost_model_resets_total": 1.0})[0]
    assert not soak.cost_model_check([(3.0, 0.3)] * 3, good)[0]
    assert not soak.cost_model_check([], good)[0]
    kind = good | {'ringserve_cost_steps_total{kind="prefill"}': 500.0, 'ringserve_cost_ratio{kind="prefill"}': 1.1}
    assert soak.cost_model_check(steps, kind)[0]
    assert not soak.cost_model_check(steps, kind | {'ringserve_cost_ratio{kind="prefill"}': 2.5})[0]  # issue 32
    assert soak.cost_model_check(
        steps, kind | {'ringserve_cost_steps_total{kind="prefill"}': 20.0, 'ringserve_cost_ratio{kind="prefill"}': 2.5}
    )[0]  # too few to judge


def test_short_soak_passes_every_check(tiny_model_dir, capsys):
    """Three seconds of load with 20 % hang-ups: blocks, fds, segments and RSS all hold."""
    code = soak.main(["--duration", "3", "--rate", "15", "--model", str(tiny_model_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, ([c for c in report["checks"] if not c["ok"]], report["load"])  # the failing checks, whole
    names = [c["check"] for c in report["checks"]]
    assert names[:2] == ["KV blocks all free", "cost model fitted"] and names[-1] == "no shm segments left after stop"
    assert sum(n.startswith("fds of pid") for n in names) == 3  # supervisor, GPU process, one worker
    assert report["load"]["sent"] > 10


def test_short_soak_beside_busy_processes_passes_every_check(tiny_model_dir, capsys):
    """The same soak beside as many busy processes as CPUs (a shared machine, a CI neighbour):
    with every CPU's thread kept, a thread that lost its core stalled each step, and the soak ran
    4-10x fewer steps than with one, each up to 20x longer than the cost model said; the model's
    threads now follow the CPUs left free (`cpu_tuning.CpuShare`)."""
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in os.sched_getaffinity(0)]
    try:
        code = soak.main(["--duration", "3", "--rate", "15", "--model", str(tiny_model_dir), "--json"])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    report = json.loads(capsys.readouterr().out)
    assert code == 0, ([c for c in report["checks"] if not c["ok"]], report["load"])
