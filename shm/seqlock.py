"""Seqlock-protected regions of shared memory: the primitive every control-block region and the
step-in-flight record are built on (`shm/control.py`, `shm/in_flight.py`).

Seqlock: the writer makes the sequence word odd, writes, then makes it even; a reader copies the
region between two reads of the word and retries when they differ or are odd. Under x86-64 TSO
(stores and loads each stay in program order) that is all a seqlock needs; see `ring.py`. Every
region has exactly one writer at a time.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping

import msgspec

from ringserve.shm import layout as L

_U64 = L.U64
_store = L.store_word


class TornReadError(Exception):
    """A seqlocked region stayed mid-write for the whole timeout: its writer probably died there."""


class SeqlockRegion:
    """A sequence word followed by `size` bytes, at `offset` of `buf`. One writer only."""

    __slots__ = ("_buf", "_off", "_size", "_seq")

    SPINS = 200  # busy retries before the reader starts sleeping between tries

    def __init__(self, buf, offset: int, size: int):
        self._buf = buf
        self._off = offset
        self._size = size
        self._seq = None  # the writer's cached sequence

    def write(self, data) -> None:
        """Publish `data` (exactly `size` bytes) as one consistent update."""
        if len(data) != self._size:
            raise ValueError(f"seqlock region holds {self._size} bytes, got {len(data)}")
        self.write_prefix(data)

    def write_prefix(self, data) -> None:
        """Publish `data` (at most `size` bytes) over the region's start as one consistent update;
        the bytes after it keep what they held (the caller's format says how much is valid)."""
        if len(data) > self._size:
            raise ValueError(f"seqlock region holds {self._size} bytes, got {len(data)}")
        buf, off = self._buf, self._off
        seq = self._seq
        if seq is None:
            # A writer that died mid-write left the word odd: start from the next even value.
            seq = (_U64.unpack_from(buf, off)[0] + 1) & ~1
        _store(buf, off, seq + 1)
        buf[off + 8 : off + 8 + len(data)] = data
        _store(buf, off, seq + 2)
        self._seq = seq + 2

    def read(self, timeout: float = 1.0) -> bytes:
        """A consistent copy of the region; retries torn reads for up to `timeout` seconds.

        A writer preempted mid-update holds the word odd for a scheduler slice, so after a
        short spin the reader yields the CPU instead of burning it.
        """
        buf, off, end = self._buf, self._off, self._off + 8 + self._size
        unpack = _U64.unpack_from
        deadline = None
        tries = 0
        while True:
            s1 = unpack(buf, off)[0]
            if not s1 & 1:
                data = buf[off + 8 : end]
                if unpack(buf, off)[0] == s1:
                    return data
            tries += 1
            if tries >= self.SPINS:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + timeout
                elif now > deadline:
                    raise TornReadError(
                        f"seqlock at offset {off} stayed odd or changing for "
                        f"{timeout}s; its writer likely died mid-update"
                    )
                time.sleep(0.0001)

    @property
    def sequence(self) -> int:
        return _U64.unpack_from(self._buf, self._off)[0]


class StatsRegion:
    """Named float64 values under a seqlock. The writer keeps a local copy and publishes it whole."""

    __slots__ = ("names", "_index", "_region", "_struct", "_values")

    def __init__(self, buf, offset: int, names: tuple[str, ...]):
        self.names = names
        self._index = {name: i for i, name in enumerate(names)}
        self._struct = struct.Struct(f"{len(names)}d")
        self._region = SeqlockRegion(buf, offset, self._struct.size)
        self._values: list[float] | None = None

    def _local(self) -> list[float]:
        if self._values is None:  # resume from what is published (e.g. after a restart)
            self._values = list(self._struct.unpack(self._region.read()))
        return self._values

    def set(self, name: str, value: float) -> None:
        self._local()[self._index[name]] = value

    def add(self, name: str, value: float = 1.0) -> None:
        self._local()[self._index[name]] += value

    def update(self, values: Mapping[str, float]) -> None:
        local = self._local()
        for name, value in values.items():
            local[self._index[name]] = value

    def reset(self) -> None:
        """Writer: start from zeros (a fresh process, or after a writer died mid-update)."""
        self._values = [0.0] * len(self.names)
        self.publish()

    def publish(self) -> None:
        """Make the local values visible to readers as one consistent snapshot."""
        self._region.write(self._struct.pack(*self._local()))

    def read(self, timeout: float = 1.0) -> dict[str, float]:
        """The last published snapshot as {name: value} (TornReadError after `timeout` s)."""
        return dict(zip(self.names, self._struct.unpack(self._region.read(timeout))))


class BlobRegion:
    """A msgpack value under a seqlock: a length word, then up to `capacity` bytes."""

    __slots__ = ("_region", "capacity", "name")

    def __init__(self, buf, offset: int, capacity: int, name: str):
        self._region = SeqlockRegion(buf, offset, 8 + capacity)
        self.capacity = capacity
        self.name = name

    def write(self, value) -> None:
        blob = msgspec.msgpack.encode(value)
        if len(blob) > self.capacity:
            raise ValueError(f"{self.name} take {len(blob)} bytes, the control block holds {self.capacity}")
        self._region.write(_U64.pack(len(blob)) + blob.ljust(self.capacity, b"\0"))

    def read(self):
        """The last value written, or None before the first write."""
        raw = self._region.read()
        n = _U64.unpack_from(raw, 0)[0]
        return msgspec.msgpack.decode(raw[8 : 8 + n]) if n else None

    @property
    def sequence(self) -> int:
        """Changes with every write (a reader can tell whether a new writer wrote)."""
        return self._region.sequence
