"""Crash attribution's shared pieces: the step-in-flight record, the request fingerprint, the
quarantine table and the fingerprint key in the control block."""

from __future__ import annotations

import mmap

import msgspec

from ringserve.shm import layout as L
from ringserve.shm.control import Control
from ringserve.shm.in_flight import InFlight, StepRecord
from ringserve.shm.messages import SamplingParams, Submit, fingerprint


def _make_control() -> Control:
    buf = mmap.mmap(-1, L.control_segment_size(1))
    Control.format(buf, 1)
    return Control(buf)


def _submit(**changes) -> Submit:
    base = Submit(
        rid=7,
        request_id="r7",
        tenant="t",
        prompt_ids=[5, 6, 7],
        max_tokens=4,
        sampling=SamplingParams(),
        arrival_ts=1.0,
        deadline_ts=2.0,
    )
    return msgspec.structs.replace(base, **changes)


def test_record_names_the_step_until_it_ends():
    """begin() names the step's requests for any reader; end() leaves the step, nothing in flight."""
    ctl = _make_control()
    assert ctl.step_record.read() is None  # never written
    ctl.step_record.begin(3, 41, 123, [(0, 11, 0xABC, 5), (1, 12, 0xDEF, 6)])
    got = Control(ctl._buf).step_record.read()
    assert (got.generation, got.step, got.started_ns, got.unnamed) == (3, 41, 123, 0)
    assert got.requests == (InFlight(0, 11, 0xABC, 5), InFlight(1, 12, 0xDEF, 6))
    ctl.step_record.end()
    got = ctl.step_record.read()
    assert got.generation == 3 and got.step == 41 and got.requests == ()


def test_record_of_a_step_larger_than_its_capacity_counts_the_rest():
    """Entries past STEP_MAX_ENTRIES are not named but counted."""
    ctl = _make_control()
    n = L.STEP_MAX_ENTRIES + 3
    ctl.step_record.begin(1, 1, 0, [(0, i, i + 1, 0) for i in range(n)])
    got = ctl.step_record.read()
    assert len(got.requests) == L.STEP_MAX_ENTRIES and got.unnamed == 3
    assert got.requests[-1] == InFlight(0, L.STEP_MAX_ENTRIES - 1, L.STEP_MAX_ENTRIES, 0)


def test_record_torn_by_a_dead_writer_reads_as_unknown():
    """A writer killed mid-write leaves the sequence odd: the reader says None (no attribution)
    quickly, and the next process's writer heals the record."""
    ctl = _make_control()
    ctl.step_record.begin(1, 1, 0, [(0, 1, 2, 3)])
    L.U64.pack_into(ctl._buf, L.CTRL_STEP_OFF, 9)  # odd: mid-write forever
    assert ctl.step_record.read(timeout=0.01) is None
    StepRecord(ctl._buf).begin(2, 1, 0, [(0, 5, 6, 7)])
    assert ctl.step_record.read().requests == (InFlight(0, 5, 6, 7),)


def test_fingerprint_names_the_request_not_its_delivery():
    """The same tenant, prompt and parameters fingerprint alike whatever the rid, request id,
    arrival and deadline; any of the former, or the key, changes it; it is never 0."""
    key = b"k" * 16
    fp = fingerprint(_submit(), key)
    assert fp != 0
    assert fingerprint(_submit(rid=9, request_id="other", arrival_ts=5.0, deadline_ts=9.0, fingerprint=fp), key) == fp
    different = [
        _submit(tenant="u"),
        _submit(prompt_ids=[5, 6, 8]),
        _submit(max_tokens=5),
        _submit(sampling=SamplingParams(temperature=0.5)),
        _submit(n=2),
        _submit(cache_salt="s"),
    ]
    assert fp not in {fingerprint(s, key) for s in different}
    assert fingerprint(_submit(), b"j" * 16) != fp


def test_quarantine_table_and_key_round_trip():
    """The supervisor's quarantine reaches any reader with a new sequence per write; every
    instance has its own random fingerprint key."""
    ctl = _make_control()
    seq0, table = ctl.quarantine()
    assert table == {}
    ctl.set_quarantine([(0xFFFF_FFFF_FFFF_FFFF, 1e9), (3, 2e9)])
    seq1, table = Control(ctl._buf).quarantine()
    assert seq1 != seq0 and ctl.quarantine_sequence == seq1
    assert table == {0xFFFF_FFFF_FFFF_FFFF: 1e9, 3: 2e9}
    assert len(ctl.fingerprint_key) == L.FINGERPRINT_KEY_BYTES
    assert ctl.fingerprint_key != _make_control().fingerprint_key
