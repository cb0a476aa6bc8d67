"""The control block: GPU state and facts, worker slots, seqlocked stats."""

from __future__ import annotations

import mmap
import multiprocessing

import pytest

from ringserve.api.worker_stats import WorkerStats
from ringserve.shm import layout as L
from ringserve.shm import stats_schema as S
from ringserve.shm.control import Control, ControlError, TornReadError


def _make_control(n_workers: int = 2) -> Control:
    buf = mmap.mmap(-1, L.control_segment_size(n_workers))
    Control.format(buf, n_workers)
    return Control(buf)


def test_gpu_generation_state_and_facts():
    """Generation bumps, state round-trips, and model facts are None until published."""
    ctl = _make_control()
    assert ctl.gpu_generation == 0 and ctl.gpu_state is L.GpuState.NONE
    assert ctl.model_facts() is None and ctl.gpu_heartbeat_age_s() is None
    assert ctl.bump_gpu_generation() == 1
    ctl.set_gpu_state(L.GpuState.READY, pid=1234)
    ctl.gpu_heartbeat()
    facts = {
        "name": "tiny",
        "vocab_size": 512,
        "block_size": 16,
        "num_blocks": 2048,
        "context_limit": 8192,
        "eos_ids": [2],
    }
    ctl.set_model_facts(facts)
    other = Control(ctl._buf)
    assert other.gpu_state is L.GpuState.READY and other.gpu_pid == 1234
    assert other.model_facts() == facts
    assert 0 <= other.gpu_heartbeat_age_s() < 5
    with pytest.raises(ValueError, match="model facts take"):
        ctl.set_model_facts({"blob": "x" * 5000})


def test_worker_slots_and_summed_stats():
    """Each worker publishes its own stats; the sum over slots is what /metrics reports."""
    ctl = _make_control(3)
    assert ctl.start_worker_slot(1, pid=42) == 1
    assert ctl.start_worker_slot(1, pid=43) == 2
    ctl.worker_heartbeat(1)
    slot = ctl.worker_slot(1)
    assert slot["pid"] == 43 and slot["generation"] == 2 and slot["heartbeat_age_s"] >= 0
    ttft = S.HISTOGRAMS[0]
    for i in range(3):
        stats = WorkerStats()  # what a worker counts and publishes into its slot
        stats.add("requests_total", i + 1)
        stats.add("finished_stop")
        stats.observe(ttft.name, 30.0 * (i + 1))  # 30, 60, 90 ms
        stats.publish(ctl.worker_stats(i))
    total = ctl.all_worker_stats()
    assert total["requests_total"] == 6 and total["finished_stop"] == 3
    assert total[f"{ttft.name}_count"] == 3 and total[f"{ttft.name}_sum"] == 180.0
    assert ttft.cumulative(total)[:4] == [0, 0, 1, 3]  # le 10, 25, 50, 100
    with pytest.raises(IndexError):
        ctl.worker_slot(3)


def test_gpu_stats_round_trip():
    """GPU stats are read back as a dict with every declared name."""
    ctl = _make_control()
    ctl.gpu_stats.update({"queue_depth": 3, "kv_blocks_free": 100.0})
    ctl.gpu_stats.publish()
    stats = Control(ctl._buf).gpu_stats.read()
    assert set(stats) == set(S.GPU_STAT_NAMES)
    assert stats["queue_depth"] == 3 and stats["kv_blocks_free"] == 100.0 and stats["steps"] == 0


def _hammer(buf, rounds: int) -> None:
    stats = Control(buf).gpu_stats
    for i in range(rounds):
        stats.update({name: float(i) for name in S.GPU_STAT_NAMES})
        stats.publish()


def test_seqlock_reader_never_sees_a_torn_snapshot():
    """While another process publishes all-equal snapshots, every read is all-equal."""
    ctl = _make_control()
    proc = multiprocessing.get_context("fork").Process(target=_hammer, args=(ctl._buf, 100_000))
    proc.start()
    reads = 0
    while proc.is_alive() or reads == 0:
        values = set(ctl.gpu_stats.read().values())
        assert len(values) == 1, values
        reads += 1
    proc.join()
    assert ctl.gpu_stats.read()["steps"] == 99_999


def test_writer_dead_mid_update_is_reported_then_recovered():
    """An odd sequence word left by a dead writer makes reads fail clearly; a new writer heals it."""
    ctl = _make_control()
    L.U64.pack_into(ctl._buf, L.CTRL_GPU_STATS_OFF, 7)  # odd: mid-write forever
    with pytest.raises(TornReadError, match="writer likely died"):
        ctl.gpu_stats.read(timeout=0.05)
    Control(ctl._buf).gpu_stats.reset()
    assert ctl.gpu_stats.read()["steps"] == 0


def test_foreign_segment_is_refused():
    """A buffer without the control magic, or with another schema, is refused."""
    buf = mmap.mmap(-1, L.control_segment_size(1))
    with pytest.raises(ControlError, match="not a ringserve control"):
        Control(buf)
    Control.format(buf, 1)
    L.U64.pack_into(buf, L.CTRL_SCHEMA_OFF, 1)
    with pytest.raises(ControlError, match="restart all processes"):
        Control(buf)


def test_gpu_exit_note_and_restart_status():
    """A GPU process's exit note is told apart from its predecessor's by the sequence taken at
    spawn; the supervisor's restart status round-trips, long errors clipped to fit."""
    ctl = _make_control()
    assert ctl.gpu_exit() == (0, None) and ctl.restart_status() is None
    seq_at_spawn = ctl.gpu_exit()[0]
    Control(ctl._buf).set_gpu_exit("CheckpointError: /m: model directory not found")  # the child
    seq, note = ctl.gpu_exit()
    assert seq != seq_at_spawn and note == "CheckpointError: /m: model directory not found"
    ctl.set_restart_status({"state": "restarting", "last_error": "x" * 5000, "failures": 3, "retry_at": 12.5})
    status = Control(ctl._buf).restart_status()
    assert status["state"] == "restarting" and status["failures"] == 3 and status["retry_at"] == 12.5
    assert status["last_error"].startswith("xxx") and len(status["last_error"]) < L.CTRL_NOTE_BYTES


def test_tenants_near_the_limit_round_trip_and_are_trimmed_to_the_region():
    """The GPU process's table for the workers' refusals at once: empty at first, read back as
    written with its queue limit, its sequence moving only on a write; a table too large for the
    region keeps its first (most work ahead) entries instead of failing the GPU loop."""
    ctl = _make_control()
    seq0, limit, table = ctl.refusals()
    assert (limit, table) == (0.0, {})
    ctl.set_refusals(2000.0, {"k-aaaa": (2100, 3), "k-bbbb": (1500, 60)})
    seq1, limit, table = Control(ctl._buf).refusals()
    assert (limit, table) == (2000.0, {"k-aaaa": (2100, 3), "k-bbbb": (1500, 60)})
    assert seq1 != seq0 and ctl.refusals_sequence == seq1
    many = {f"tenant-{i:04d}-" + "x" * 100: (3000 - i, 5) for i in range(200)}
    ctl.set_refusals(2000.0, many)
    _, _, table = ctl.refusals()
    assert 0 < len(table) <= L.MAX_REFUSED_TENANTS and list(table) == list(many)[: len(table)]
