"""The ring across processes: a million-record stress run and producers killed mid-write."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import struct
import time
import zlib

import pytest

from ringserve.shm import layout as L
from ringserve.shm.doorbell import Doorbell
from ringserve.shm.ring import Ring, format_ring
from ringserve.shm.segment import Segment

_CTX = multiprocessing.get_context("fork")
_HEAD = struct.Struct("<QII")  # seq, crc32 of the filler, filler length
_PATTERN = bytes(random.Random(7).randrange(256) for _ in range(8192 + 256))


def _record(seq: int, filler_len: int) -> bytes:
    start = seq % 251
    filler = _PATTERN[start : start + filler_len]
    return _HEAD.pack(seq, zlib.crc32(filler), filler_len) + filler


def _verify(rec: bytes, expected_seq: int) -> str | None:
    """None if `rec` is record `expected_seq`, whole and uncorrupted; else what is wrong."""
    if len(rec) < _HEAD.size:
        return f"record of {len(rec)} bytes is shorter than its header"
    seq, crc, flen = _HEAD.unpack_from(rec)
    if seq != expected_seq:
        return f"expected seq {expected_seq}, got {seq}"
    if len(rec) != _HEAD.size + flen or zlib.crc32(rec[_HEAD.size :]) != crc:
        return f"record {seq} is corrupt"
    return None


def _make_segment(shm_dir: str, capacity: int) -> Segment:
    seg = Segment.create("ring", L.ring_segment_size(capacity), shm_dir)
    format_ring(seg.buf, capacity)
    return seg


def _stress_producer(shm_dir: str, n: int, bell_fd: int) -> None:
    seg = Segment.attach("ring", shm_dir)
    ring, bell = Ring.producer(seg.buf), Doorbell.from_fd(bell_fd)
    push = ring.try_push
    for seq in range(n):
        rec = _record(seq, seq % 41)
        while not push(rec):
            bell.ring()
            os.sched_yield()
        if seq & 255 == 0:
            bell.ring()
    bell.ring()


def _stress_consumer(shm_dir: str, n: int, bell_fd: int, conn) -> None:
    seg = Segment.attach("ring", shm_dir)
    ring, bell = Ring.consumer(seg.buf), Doorbell.from_fd(bell_fd)
    expected, errors = 0, []
    deadline = time.monotonic() + 120
    while expected < n and time.monotonic() < deadline:
        batch = ring.pop_many(4096)
        if not batch:
            bell.wait(0.01)
            continue
        for rec in batch:
            problem = _verify(rec, expected)
            if problem and len(errors) < 5:
                errors.append(problem)
            expected += 1
    leftover = ring.pop()
    conn.send((expected, errors, leftover))


def test_million_records_across_processes(shm_dir):
    """1M records from a producer process reach a consumer process with no loss, duplication,
    reordering or corruption, through a small ring that wraps thousands of times."""
    n = 1_000_000
    seg = _make_segment(shm_dir, 64 * 1024)
    bell = Doorbell.create()
    parent, child = _CTX.Pipe()
    procs = [
        _CTX.Process(target=_stress_consumer, args=(shm_dir, n, bell.fileno(), child)),
        _CTX.Process(target=_stress_producer, args=(shm_dir, n, bell.fileno())),
    ]
    for p in procs:
        p.start()
    try:
        assert parent.poll(150), "consumer did not finish"
        received, errors, leftover = parent.recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert errors == []
    assert received == n and leftover is None
    assert [p.exitcode for p in procs] == [0, 0]
    ring = Ring(seg.buf)
    ring.check_integrity()
    assert ring.head == ring.tail > 64 * 1024 * 100  # many laps


def _kill_before_commit_producer(shm_dir: str, kill_at: int) -> None:
    ring = Ring.producer(Segment.attach("ring", shm_dir).buf)
    for seq in range(kill_at):
        assert ring.try_push(_record(seq, 300))
    # Payload written and head published; SIGKILL before the header word commits the record.
    ring._pre_commit = lambda: os.kill(os.getpid(), signal.SIGKILL)
    ring.try_push(_record(kill_at, 300))


def test_producer_killed_between_payload_and_commit(shm_dir):
    """A producer SIGKILLed after writing a payload but before its commit store leaves no
    partial record: the consumer gets exactly the committed ones, and a new producer resumes."""
    seg = _make_segment(shm_dir, 16 * 1024)
    proc = _CTX.Process(target=_kill_before_commit_producer, args=(shm_dir, 5))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    cons = Ring.consumer(seg.buf)
    got = cons.pop_many()
    assert [_verify(rec, i) for i, rec in enumerate(got)] == [None] * 5
    assert cons.pop() is None
    prod = Ring(seg.buf)
    prod.adopt_producer(generation=1)
    prod.check_integrity()
    assert prod.try_push(_record(5, 10))
    assert _verify(cons.pop(), 5) is None


def _endless_producer(shm_dir: str, first_seq: int, generation: int) -> None:
    ring = Ring(Segment.attach("ring", shm_dir).buf)
    ring.adopt_producer(generation)
    seq = first_seq
    while True:
        if ring.try_push(_record(seq, 1000 + seq % 3000)):
            seq += 1


@pytest.mark.timeout(120)
def test_producer_killed_at_random_times_never_delivers_partial_records(shm_dir):
    """Producers SIGKILLed at random moments while writing 1-4 KiB records: every delivered
    record is whole and in sequence, and each replacement producer carries on cleanly."""
    seg = _make_segment(shm_dir, 64 * 1024)
    cons = Ring.consumer(seg.buf)
    rnd = random.Random(11)
    expected = 0
    for generation in range(1, 16):
        proc = _CTX.Process(target=_endless_producer, args=(shm_dir, expected, generation))
        proc.start()
        stop = time.monotonic() + rnd.uniform(0.005, 0.05)
        while time.monotonic() < stop:
            for rec in cons.pop_many(64):
                assert _verify(rec, expected) is None
                expected += 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        for rec in cons.pop_many():
            assert _verify(rec, expected) is None
            expected += 1
    assert expected > 15  # records flowed
    last = Ring(seg.buf)
    last.adopt_producer(generation=99)
    last.check_integrity()
    assert last.try_push(_record(expected, 5)) and _verify(cons.pop(), expected) is None
