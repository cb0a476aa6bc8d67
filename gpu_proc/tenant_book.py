"""Per-tenant counts for /metrics, bounded in cardinality: the first `slots` tenants seen get a
slot of their own, for as long as the GPU process runs (so each one's counters only grow); every
later tenant counts in the last slot, "other" (MAX_METRICS_TENANTS). Tenants are the workers'
hashes of API keys (`api/auth.py`), never keys. The GPU loop publishes `names` (slot order) in the
control block, where /metrics reads which tenant each slot is."""

from __future__ import annotations

from ringserve.shm.messages import MAX_METRICS_TENANTS

OTHER = MAX_METRICS_TENANTS


class TenantBook:
    def __init__(self, slots: int) -> None:
        self.slots = min(max(slots, 0), MAX_METRICS_TENANTS)
        self.names: list[str] = []
        self._slot: dict[str, int] = {}
        n = MAX_METRICS_TENANTS + 1
        self.requests, self.prompt_tokens, self.generation_tokens = [0] * n, [0] * n, [0] * n

    def slot(self, tenant: str) -> int:
        found = self._slot.get(tenant)
        if found is not None:
            return found
        if len(self.names) >= self.slots:
            return OTHER
        self._slot[tenant] = len(self.names)
        self.names.append(tenant)
        return self._slot[tenant]

    def admitted(self, tenant: str, prompt_tokens: int) -> None:
        i = self.slot(tenant)
        self.requests[i] += 1
        self.prompt_tokens[i] += prompt_tokens

    def generated(self, tenant: str, tokens: int = 1) -> None:
        self.generation_tokens[self.slot(tenant)] += tokens

    def gauges(self, tenants) -> list[int]:
        """Per slot, how many of `tenants` (one per row or request) it holds."""
        out = [0] * (MAX_METRICS_TENANTS + 1)
        for tenant in tenants:
            out[self.slot(tenant)] += 1
        return out
