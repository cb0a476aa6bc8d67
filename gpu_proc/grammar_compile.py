"""Structured output's compiles in the GPU process: each grammar text compiled once into a matcher,
in background threads, each within a deadline, never in the loop or the mask filler's thread.

A compile is abandoned, not waited for: llguidance builds a grammar with the GIL released and
cannot be interrupted, so a compile past its deadline (`timeout_s` from its request's arrival,
queueing included) is marked failed at once, its request refused, and its thread left to finish
and discard the result; a replacement thread keeps the others compiling, up to `MAX_ABANDONED`
threads still busy with abandoned work (beyond that new compiles queue until one returns, and
fail at their own deadlines). A failed grammar is remembered for `FAILED_KEEP_S`, so a resend is
refused at once rather than compiled again.

A compiled grammar is pinned while requests use it (`acquire` / `release`): a running sequence's
matcher is always copied from a base that is there. Unused ones are kept, most recently used
first, up to `COMPILED_GRAMMARS`. The loop calls `poll()` once a pass (deadlines, expiry);
`on_done` (the loop's doorbell) is rung when a compile ends, so a waiting request is admitted at
once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("ringserve.gpu")

# The worker has already converted and checked the grammar within --grammar-timeout-s; its
# matcher build here, beside the model, gets this many times that before its request is refused.
GPU_TIMEOUT_FACTOR = 2.0
COMPILED_GRAMMARS = 128  # unused compiled grammars kept (a sequence keeps its own copy regardless)
MAX_ABANDONED = 4  # threads left finishing compiles past their deadline before none is replaced
FAILED_KEEP_S = 60.0  # a failed grammar's answer is remembered this long (a resend is refused at once)


@dataclass(slots=True, eq=False)
class Compiled:
    """One grammar text's compile: pending until `done`, then `matcher` or `error`."""

    grammar: str
    deadline: float  # clock time by which it must be done
    matcher: llguidance.LLMatcher | None = None
    error: str | None = None
    done: bool = False
    running: bool = False
    users: int = 0  # Submits waiting for it or running with it
    ended_at: float = 0.0


class GrammarCompiler:
    """The GPU process's grammar compiles (module docstring). `tokenizer()` returns the model's
    `LLTokenizer` (it may block while the tokenizer is built: it is called in the compile threads)."""

    def __init__(
        self,
        tokenizer: Callable[[], llguidance.LLTokenizer],
        timeout_s: float,
        *,
        threads: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.threads = threads
        self.clock = clock
        self.on_done: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: deque[Compiled] = deque()
        self._known: OrderedDict[str, Compiled] = OrderedDict()
        self._alive = 0  # compile threads running (abandoned ones included)
        self._abandoned = 0  # of those, busy with a compile past its deadline
        self._closed = False
        self.timeouts = 0

    # -- the loop's side -------------------------------------------------------------------------

    def acquire(self, grammar: str) -> Compiled:
        """`grammar`'s compile, started if it is new (or its failure has expired), pinned for one
        more user until `release`."""
        with self._lock:
            job = self._known.get(grammar)
            if job is None:
                job = self._known[grammar] = Compiled(grammar, self.clock() + self.timeout_s)
                self._queue.append(job)
                self._spawn()
                self._work.notify()
            else:
                self._known.move_to_end(grammar)
            job.users += 1
            return job

    def release(self, grammar: str) -> None:
        """One user of `grammar` is gone."""
        with self._lock:
            job = self._known.get(grammar)
            if job is not None and job.users > 0:
                job.users -= 1

    def poll(self) -> None:
        """Fail compiles past their deadline; forget unused failures past `FAILED_KEEP_S` and
        unused compiled grammars beyond `COMPILED_GRAMMARS`."""
        now = self.clock()
        with self._lock:
            stale: list[str] = []
            idle = 0
            for grammar, job in self._known.items():
                if not job.done and now > job.deadline:
                    self._end(job, f"timeout after {self.timeout_s:g} s", now)
                    self.timeouts += 1
                    if job.running:
                        self._abandoned += 1
                        self._spawn()
                elif job.done and not job.users:
                    if job.error is not None:
                        if now - job.ended_at > FAILED_KEEP_S:
                            stale.append(grammar)
                    else:
                        idle += 1
            for grammar in stale:
                del self._known[grammar]
            if idle > COMPILED_GRAMMARS:
                unused = [g for g, j in self._known.items() if j.done and not j.users and j.error is None]
                for grammar in unused[: idle - COMPILED_GRAMMARS]:  # NOTE: oldest use first
                    del self._known[grammar]

    def wait(self, grammar: str) -> Compiled:
        """`acquire` and block until the compile ends (or its deadline passes): for drivers without
        a loop (benchmarks, tests), which step only compiled grammars."""
        job = self.acquire(grammar)
        while not job.done:
            time.sleep(0.001)
            self.poll()
        return job

    def find(self, grammar: str) -> Compiled | None:
        return self._known.get(grammar)

    def base(self, grammar: str) -> llguidance.LLMatcher | None:
        """The compiled matcher of `grammar` (to copy; never to advance), None if not compiled."""
        job = self._known.get(grammar)
        return job.matcher if job is not None and job.done else None

    @property
    def pending(self) -> int:
        return sum(1 for j in self._known.values() if not j.done)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._work.notify_all()

    # -- the compile threads ---------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start a thread if fewer than `threads` are free to compile (lock held)."""
        if self._alive - self._abandoned < self.threads and self._abandoned < MAX_ABANDONED:
            self._alive += 1
            threading.Thread(target=self._run, name="grammar-compile", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._work.wait()
                if self._closed:
                    self._alive -= 1
                    return
                job = self._queue.popleft()
                if job.done:  # failed at its deadline while queued
                    continue
                job.running = True
            matcher, error = self._compile(job.grammar)
            with self._lock:
                job.running = False
                late = job.done
                if late:  # its deadline passed: the request was refused; this thread was replaced
                    self._abandoned -= 1
                else:
                    job.matcher = matcher
                    self._end(job, error, self.clock())
                excess = self._alive - self._abandoned > self.threads
                if excess:
                    self._alive -= 1
            if late:
                log.warning("a grammar compile ended after its deadline; its result is discarded")
            if excess:
                return

    def _compile(self, grammar: str) -> tuple[llguidance.LLMatcher | None, str | None]:
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        except Exception as exc:  # no tokenizer, or llguidance refusing its arguments
            return None, f"{type(exc).__name__}: {exc}"
        if matcher.is_error():
            return None, matcher.get_error().strip().splitlines()[0]
        return matcher, None

    def _end(self, job: Compiled, error: str | None, now: float) -> None:
        job.error = error
        job.done = True
        job.ended_at = now
        if self.on_done is not None:
            self.on_done()
