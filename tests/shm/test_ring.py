"""Single-process behaviour of the SPSC ring: order, wrap-around, full/empty, limits, resets."""

from __future__ import annotations

import mmap
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.shm import layout as L
from ringserve.shm.ring import RecordTooLarge, Ring, RingCorrupt, RingError, format_ring


def _make_ring(capacity: int = 1024, generation: int = 0) -> tuple[Ring, Ring]:
    """(producer, consumer) over one anonymous shared map."""
    buf = mmap.mmap(-1, L.ring_segment_size(capacity))
    format_ring(buf, capacity, generation)
    return Ring.producer(buf), Ring.consumer(buf)


def _payload(seq: int, size: int) -> bytes:
    return bytes((seq + i) % 251 for i in range(size))


def test_empty_ring_pops_nothing():
    """A fresh ring is empty, consistent, and pops None."""
    prod, cons = _make_ring()
    assert cons.pop() is None
    assert cons.pop_many() == []
    assert cons.is_empty() and prod.used_bytes == 0
    prod.check_integrity()


def test_records_come_out_in_order_and_intact():
    """Records of assorted sizes, including empty ones, pop in order with their exact bytes."""
    prod, cons = _make_ring(4096)
    sent = [_payload(i, size) for i, size in enumerate([0, 1, 7, 8, 9, 63, 64, 65, 500])]
    for rec in sent:
        assert prod.try_push(rec)
    prod.check_integrity()
    assert cons.pop() == sent[0]
    assert cons.pop_many(3) == sent[1:4]
    assert cons.pop_many() == sent[4:]
    assert cons.pop() is None
    cons.check_integrity()


def test_full_ring_refuses_and_never_overwrites():
    """A full ring returns False; the queued records survive; space frees after a pop."""
    prod, cons = _make_ring(256)
    pushed = []
    while prod.try_push(_payload(len(pushed), 24)):
        pushed.append(_payload(len(pushed), 24))
    assert len(pushed) == (256 - 8) // 32  # 32 bytes a record, 8 kept for the next header slot
    assert [prod.try_push(b"") for _ in range(4)] == [True] * 3 + [False]  # 8 bytes each
    assert cons.pop() == pushed[0]
    assert prod.try_push(b"again")
    assert cons.pop_many() == pushed[1:] + [b""] * 3 + [b"again"]
    prod.check_integrity()


def test_record_larger_than_allowed_is_a_clear_error():
    """A too-large record raises RecordTooLarge naming the limit; the max size always fits."""
    prod, cons = _make_ring(1024)
    assert prod.max_record == 496  # (1024 - 8) / 2 rounded to 8, less the header
    with pytest.raises(RecordTooLarge, match="max 496"):
        prod.try_push(bytes(497))
    for lead in range(0, 497, 40):  # from any offset an empty ring takes a max-size record
        assert prod.try_push(bytes(lead))
        assert cons.pop() == bytes(lead)
        assert prod.try_push(bytes(496))
        assert cons.pop() == bytes(496)
    prod.check_integrity()


def _advance(prod: Ring, cons: Ring, nbytes: int) -> None:
    """Move an empty ring's positions forward by `nbytes` (a multiple of 8)."""
    while nbytes:
        payload = min(nbytes, 64) - 8
        assert prod.try_push(bytes(payload)) and cons.pop() == bytes(payload)
        nbytes -= payload + 8


@pytest.mark.parametrize("start", range(0, 256, 8))
@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 60, 112])  # every length mod 8
def test_wrap_around_at_every_offset(start, size):
    """From every 8-byte offset, records wrap through a pad record and arrive intact."""
    prod, cons = _make_ring(256)
    _advance(prod, cons, start)
    assert prod.head == start
    sent = deque()
    for seq in range(12):  # several laps of a 256-byte ring
        rec = _payload(seq, size)
        while not prod.try_push(rec):
            assert sent, "an empty ring refused a record"
            assert cons.pop() == sent.popleft()
        sent.append(rec)
        prod.check_integrity()
    assert cons.pop_many() == list(sent)
    cons.check_integrity()


def test_pop_views_are_zero_copy_until_release():
    """Views read the ring in place; space returns to the producer only on release()."""
    prod, cons = _make_ring(256)
    assert prod.try_push(b"a" * 100) and prod.try_push(b"b" * 100)
    views = cons.pop_views()
    assert [bytes(v) for v in views] == [b"a" * 100, b"b" * 100]
    assert not prod.try_push(b"c" * 100)  # still reserved
    with pytest.raises(RingError):
        cons.pop_views()
    for v in views:
        v.release()
    cons.release()
    assert prod.try_push(b"c" * 100)
    assert cons.pop() == b"c" * 100


def test_reset_empties_and_sets_generation():
    """reset(generation) drops queued records, bumps the generation and the ring works again."""
    prod, cons = _make_ring(512)
    for i in range(5):
        prod.try_push(_payload(i, 40))
    cons.pop()
    prod.reset(7)
    prod, cons = Ring.producer(prod._buf), Ring.consumer(prod._buf)
    assert prod.generation == 7 and cons.pop() is None
    assert prod.head == prod.tail == 0
    assert prod.try_push(b"fresh") and cons.pop() == b"fresh"
    prod.check_integrity()


def test_adopt_consumer_discards_records_of_the_dead_consumer():
    """A new consumer skips what was queued for its predecessor and gets later records."""
    prod, old = _make_ring(512)
    for i in range(4):
        prod.try_push(_payload(i, 30))
    old.pop()
    new = Ring(prod._buf)
    assert new.adopt_consumer(generation=3) == 3
    assert new.generation == 3 and new.pop() is None
    prod.try_push(b"after")
    assert new.pop() == b"after"
    prod.check_integrity()


def test_adopt_producer_resumes_after_an_uncommitted_record():
    """A producer that died after publishing head but before committing is rewritten cleanly."""
    prod, cons = _make_ring(512)
    prod.try_push(b"one")

    def die():
        raise KeyboardInterrupt  # stands in for SIGKILL between head and commit

    prod._pre_commit = die
    with pytest.raises(KeyboardInterrupt):
        prod.try_push(b"never committed")
    assert cons.pop() == b"one" and cons.pop() is None
    with pytest.raises(RingCorrupt, match="committed records end"):
        prod.check_integrity()
    new = Ring(prod._buf)
    new.adopt_producer(generation=2)
    new.check_integrity()
    assert new.try_push(b"two")
    assert cons.pop() == b"two" and cons.pop() is None


def test_corrupt_header_is_detected():
    """A header word with the wrong stamp raises RingCorrupt rather than delivering garbage."""
    prod, cons = _make_ring(512)
    prod.try_push(b"x" * 16)
    L.U64.pack_into(prod._buf, L.RING_DATA_OFF, L.record_check(8) | 16)  # stamp of position 8
    with pytest.raises(RingCorrupt):
        cons.pop()
    with pytest.raises(RingCorrupt):
        prod.check_integrity()


def test_not_a_ring_is_refused():
    """Attaching to a buffer without the ring magic fails with a clear error."""
    with pytest.raises(RingCorrupt, match="not a ringserve ring"):
        Ring(mmap.mmap(-1, L.ring_segment_size(1024)))


def test_snapshot_reports_state():
    """snapshot() carries capacity, positions, bytes in use, pids and heartbeat ages."""
    prod, cons = _make_ring(1024, generation=4)
    prod.try_push(b"x" * 10)
    snap = cons.snapshot()
    assert snap["capacity"] == 1024 and snap["generation"] == 4
    assert snap["head"] == 24 and snap["tail"] == 0 and snap["used_bytes"] == 24
    assert snap["producer_heartbeat_age_s"] >= 0 and snap["producer_pid"] > 0


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 300)),
        st.tuples(st.just("pop"), st.integers(1, 6)),
        st.tuples(st.just("views"), st.integers(1, 6)),
    ),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.sampled_from([256, 264, 512, 1000, 4096]), ops=_ops)
def test_property_ring_matches_a_queue(capacity, ops):
    """Any interleaving of pushes and pops behaves like a FIFO that refuses when full."""
    prod, cons = _make_ring(capacity)
    model: deque[bytes] = deque()
    for seq, (op, arg) in enumerate(ops):
        if op == "push":
            rec = _payload(seq, arg)
            if arg > prod.max_record:
                with pytest.raises(RecordTooLarge):
                    prod.try_push(rec)
            elif prod.try_push(rec):
                model.append(rec)
            else:
                assert model, "an empty ring refused a record that fits"
        else:
            if op == "pop":
                got = cons.pop_many(arg)
            else:
                got = [bytes(v) for v in cons.pop_views(arg)]
                cons.release()
            assert got == [model.popleft() for _ in range(len(got))]
            if len(got) < arg:
                assert not model
        prod.check_integrity()
    assert cons.pop_many() == list(model)


def test_any_bytes_like_record_is_accepted():
    """bytes, bytearray and memoryview slices all push; pop returns bytes."""
    prod, cons = _make_ring()
    data = bytearray(b"0123456789")
    assert prod.try_push(data) and prod.try_push(memoryview(data)[2:5]) and prod.try_push(b"z")
    assert cons.pop_many() == [b"0123456789", b"234", b"z"]


def test_format_rejects_bad_capacity():
    """A capacity that is not a multiple of 8, too small, or bigger than the buffer is refused."""
    buf = mmap.mmap(-1, L.ring_segment_size(1024))
    for capacity in (1001, 8, 2048):
        with pytest.raises(ValueError):
            format_ring(buf, capacity)
