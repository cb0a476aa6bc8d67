"""What an API worker knows about the GPU process besides its rings, behind one interface.

A supervised worker reads it from the control block (`ControlStatus`); a worker on the in-process
fake GPU (tests, `--fake`, benchmarks) from the fake (`api/fake_gpu.py`'s `FakeStatus`). Handlers
only ever see `GpuStatus`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ringserve.api.metrics import StatsSnapshot, from_control
from ringserve.api.refusals import Refusals
from ringserve.shm.seqlock import TornReadError

if TYPE_CHECKING:
    from ringserve.api.worker_stats import WorkerStats
    from ringserve.shm.control import Control, LoraEntry

log = logging.getLogger("ringserve.api")

# Retry-After while the GPU process is not ready, when its load time is not known yet.
DEFAULT_RELOAD_S = 5.0


class GpuStatus(Protocol):
    def ready(self) -> bool:
        """The GPU process serves (503 `gpu_not_ready` otherwise)."""
        ...

    def snapshot(self, own: WorkerStats) -> StatsSnapshot:
        """The server-wide stats /metrics renders (`own`: this worker's live counters)."""
        ...

    def reload_s(self) -> float:
        """Seconds the GPU process takes to (re)load, for Retry-After while it is not ready."""
        ...

    def restart_status(self) -> dict | None:
        """The supervisor's restart status: last GPU error, next attempt (None: none)."""
        ...

    def eos_token_ids(self) -> frozenset[int]:
        """The model's EOS ids as the GPU process published them (empty until it has)."""
        ...

    def health(self) -> dict:
        """What /health adds to "ok": the attention backend and its kernel check, how the weights
        are served (`weights`: quantization, formats, dtype, bytes) and the KV cache's dtype."""
        ...

    def publish(self, own: WorkerStats) -> None:
        """Copy this worker's stats where the others read them, and beat its heartbeat."""
        ...

    def refused_retry_after(self, tenant: str) -> int | None:
        """Retry-After seconds when the GPU process would refuse `tenant`'s next request whatever
        it asks (`api/refusals.py`), else None."""
        ...

    def note_price(self, tenant: str, est_ms: float) -> None:
        """The GPU process priced a request of `tenant` (what `refused_retry_after` weighs)."""
        ...

    def quarantined(self) -> Mapping[int, float]:
        """The supervisor's quarantined requests: {fingerprint: until, unix time}."""
        ...

    def fingerprint_key(self) -> bytes:
        """The key request fingerprints are hashed with (`shm.messages.fingerprint`)."""
        ...

    def loras(self) -> tuple[LoraEntry, ...]:
        """The LoRA adapters the GPU process serves now."""
        ...

    def tenants(self) -> tuple[str, ...]:
        """The tenants (hashes) with their own metrics slot, in slot order."""
        ...


class ControlStatus:
    """`GpuStatus` from a supervised server's control block (worker `slot`)."""

    def __init__(self, control: Control, slot: int, started_at: float) -> None:
        self.control = control
        self.slot = slot
        self.started_at = started_at
        self._region = control.worker_stats(slot)
        self._eos: frozenset[int] | None = None
        self._refusals = Refusals(lambda: control.refusals_sequence, lambda: control.refusals())
        self._quarantine: tuple[int, dict[int, float]] = (-1, {})

    def ready(self) -> bool:
        from ringserve.shm import layout as L

        return self.control.gpu_state == L.GpuState.READY

    def snapshot(self, own: WorkerStats) -> StatsSnapshot:
        return from_control(self.control, self.started_at)

    def reload_s(self) -> float:
        try:
            value = (self.control.model_facts() or {}).get("load_s")
        except Exception:  # a torn or missing control-block read must not turn a 503 into a 500
            value = None
        return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_RELOAD_S

    def restart_status(self) -> dict | None:
        return self.control.restart_status()

    def eos_token_ids(self) -> frozenset[int]:
        if self._eos is None:  # read once the GPU process has published its facts
            facts = self.control.model_facts()
            if not facts:
                return frozenset()
            self._eos = frozenset(facts.get("eos_token_ids", ()))
        return self._eos

    def health(self) -> dict:
        facts = self.control.model_facts() or {}
        return {
            "attention": facts.get("attention"),
            "weights": facts.get("weights"),
            "kv_cache_dtype": facts.get("kv_cache_dtype"),
        }

    def publish(self, own: WorkerStats) -> None:
        own.publish(self._region)
        self.control.worker_heartbeat(self.slot)

    def refused_retry_after(self, tenant: str) -> int | None:
        return self._refusals.retry_after(tenant)

    def note_price(self, tenant: str, est_ms: float) -> None:
        self._refusals.note_price(tenant, est_ms)

    def quarantined(self) -> Mapping[int, float]:
        # NOTE: read on every Submit, decoded only when the supervisor wrote a new one
        if self.control.quarantine_sequence != self._quarantine[0]:
            self._quarantine = self.control.quarantine()
        return self._quarantine[1]

    def fingerprint_key(self) -> bytes:
        return self.control.fingerprint_key

    def loras(self) -> tuple[LoraEntry, ...]:
        # NOTE: read per request naming another model than the base, decoded only when it changed
        try:
            return self.control.loras()
        except (TornReadError, OSError) as exc:  # a writer stuck mid-write: no adapter for now
            log.warning("could not read the LoRA adapter table: %s", exc)
            return ()

    def tenants(self) -> tuple[str, ...]:
        try:
            return self.control.tenants()
        except (TornReadError, OSError):  # mid-write: every tenant reads as "other" for this scrape
            return ()
