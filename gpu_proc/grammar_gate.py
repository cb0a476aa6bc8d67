"""Submits whose grammar is still compiling wait here, outside the scheduler, so that a compile
never holds the GPU loop and a constrained request never joins a step without its matcher.

The loop hands every constrained Submit to `hold` after its other checks: one over the grammar
caps (`rules.compiled_grammar_error`: the worker's, checked again on the serialized grammar) is
refused at once; one whose grammar is compiled goes straight on to admission; the others wait
for `GrammarCompiler` (started by `hold`). Each pass, `poll()` gives back those whose compile
ended: compiled (to admit) or failed (to refuse with 400 `grammar_too_complex`, or
`unsupported_value` for a grammar llguidance refuses, naming why). While a Submit waits it is
not admission's work yet: it is not charged, and a Cancel or a worker restart drops it here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ringserve.gpu_proc.grammar_compile import GPU_TIMEOUT_FACTOR, GrammarCompiler
from ringserve.rules import GRAMMAR_TOO_COMPLEX, GrammarLimits, compiled_grammar_error, grammar_timeout_error
from ringserve.shm import messages as M


@dataclass(slots=True)
class Held:
    slot: int
    msg: M.Submit
    request: object  # the Request built from it, admitted once its grammar is compiled
    since: float = field(default_factory=time.time)  # held from (its timeline's "grammar" event)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a held Submit cannot be served: its 400's code and message."""

    code: str
    message: str


class GrammarGate:
    """The constrained Submits waiting for their grammar (module docstring)."""

    def __init__(self, compiler: GrammarCompiler, limits: GrammarLimits) -> None:
        self.compiler = compiler
        self.limits = limits
        self._held: dict[tuple[int, int], Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, slot: int, msg: M.Submit, request) -> Refusal | bool:
        """A Refusal (answer it now), True (held: `poll` will give it back) or False (its grammar
        is compiled: admit it now). The grammar is pinned (`release` when the Submit is done)."""
        grammar = msg.sampling.grammar
        if grammar is None:
            return False
        if self.compiler.find(grammar) is None:  # NOTE: measured once, before its first compile
            found = compiled_grammar_error(grammar, self.limits)
            if found is not None:
                return Refusal(GRAMMAR_TOO_COMPLEX, found)
        job = self.compiler.acquire(grammar)
        if not job.done:
            self._held[(slot, msg.rid)] = Held(slot, msg, request)
            return True
        if job.error is not None:
            self.compiler.release(grammar)
            return self._refusal(job.error)
        return False

    def poll(self) -> list[tuple[Held, Refusal | None]]:
        """The held Submits whose compile ended, each with its Refusal (None: admit it)."""
        self.compiler.poll()
        if not self._held:
            return []
        out: list[tuple[Held, Refusal | None]] = []
        for key, held in list(self._held.items()):
            job = self.compiler.find(held.msg.sampling.grammar or "")
            if job is not None and not job.done:
                continue
            del self._held[key]
            held.request.mark("grammar", held.since, time.time())  # type: ignore[attr-defined]
            error = "its compile was forgotten" if job is None else job.error  # NOTE: not reached: held pins it
            refusal = None if error is None else self._refusal(error)
            if refusal is not None:
                self.release(held.msg)
            out.append((held, refusal))
        return out

    def release(self, msg: M.Submit) -> None:
        """A Submit that held its grammar is done (refused, or every sample finished)."""
        if msg.sampling.grammar is not None:
            self.compiler.release(msg.sampling.grammar)

    def drop(self, slot: int, rid: int | None = None, keep_generation: int | None = None) -> int:
        """Forget held Submits: one (`rid`), or a worker slot's (all, or those not numbered by
        the worker of generation `keep_generation`); how many."""
        gone = [
            key
            for key in self._held
            if key[0] == slot
            and (rid is None or key[1] == rid)
            and (keep_generation is None or M.rid_generation(key[1]) != keep_generation)
        ]
        for key in gone:
            self.release(self._held.pop(key).msg)
        return len(gone)

    def _refusal(self, error: str) -> Refusal:
        if error.startswith("timeout"):
            what = "the structured-output grammar"
            flag = f"{GPU_TIMEOUT_FACTOR:g} x --grammar-timeout-s"
            return Refusal(GRAMMAR_TOO_COMPLEX, grammar_timeout_error(what, self.compiler.timeout_s, flag))
        return Refusal("unsupported_value", f"the structured-output grammar cannot be enforced: {error}")
