"""Lock-free single-producer single-consumer ring of variable-length records in shared memory.

Positions (`head`, `tail`) are byte counters that only grow; a position's place in the data area
is `pos % capacity`. Each record is an 8-byte header word (see `layout`) and its payload, padded
to 8 bytes. A record that would cross the end of the data area is preceded by a PAD record that
fills the rest, so every payload is contiguous and can be handed out as one view.

Commit protocol (producer, for a record at position P ending at P'):
  1. write the payload,
  2. store 0 into the header slot at P' (where the next record will go),
  3. publish head = P',
  4. store the header word at P: this single 8-byte store is the commit.
The consumer reads the header word at its tail: 0 means nothing yet; a COMMIT word whose stamp
matches P is a whole record. Step 2 keeps the invariant that the slot at the consumer's next
position is zero until it is committed, so bytes left from an earlier lap are never taken for a
header, and a producer killed at any point leaves no half-written record visible.

NOTE (memory ordering): this relies on x86-64 TSO, where stores become visible to other cores in
program order and loads are not reordered with other loads, so no fences are needed. The 8-byte
words are read with native `struct` formats and stored with `layout.store_word` (one aligned
8-byte store each, never a zero in between; see `layout`). On a weakly ordered CPU (ARM) this protocol would need release/acquire fences.

One process pushes, one pops. A full ring refuses (`try_push` -> False); it never blocks and
never overwrites. A peer that replaces a dead one calls `adopt_producer` / `adopt_consumer`; the
supervisor calls `reset(generation)` only while neither side is attached.
"""

from __future__ import annotations

import os
import time

from ringserve.shm import layout as L

_U64 = L.U64
_pack = L.store_word  # never pack_into: it zeroes the word first (layout's note)
_unpack = _U64.unpack_from
# Hot-path constants as module globals (cheaper than attribute lookups on `L` per record).
_DATA = L.RING_DATA_OFF
_HEAD = L.RING_HEAD_OFF
_TAIL = L.RING_TAIL_OFF
_COMMIT = L.REC_COMMIT
_COMMIT_HI = L.REC_COMMIT >> L.REC_STAMP_SHIFT
_STAMP_MASK = L.REC_STAMP_MASK
_LEN_MASK = L.REC_LEN_MASK


class RingError(Exception):
    """Base class of ring failures."""


class RecordTooLarge(RingError, ValueError):
    """A record can never fit in this ring."""


class RingCorrupt(RingError):
    """The shared state breaks the ring's invariants (a bug or a foreign writer)."""


def format_ring(buf, capacity: int, generation: int = 0) -> None:
    """Write a fresh, empty ring header into `buf` (a segment of `ring_segment_size(capacity)`)."""
    if capacity < L.RING_MIN_CAPACITY or capacity % 8:
        raise ValueError(f"ring capacity must be a multiple of 8 and >= {L.RING_MIN_CAPACITY}, got {capacity}")
    if len(buf) < L.ring_segment_size(capacity):
        raise ValueError(f"buffer of {len(buf)} bytes cannot hold a ring of capacity {capacity}")
    for off in (
        L.RING_HEAD_OFF,
        L.RING_TAIL_OFF,
        L.RING_PRODUCER_HB_OFF,
        L.RING_CONSUMER_HB_OFF,
        L.RING_PRODUCER_PID_OFF,
        L.RING_CONSUMER_PID_OFF,
        L.RING_DATA_OFF,
    ):
        _pack(buf, off, 0)
    _pack(buf, L.RING_CAPACITY_OFF, capacity)
    _pack(buf, L.RING_GENERATION_OFF, generation)
    _pack(buf, L.RING_CREATED_NS_OFF, time.time_ns())
    _pack(buf, L.RING_VERSION_OFF, L.LAYOUT_VERSION)
    _pack(buf, L.RING_MAGIC_OFF, L.RING_MAGIC)  # last: a reader never sees a half-made header


def max_record_bytes(capacity: int) -> int:
    """The largest record payload a ring of `capacity` data bytes accepts.

    Records (header included) are capped at half the ring minus the next-slot word: a wrapping
    record then fits behind its pad whenever the ring is empty, so an empty ring never refuses a
    record of allowed size."""
    return ((capacity - 8) // 2 & ~7) - 8


class Ring:
    """One ring over a mapped buffer whose byte 0 is the ring header.

    Build it with `Ring.producer(buf)` or `Ring.consumer(buf)` in the process that plays that
    side, or `Ring(buf)` to observe. Methods of the other side must not be called.
    """

    __slots__ = ("_buf", "_view", "_cap", "_limit", "_head", "_tail", "_tail_seen", "_pending", "_pre_commit")

    def __init__(self, buf):
        if len(buf) < L.RING_DATA_OFF + L.RING_MIN_CAPACITY:
            raise RingCorrupt(f"buffer of {len(buf)} bytes is too small for a ring")
        magic = _unpack(buf, L.RING_MAGIC_OFF)[0]
        if magic != L.RING_MAGIC:
            raise RingCorrupt(f"not a ringserve ring (magic {magic:#x})")
        version = _unpack(buf, L.RING_VERSION_OFF)[0]
        if version != L.LAYOUT_VERSION:
            raise RingCorrupt(f"ring layout version {version}, this code speaks {L.LAYOUT_VERSION}")
        cap = _unpack(buf, L.RING_CAPACITY_OFF)[0]
        if cap % 8 or L.ring_segment_size(cap) > len(buf):
            raise RingCorrupt(f"ring capacity {cap} does not match its {len(buf)}-byte segment")
        self._buf = buf
        self._view = None  # memoryview for pop_views(), made on first use (it pins the map)
        self._cap = cap
        self._limit = max_record_bytes(cap) + 8  # header included
        self._head = _unpack(buf, L.RING_HEAD_OFF)[0]
        self._tail = _unpack(buf, L.RING_TAIL_OFF)[0]
        self._tail_seen = self._tail  # producer's cached copy of the consumer's tail
        self._pending = None  # consumer: tail to publish on release() after pop_views()
        self._pre_commit = None  # test hook: called between publishing head and the commit

    # -- attaching ------------------------------------------------------------------------------
    @classmethod
    def producer(cls, buf) -> Ring:
        """Attach as the producer, resuming after the last committed record."""
        ring = cls(buf)
        ring._resume_producer()
        _pack(buf, L.RING_PRODUCER_PID_OFF, os.getpid())
        ring.producer_heartbeat()
        return ring

    @classmethod
    def consumer(cls, buf) -> Ring:
        """Attach as the consumer at the published tail."""
        ring = cls(buf)
        _pack(buf, L.RING_CONSUMER_PID_OFF, os.getpid())
        ring.consumer_heartbeat()
        return ring

    def _scan_committed(self, pos: int) -> int:
        """The position of the first uncommitted slot at or after `pos` (a record boundary)."""
        buf, cap, data = self._buf, self._cap, L.RING_DATA_OFF
        limit = pos + cap
        while pos < limit:
            off = pos % cap
            word = _unpack(buf, data + off)[0]
            if word == 0:
                return pos
            self._check_word(word, pos, off)
            pos += (cap - off) if word & L.REC_PAD else L.record_size(word & L.REC_LEN_MASK)
        raise RingCorrupt("no free slot in a full lap of the ring")

    def _resume_producer(self) -> None:
        # A producer that died between publishing head and committing left head past its last
        # commit; the slot of that record is still zero, so resume there and rewrite it.
        tail = _unpack(self._buf, L.RING_TAIL_OFF)[0]
        self._head = self._scan_committed(tail)
        self._tail_seen = tail
        _pack(self._buf, L.RING_HEAD_OFF, self._head)

    def adopt_producer(self, generation: int) -> None:
        """Take over the producer side from a dead process: resume after its last commit."""
        _pack(self._buf, L.RING_GENERATION_OFF, generation)
        self._resume_producer()
        _pack(self._buf, L.RING_PRODUCER_PID_OFF, os.getpid())
        self.producer_heartbeat()

    def adopt_consumer(self, generation: int, discard: bool = True) -> int:
        """Take over the consumer side from a dead process; return the number of records dropped.

        With `discard`, the records committed before this call (meant for the dead consumer) are
        skipped; later ones are delivered.
        """
        _pack(self._buf, L.RING_GENERATION_OFF, generation)
        self._pending = None
        self._tail = _unpack(self._buf, L.RING_TAIL_OFF)[0]
        dropped = self.skip_committed() if discard else 0
        _pack(self._buf, L.RING_CONSUMER_PID_OFF, os.getpid())
        self.consumer_heartbeat()
        return dropped

    def skip_committed(self) -> int:
        """Consumer: drop the records committed before this call (meant for a consumer that is
        gone); later ones are delivered. Returns the number dropped."""
        dropped = 0
        head = _unpack(self._buf, L.RING_HEAD_OFF)[0]
        while self._tail < head:  # one at a time: never drop a record pushed after `head`
            if not self.pop_many(1):
                break  # the record at the old head was never committed
            dropped += 1
        return dropped

    def reset(self, generation: int) -> None:
        """Empty the ring and set its generation. Only while no producer or consumer is attached."""
        buf = self._buf
        _pack(buf, L.RING_DATA_OFF, 0)
        _pack(buf, L.RING_HEAD_OFF, 0)
        _pack(buf, L.RING_TAIL_OFF, 0)
        _pack(buf, L.RING_PRODUCER_PID_OFF, 0)
        _pack(buf, L.RING_CONSUMER_PID_OFF, 0)
        _pack(buf, L.RING_GENERATION_OFF, generation)
        self._head = self._tail = self._tail_seen = 0
        self._pending = None

    # -- producer -------------------------------------------------------------------------------
    def try_push(self, data) -> bool:
        """Append one record (bytes-like). False if the ring is full right now; never blocks."""
        n = len(data)
        size = (n + 15) & -8  # header + payload, 8-aligned
        if size > self._limit:
            raise self._too_large(n)
        cap = self._cap
        head = self._head
        off = head % cap
        if off + size > cap:  # would cross the end: fill the rest with a pad record first
            if not self._push_pad(head, off):
                return False
            head = self._head
            off = 0
        # `+ 8`: room to zero the next header slot is part of every reservation.
        if size + 8 > cap - head + self._tail_seen:
            self._tail_seen = _unpack(self._buf, _TAIL)[0]
            if size + 8 > cap - head + self._tail_seen:
                return False  # a pad, if one was written, stays; the record goes next time
        buf = self._buf
        d = _DATA + off
        buf[d + 8 : d + 8 + n] = data
        nxt = head + size
        _pack(buf, _DATA + nxt % cap, 0)
        _pack(buf, _HEAD, nxt)
        if self._pre_commit is not None:
            self._pre_commit()
        _pack(buf, d, _COMMIT | ((head >> 3) & _STAMP_MASK) << 32 | n)  # the commit
        self._head = nxt
        return True

    def _too_large(self, n: int) -> RecordTooLarge:
        return RecordTooLarge(
            f"record of {n:,} bytes exceeds what a ring of capacity "
            f"{self._cap:,} takes (max {self.max_record:,}); raise ring_bytes"
        )

    def _push_pad(self, head: int, off: int) -> bool:
        """Commit a PAD record from `off` to the end of the data area."""
        cap = self._cap
        pad = cap - off
        if pad + 8 > cap - (head - self._tail_seen):
            self._tail_seen = _unpack(self._buf, L.RING_TAIL_OFF)[0]
            if pad + 8 > cap - (head - self._tail_seen):
                return False
        buf = self._buf
        nxt = head + pad
        _pack(buf, L.RING_DATA_OFF, 0)  # nxt % cap == 0
        _pack(buf, L.RING_HEAD_OFF, nxt)
        _pack(buf, L.RING_DATA_OFF + off, L.record_check(head) | L.REC_PAD | (pad - 8))
        self._head = nxt
        return True

    @property
    def max_record(self) -> int:
        """The largest payload this ring accepts: an empty ring always takes one this size."""
        return max_record_bytes(self._cap)

    def producer_heartbeat(self) -> None:
        _pack(self._buf, L.RING_PRODUCER_HB_OFF, time.monotonic_ns())

    # -- consumer -------------------------------------------------------------------------------
    def _check_word(self, word: int, pos: int, off: int) -> None:
        if word & L.REC_CHECK_MASK != L.record_check(pos):
            raise RingCorrupt(f"bad record header {word:#018x} at position {pos} (offset {off})")
        length = word & L.REC_LEN_MASK
        if word & L.REC_PAD:
            if length != self._cap - off - 8:
                raise RingCorrupt(f"pad record at offset {off} has length {length}")
        elif off + L.record_size(length) > self._cap:
            raise RingCorrupt(f"record of {length} bytes at offset {off} crosses the ring end")

    def pop(self) -> bytes | None:
        """Remove and return the oldest record (a copy), or None if the ring is empty."""
        records = self.pop_many(1)
        return records[0] if records else None

    def pop_many(self, max_records: int = 1 << 30) -> list[bytes]:
        """Remove and return up to `max_records` records (copies), oldest first."""
        if self._pending is not None:
            raise RingError("release() the records of pop_views() before popping more")
        buf, cap = self._buf, self._cap
        tail = start = self._tail
        out: list[bytes] = []
        append = out.append
        count = 0
        while count < max_records:
            off = tail % cap
            d = _DATA + off
            word = _unpack(buf, d)[0]
            if not word:
                break
            if word >> 32 != _COMMIT_HI | ((tail >> 3) & _STAMP_MASK):
                self._check_word(word, tail, off)  # raises unless it is a valid pad record
                tail += cap - off
                continue
            n = word & _LEN_MASK
            if off + n + 8 > cap:
                self._check_word(word, tail, off)  # raises: the length is impossible
            append(buf[d + 8 : d + 8 + n])
            tail += (n + 15) & -8
            count += 1
        if tail != start:
            # Only now may the producer reuse the space: the payloads are already copied.
            _pack(buf, _TAIL, tail)
            self._tail = tail
        return out

    def pop_views(self, max_records: int = 1 << 30) -> list[memoryview]:
        """Zero-copy variant of `pop_many`: views into the ring, valid until `release()`.

        The space stays reserved until `release()`; the views must not be used after it. An
        empty result needs no release.
        """
        if self._pending is not None:
            raise RingError("release() the records of pop_views() before popping more")
        buf, cap, view = self._buf, self._cap, self._view
        if view is None:
            view = self._view = memoryview(buf)
        tail = self._tail
        out: list[memoryview] = []
        while len(out) < max_records:
            off = tail % cap
            d = L.RING_DATA_OFF + off
            word = _unpack(buf, d)[0]
            if word == 0:
                break
            self._check_word(word, tail, off)
            if word & L.REC_PAD:
                tail += cap - off
                continue
            n = word & L.REC_LEN_MASK
            out.append(view[d + 8 : d + 8 + n])
            tail += (n + 15) & ~7
        if tail != self._tail:
            self._pending = tail
        return out

    def release(self) -> None:
        """Give the space of the records returned by the last `pop_views()` back to the producer."""
        if self._pending is None:
            return
        self._tail = self._pending
        self._pending = None
        _pack(self._buf, L.RING_TAIL_OFF, self._tail)

    def consumer_heartbeat(self) -> None:
        _pack(self._buf, L.RING_CONSUMER_HB_OFF, time.monotonic_ns())

    # -- observing ------------------------------------------------------------------------------
    def _word(self, off: int) -> int:
        return _unpack(self._buf, off)[0]

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def head(self) -> int:
        return self._word(L.RING_HEAD_OFF)

    @property
    def tail(self) -> int:
        return self._word(L.RING_TAIL_OFF)

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by records not yet consumed (headers and padding included)."""
        return max(0, self.head - self.tail)

    @property
    def generation(self) -> int:
        return self._word(L.RING_GENERATION_OFF)

    def is_empty(self) -> bool:
        """Consumer's view: nothing committed waits at its tail (a pending pad counts as something)."""
        return self._word(L.RING_DATA_OFF + self._tail % self._cap) == 0

    def snapshot(self) -> dict:
        """Every header field plus derived values, for the inspector and logs."""
        now = time.monotonic_ns()
        fields = {f.name: f.read(self._buf) for f in L.RING_FIELDS if f.name != "magic"}
        snap: dict[str, float | int | None] = dict(fields)
        snap["used_bytes"] = max(0, fields["head"] - fields["tail"])
        for side in ("producer", "consumer"):
            hb = fields[f"{side}_heartbeat_ns"]
            snap[f"{side}_heartbeat_age_s"] = (now - hb) / 1e9 if hb else None
        return snap

    def check_integrity(self) -> None:
        """Raise RingCorrupt unless the shared state is consistent.

        Exact when neither side is mid-operation (tests call it after each scenario; the
        inspector on a live ring may see a record being written).
        """
        cap = self._cap
        if self._word(L.RING_MAGIC_OFF) != L.RING_MAGIC:
            raise RingCorrupt("ring magic overwritten")
        if self._word(L.RING_CAPACITY_OFF) != cap:
            raise RingCorrupt("ring capacity changed under us")
        head, tail = self.head, self.tail
        if head % 8 or tail % 8:
            raise RingCorrupt(f"unaligned head {head} or tail {tail}")
        if not 0 <= head - tail <= cap:
            raise RingCorrupt(f"head {head} and tail {tail} are more than a ring apart")
        end = self._scan_committed(tail)
        if end != head:
            raise RingCorrupt(f"committed records end at {end} but head is {head}")
        if self._word(L.RING_DATA_OFF + head % cap) != 0:
            raise RingCorrupt(f"header slot at head {head} is not zero")
