"""Which requests a GPU-process death is blamed on, and whether it counts toward the restart limit
(`docs/design.md#failure-semantics`).

The supervisor feeds every death the requests that were in the step the process was running
(`shm/in_flight.py`): each of them takes a strike, by fingerprint (tenant, prompt and parameters),
so a resubmission under a new rid and a client's resend are the same request. A request struck
twice is quarantined for `quarantine_s`: its worker fails it instead of resubmitting it, with an
explicit error, and any worker refuses a resend with 422 until the quarantine ends.

A death counts toward `--restart-limit` unless it is blamed on someone already suspect:

* nothing was in the step (loading, idle, between steps): it counts, the server itself is suspect;
* a request in the step already had a strike: it does not count (the request is the likelier
  cause, and it is quarantined now, so it cannot do it again);
* a tenant with requests in the step had already been in the step at `TENANT_STRIKES` deaths in
  the last `window_s`: it does not count either, so one tenant's fresh poison requests add at
  most `TENANT_STRIKES` deaths to the count, and cannot push the supervisor to give up on their
  own with a limit above that (the systemd unit passes 5).

What this gives up: a device that fails only under load, and only ever with the same tenant's
requests in the step, is restarted in place for good instead of being handed to systemd; its
deaths with nothing in flight (the reload, the calibration) still count.

Pure bookkeeping: no I/O, an injected clock (`now`, unix seconds), bounded tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ringserve.shm.in_flight import InFlight

STRIKES_TO_QUARANTINE = 2  # deaths a request may be in the step at; at the second it is not run again
TENANT_STRIKES = 2  # deaths a tenant may be in the step at (in window_s) before its next ones stop counting
MAX_SUSPECTS = 512  # fingerprints remembered; the oldest strikes are forgotten first, quarantines last


@dataclass(slots=True)
class Strike:
    count: int
    last: float  # unix time of the last death it was in the step at


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one death means."""

    counts: bool  # toward the restart limit
    struck: tuple[int, ...]  # fingerprints in the step, each struck once more
    quarantined: tuple[int, ...]  # of those, the ones quarantined by this death
    why: str  # for the log


@dataclass
class Suspects:
    quarantine_s: float
    window_s: float  # how long a tenant's deaths are remembered (the restart limit's window)
    strikes: dict[int, Strike] = field(default_factory=dict)  # fingerprint -> its strikes, oldest first
    tenant_deaths: dict[int, list[float]] = field(default_factory=dict)  # tenant tag -> unix times

    def death(self, now: float, in_step: Iterable[InFlight]) -> Verdict:
        """A GPU process died at `now` with `in_step` in its running step (empty: none)."""
        self._forget(now)
        # NOTE: fingerprint 0 is no client's (a worker always sets one): a synthetic step (the
        # start-up calibration) names nobody, and its death counts like any other at start-up.
        requests = [r for r in in_step if r.fingerprint]
        if not requests:
            return Verdict(True, (), (), "nothing was in the step it was running")
        fingerprints = tuple(dict.fromkeys(r.fingerprint for r in requests))
        tenants = set(r.tenant for r in requests)
        known = [fp for fp in fingerprints if fp in self.strikes]
        repeat_tenants = [t for t in tenants if len(self.tenant_deaths.get(t, ())) >= TENANT_STRIKES]
        quarantined = []
        for fp in fingerprints:
            strike = self.strikes.pop(fp, None) or Strike(0, now)
            strike.count += 1
            strike.last = now
            self.strikes[fp] = strike  # re-inserted: the dict stays in order of last strike
            if strike.count == STRIKES_TO_QUARANTINE:
                quarantined.append(fp)
        for tenant in tenants:
            self.tenant_deaths.setdefault(tenant, []).append(now)
        self._bound()
        if known:
            why = f"{len(known)} of the {len(fingerprints)} requests in its step were in the step at an earlier death"
        elif repeat_tenants:
            why = f"a tenant of its step had requests in the step at {TENANT_STRIKES} earlier deaths"
        else:
            why = f"{len(fingerprints)} requests in its step, none suspect before"
        return Verdict(not known and not repeat_tenants, fingerprints, tuple(quarantined), why)

    def quarantine(self, now: float) -> list[tuple[int, float]]:
        """(fingerprint, until) of every request quarantined at `now`: what the workers refuse."""
        return [
            (fp, s.last + self.quarantine_s)
            for fp, s in self.strikes.items()
            if s.count >= STRIKES_TO_QUARANTINE and now < s.last + self.quarantine_s
        ]

    def _forget(self, now: float) -> None:
        for fp in [fp for fp, s in self.strikes.items() if now - s.last >= self.quarantine_s]:
            del self.strikes[fp]
        for tenant in list(self.tenant_deaths):
            kept = [t for t in self.tenant_deaths[tenant] if now - t <= self.window_s]
            if kept:
                self.tenant_deaths[tenant] = kept
            else:
                del self.tenant_deaths[tenant]

    def _bound(self) -> None:
        """At most MAX_SUSPECTS fingerprints: single strikes go first, oldest first."""
        over = len(self.strikes) - MAX_SUSPECTS
        if over <= 0:
            return
        drop = [fp for fp, s in self.strikes.items() if s.count < STRIKES_TO_QUARANTINE][:over]
        drop += list(self.strikes)[: over - len(drop)] if len(drop) < over else []
        for fp in drop:
            self.strikes.pop(fp, None)
        while len(self.tenant_deaths) > MAX_SUSPECTS:
            del self.tenant_deaths[next(iter(self.tenant_deaths))]
