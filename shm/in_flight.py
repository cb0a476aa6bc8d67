"""The step in flight: which requests the GPU process's running step holds
(`docs/design.md#failure-semantics`).

The GPU loop writes the record before each forward and clears it once the step's samples are
folded back in, so a process that dies inside a step leaves it behind: the supervisor, reading it
after the death, knows which requests were IN the crashing step (suspects) and which were merely
queued. It costs one seqlocked write of a few words per step.

An entry names a request twice: by (worker slot, rid), which its worker knows it by, and by its
fingerprint (`shm.messages.fingerprint`), which survives a resubmission under a new rid and a
resend by the client; plus a tag of its tenant. No prompt text is stored, only keyed hashes.

Layout (`shm/layout.py`, `CTRL_STEP_*`): a seqlock word, a header [generation of the writing GPU
process, step number, monotonic ns at its start, entries], then the entries [slot, rid,
fingerprint, tenant tag]. A record of another generation says nothing about the process that
died: each process's first write names its own generation.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from ringserve.shm import layout as L
from ringserve.shm.seqlock import SeqlockRegion, TornReadError

_HEADER = struct.Struct(f"{L.STEP_HEADER_WORDS}Q")  # native: aligned 8-byte words (layout's note)
_ENTRY_WORDS = L.STEP_ENTRY_WORDS


def tenant_tag(tenant: str) -> int:
    """A short, stable tag of a tenant (itself already a key hash) for the record."""
    return zlib.crc32(tenant.encode())


@dataclass(frozen=True, slots=True)
class InFlight:
    """One request of the step."""

    slot: int
    rid: int
    fingerprint: int
    tenant: int


@dataclass(frozen=True, slots=True)
class StepInFlight:
    """What the record says: the step `step` of the GPU process of `generation`, started at
    `started_ns` (time.monotonic_ns), holding `requests` (empty: no step was running)."""

    generation: int
    step: int
    started_ns: int
    requests: tuple[InFlight, ...]
    unnamed: int = 0  # requests of the step beyond the record's capacity


class StepRecord:
    """The record over a control segment's buffer. One writer: the GPU process of the current
    generation."""

    __slots__ = ("_region", "_generation", "_step")

    def __init__(self, buf) -> None:
        self._region = SeqlockRegion(buf, L.CTRL_STEP_OFF, L.CTRL_STEP_BYTES)
        self._generation = 0
        self._step = 0

    def begin(self, generation: int, step: int, started_ns: int, requests: Iterable[tuple[int, int, int, int]]) -> None:
        """A step is about to run with `requests`, each (slot, rid, fingerprint, tenant tag)."""
        words: list[int] = []
        count = 0
        for entry in requests:
            count += 1
            if count <= L.STEP_MAX_ENTRIES:
                words += entry
        self._generation, self._step = generation, step
        self._region.write_prefix(
            _HEADER.pack(generation, step, started_ns, count) + struct.pack(f"{len(words)}Q", *words)
        )

    def end(self) -> None:
        """The step's samples are in: nothing is in flight until the next `begin`."""
        self._region.write_prefix(_HEADER.pack(self._generation, self._step, 0, 0))

    def read(self, timeout: float = 0.05) -> StepInFlight | None:
        """The last record written, or None when it is torn (its writer died mid-write) or was
        never written."""
        try:
            raw = self._region.read(timeout)
        except TornReadError:
            return None
        generation, step, started_ns, count = _HEADER.unpack_from(raw, 0)
        if generation == 0:
            return None
        named = min(count, L.STEP_MAX_ENTRIES)
        words = struct.unpack_from(f"{named * _ENTRY_WORDS}Q", raw, _HEADER.size)
        requests = tuple(InFlight(*words[i : i + _ENTRY_WORDS]) for i in range(0, len(words), _ENTRY_WORDS))
        return StepInFlight(generation, step, started_ns, requests, count - named)
