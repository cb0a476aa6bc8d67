"""The control block: GPU generation, state and heartbeat, model facts, per-worker slots, and
seqlock-protected stats (one GPU region, one region per worker).

Writers: the supervisor (generation, state, slot pid/generation, restart status), the GPU process
(its heartbeat, state READY, model facts, exit note, GPU stats), each worker (its slot heartbeat
and its own stats). Every seqlocked region has exactly one writer at a time (successive GPU
processes take turns); any process may read any region, so one worker can answer `/metrics` for
the whole server.

Seqlock: the writer makes the sequence word odd, writes, then makes it even; a reader copies the
region between two reads of the word and retries when they differ or are odd. Under x86-64 TSO
(stores and loads each stay in program order) that is all a seqlock needs; see `ring.py`.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Mapping

import msgspec

from ringserve.shm import layout as L

_U64 = L.U64


class ControlError(Exception):
    """The control segment is not one this code can use."""


class TornReadError(ControlError):
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
        buf, off = self._buf, self._off
        seq = self._seq
        if seq is None:
            # A writer that died mid-write left the word odd: start from the next even value.
            seq = (_U64.unpack_from(buf, off)[0] + 1) & ~1
        _U64.pack_into(buf, off, seq + 1)
        buf[off + 8 : off + 8 + self._size] = data
        _U64.pack_into(buf, off, seq + 2)
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


def _clip(text: str, limit: int) -> str:
    return text if len(text.encode()) <= limit else text.encode()[:limit].decode(errors="ignore") + "..."


class Control:
    """The control block over a mapped control segment."""

    def __init__(self, buf) -> None:
        if len(buf) < L.CTRL_WORKERS_OFF:
            raise ControlError(f"control segment of {len(buf)} bytes is too small")
        magic = _U64.unpack_from(buf, L.CTRL_MAGIC_OFF)[0]
        if magic != L.CONTROL_MAGIC:
            raise ControlError(f"not a ringserve control segment (magic {magic:#x})")
        version = _U64.unpack_from(buf, L.CTRL_VERSION_OFF)[0]
        schema = _U64.unpack_from(buf, L.CTRL_SCHEMA_OFF)[0]
        if version != L.LAYOUT_VERSION or schema != L.SCHEMA_ID:
            raise ControlError(
                f"control segment layout {version}/{schema:#x} differs from this "
                f"code's {L.LAYOUT_VERSION}/{L.SCHEMA_ID:#x}: restart all processes"
            )
        self._buf = buf
        self.n_workers = _U64.unpack_from(buf, L.CTRL_N_WORKERS_OFF)[0]
        if len(buf) < L.control_segment_size(self.n_workers):
            raise ControlError(f"control segment too small for {self.n_workers} workers")
        self.gpu_stats = StatsRegion(buf, L.CTRL_GPU_STATS_OFF, L.GPU_STAT_NAMES)
        self._facts = BlobRegion(buf, L.CTRL_FACTS_OFF, L.CTRL_FACTS_BYTES, "model facts")
        self._gpu_exit = BlobRegion(buf, L.CTRL_GPU_EXIT_OFF, L.CTRL_NOTE_BYTES, "GPU exit note")
        self._restart = BlobRegion(buf, L.CTRL_RESTART_OFF, L.CTRL_NOTE_BYTES, "restart status")
        self._worker_stats: dict[int, StatsRegion] = {}

    @staticmethod
    def format(buf, n_workers: int) -> None:
        """Write an empty control block for `n_workers` slots into a zero-filled buffer."""
        if not 1 <= n_workers <= L.MAX_WORKERS:
            raise ValueError(f"n_workers must be in 1..{L.MAX_WORKERS}, got {n_workers}")
        if len(buf) < L.control_segment_size(n_workers):
            raise ValueError(f"buffer of {len(buf)} bytes cannot hold {n_workers} worker slots")
        for off, value in (
            (L.CTRL_VERSION_OFF, L.LAYOUT_VERSION),
            (L.CTRL_SCHEMA_OFF, L.SCHEMA_ID),
            (L.CTRL_N_WORKERS_OFF, n_workers),
            (L.CTRL_CREATED_NS_OFF, time.time_ns()),
            (L.CTRL_OWNER_PID_OFF, os.getpid()),
        ):
            _U64.pack_into(buf, off, value)
        _U64.pack_into(buf, L.CTRL_MAGIC_OFF, L.CONTROL_MAGIC)

    def _get(self, off: int) -> int:
        return _U64.unpack_from(self._buf, off)[0]

    def _set(self, off: int, value: int) -> None:
        _U64.pack_into(self._buf, off, value)

    # -- GPU process ----------------------------------------------------------------------------
    @property
    def gpu_generation(self) -> int:
        return self._get(L.CTRL_GPU_GENERATION_OFF)

    def bump_gpu_generation(self) -> int:
        """Supervisor: a new GPU process is starting; return its generation."""
        gen = self.gpu_generation + 1
        self._set(L.CTRL_GPU_GENERATION_OFF, gen)
        return gen

    @property
    def gpu_state(self) -> L.GpuState:
        raw = self._get(L.CTRL_GPU_STATE_OFF)
        try:
            return L.GpuState(raw)
        except ValueError:
            raise ControlError(f"unknown GPU state {raw}") from None

    def set_gpu_state(self, state: L.GpuState, pid: int | None = None) -> None:
        if pid is not None:
            self._set(L.CTRL_GPU_PID_OFF, pid)
        self._set(L.CTRL_GPU_STATE_OFF, int(state))

    @property
    def gpu_pid(self) -> int:
        return self._get(L.CTRL_GPU_PID_OFF)

    def gpu_heartbeat(self) -> None:
        self._set(L.CTRL_GPU_HB_OFF, time.monotonic_ns())

    def gpu_heartbeat_age_s(self) -> float | None:
        """Seconds since the GPU process's last heartbeat; None if it never beat."""
        hb = self._get(L.CTRL_GPU_HB_OFF)
        return (time.monotonic_ns() - hb) / 1e9 if hb else None

    def set_model_facts(self, facts: Mapping[str, object]) -> None:
        """GPU process: publish the model facts (name, vocab size, block size, ...) once loaded."""
        self._facts.write(dict(facts))

    def model_facts(self) -> dict | None:
        """The published model facts, or None before the GPU process has published them."""
        return self._facts.read()

    def set_gpu_exit(self, error: str) -> None:
        """GPU process: why it is about to exit (its exception), for the supervisor and clients."""
        self._gpu_exit.write(_clip(error, L.CTRL_NOTE_BYTES - 64))

    def gpu_exit(self) -> tuple[int, str | None]:
        """(sequence, note): compare the sequence with one taken at spawn to tell whether the
        process that just died wrote the note (a SIGKILLed one writes nothing)."""
        return self._gpu_exit.sequence, self._gpu_exit.read()

    def set_restart_status(self, status: Mapping[str, object]) -> None:
        """Supervisor: {state, last_error, failures, retry_at (unix time or None)}."""
        status = dict(status)
        error = status.get("last_error")
        if isinstance(error, str):
            status["last_error"] = _clip(error, L.CTRL_NOTE_BYTES - 128)
        self._restart.write(status)

    def restart_status(self) -> dict | None:
        """The supervisor's restart status, or None before the first GPU-process failure."""
        return self._restart.read()

    # -- worker slots ---------------------------------------------------------------------------
    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_workers:
            raise IndexError(f"worker slot {slot} out of range 0..{self.n_workers - 1}")
        return L.worker_block_offset(slot)

    def start_worker_slot(self, slot: int, pid: int) -> int:
        """Supervisor: record a (re)started worker in `slot`; return the slot's new generation."""
        base = self._slot(slot)
        gen = self._get(base + L.SLOT_GENERATION) + 1
        self._set(base + L.SLOT_GENERATION, gen)
        self._set(base + L.SLOT_PID, pid)
        self._set(base + L.SLOT_HB, 0)
        return gen

    def worker_heartbeat(self, slot: int) -> None:
        self._set(self._slot(slot) + L.SLOT_HB, time.monotonic_ns())

    def worker_slot(self, slot: int) -> dict:
        """{pid, generation, heartbeat_age_s} of one slot."""
        base = self._slot(slot)
        hb = self._get(base + L.SLOT_HB)
        return {
            "pid": self._get(base + L.SLOT_PID),
            "generation": self._get(base + L.SLOT_GENERATION),
            "heartbeat_age_s": (time.monotonic_ns() - hb) / 1e9 if hb else None,
        }

    def worker_stats(self, slot: int) -> StatsRegion:
        """The stats region of one worker (write it only from that worker)."""
        region = self._worker_stats.get(slot)
        if region is None:
            region = StatsRegion(self._buf, self._slot(slot) + L.SLOT_STATS_OFF, L.WORKER_STAT_NAMES)
            self._worker_stats[slot] = region
        return region

    def all_worker_stats(self, slots: Iterable[int] | None = None) -> dict[str, float]:
        """Sum of every worker's stats: what `/metrics` reports for the whole server."""
        total = dict.fromkeys(L.WORKER_STAT_NAMES, 0.0)
        for slot in range(self.n_workers) if slots is None else slots:
            for name, value in self.worker_stats(slot).read().items():
                total[name] += value
        return total

    def snapshot(self) -> dict:
        """Header fields, GPU state and facts, and slots, for the inspector."""
        snap: dict[str, object] = {f.name: f.read(self._buf) for f in L.CONTROL_FIELDS if f.name != "magic"}
        snap["gpu_state"] = self.gpu_state.name.lower()
        snap["gpu_heartbeat_age_s"] = self.gpu_heartbeat_age_s()
        snap["model_facts"] = self.model_facts()
        snap["restart_status"] = self.restart_status()
        snap["gpu_stats"] = self.gpu_stats.read()
        snap["workers"] = [self.worker_slot(i) for i in range(self.n_workers)]
        return snap
