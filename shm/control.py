"""The control block: GPU generation, state and heartbeat, model facts, per-worker slots,
seqlock-protected stats (one GPU region, one region per worker), and crash attribution (the step
in flight, the quarantined requests: `shm/in_flight.py`).

Writers: the supervisor (generation, state, slot pid/generation, restart status, the fingerprint
key, the quarantine), the GPU process (its heartbeat, state READY, model facts, exit note, GPU
stats, the step in flight), each worker (its slot heartbeat and its own stats). Every seqlocked
region (`shm/seqlock.py`) has exactly one writer at a time (successive GPU processes take turns);
any process may read any region, so one worker can answer `/metrics` for the whole server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import msgspec

from ringserve.shm import layout as L
from ringserve.shm import stats_schema as S
from ringserve.shm.in_flight import StepRecord
from ringserve.shm.seqlock import BlobRegion, StatsRegion, TornReadError

__all__ = ["Control", "ControlError", "LoraEntry", "TornReadError"]

_U64 = L.U64


class LoraEntry(NamedTuple):
    """One served LoRA adapter: its stats index (lora_running_<i>), name, checkpoint path, and
    whether it was loaded at runtime (`/v1/load_lora_adapter`) rather than by `--lora-modules`."""

    stat: int
    name: str
    path: str
    runtime: bool


class ControlError(Exception):
    """The control segment is not one this code can use."""


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
        self.gpu_stats = StatsRegion(buf, L.CTRL_GPU_STATS_OFF, S.GPU_STAT_NAMES)
        self._facts = BlobRegion(buf, L.CTRL_FACTS_OFF, L.CTRL_FACTS_BYTES, "model facts")
        self._gpu_exit = BlobRegion(buf, L.CTRL_GPU_EXIT_OFF, L.CTRL_NOTE_BYTES, "GPU exit note")
        self._restart = BlobRegion(buf, L.CTRL_RESTART_OFF, L.CTRL_NOTE_BYTES, "restart status")
        self._refusals = BlobRegion(buf, L.CTRL_REFUSALS_OFF, L.CTRL_REFUSALS_BYTES, "refused tenants")
        self._loras = BlobRegion(buf, L.CTRL_LORAS_OFF, L.CTRL_LORAS_BYTES, "LoRA adapters")
        self._loras_read: tuple[int, tuple[LoraEntry, ...]] = (-1, ())
        self._tenants = BlobRegion(buf, L.CTRL_TENANTS_OFF, L.CTRL_TENANTS_BYTES, "metrics tenants")
        self.step_record = StepRecord(buf)
        self._quarantine = BlobRegion(buf, L.CTRL_QUARANTINE_OFF, L.CTRL_QUARANTINE_BYTES, "quarantined requests")
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
            L.store_word(buf, off, value)
        buf[L.CTRL_FINGERPRINT_KEY_OFF : L.CTRL_FINGERPRINT_KEY_OFF + L.FINGERPRINT_KEY_BYTES] = os.urandom(
            L.FINGERPRINT_KEY_BYTES
        )
        L.store_word(buf, L.CTRL_MAGIC_OFF, L.CONTROL_MAGIC)

    def _get(self, off: int) -> int:
        return _U64.unpack_from(self._buf, off)[0]

    def _set(self, off: int, value: int) -> None:
        L.store_word(self._buf, off, value)

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

    def set_refusals(self, limit_ms: float, near: Mapping[str, tuple[int, int]]) -> None:
        """GPU process: its queue limit, and tenant -> (ms of work ahead, Retry-After s) for the
        tenants near it, most work ahead first; as many as the region holds (a tenant left out
        is decided by the GPU process itself)."""
        items = [(t, list(v)) for t, v in list(near.items())[: L.MAX_REFUSED_TENANTS]]
        while len(msgspec.msgpack.encode([limit_ms, dict(items)])) > self._refusals.capacity:
            items.pop()
        self._refusals.write([limit_ms, dict(items)])

    def refusals(self) -> tuple[int, float, dict[str, tuple[int, int]]]:
        """(sequence, queue limit ms, tenant -> (ms ahead, Retry-After s)): a reader re-reads
        it only when the sequence moved."""
        seq = self._refusals.sequence
        limit, near = self._refusals.read() or (0.0, {})
        return seq, limit, {t: (int(a), int(r)) for t, (a, r) in near.items()}

    @property
    def refusals_sequence(self) -> int:
        return self._refusals.sequence

    def set_loras(self, entries: Iterable[LoraEntry]) -> None:
        """GPU process: the adapters it serves now (`gpu_proc/lora.py`, `LoraRegistry.table`)."""
        self._loras.write([list(e) for e in entries])

    def loras(self) -> tuple[LoraEntry, ...]:
        """The adapters served, as the GPU process last published them (those of an earlier GPU
        process until the next one publishes). Decoded again only when the blob changed."""
        seq = self._loras.sequence
        if seq != self._loras_read[0]:
            raw = self._loras.read() or []
            self._loras_read = (seq, tuple(LoraEntry(int(i), str(n), str(p), bool(r)) for i, n, p, r in raw))
        return self._loras_read[1]

    def set_tenants(self, names: Iterable[str]) -> None:
        """GPU process: the tenants with their own metrics slot, in slot order."""
        self._tenants.write(list(names))

    def tenants(self) -> tuple[str, ...]:
        return tuple(str(n) for n in self._tenants.read() or ())

    # -- crash attribution (shm/in_flight.py) ---------------------------------------------------
    @property
    def fingerprint_key(self) -> bytes:
        """The instance's key of request fingerprints (random, set at creation): a fingerprint in
        a log cannot be tested against a guessed prompt."""
        return bytes(self._buf[L.CTRL_FINGERPRINT_KEY_OFF : L.CTRL_FINGERPRINT_KEY_OFF + L.FINGERPRINT_KEY_BYTES])

    def set_quarantine(self, entries: Iterable[tuple[int, float]]) -> None:
        """Supervisor: the quarantined requests, (fingerprint, until unix time) each."""
        self._quarantine.write([list(e) for e in entries])

    def quarantine(self) -> tuple[int, dict[int, float]]:
        """(sequence, {fingerprint: until unix time}): the sequence changes with every write, so a
        reader decodes the table again only when it changed."""
        seq = self._quarantine.sequence
        return seq, {int(fp): float(until) for fp, until in self._quarantine.read() or ()}

    @property
    def quarantine_sequence(self) -> int:
        return self._quarantine.sequence

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
            region = StatsRegion(self._buf, self._slot(slot) + L.SLOT_STATS_OFF, S.WORKER_STAT_NAMES)
            self._worker_stats[slot] = region
        return region

    def all_worker_stats(self, slots: Iterable[int] | None = None) -> dict[str, float]:
        """Sum of every worker's stats: what `/metrics` reports for the whole server."""
        total = dict.fromkeys(S.WORKER_STAT_NAMES, 0.0)
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
        step = self.step_record.read()
        snap["requests_in_step"] = len(step.requests) + step.unnamed if step is not None else 0
        snap["quarantined_requests"] = len(self.quarantine()[1])
        snap["gpu_stats"] = self.gpu_stats.read()
        snap["workers"] = [self.worker_slot(i) for i in range(self.n_workers)]
        return snap
