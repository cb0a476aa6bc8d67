"""The worker's grammar processes: structured-output constraints converted and checked in child
processes (`grammar_child.py`), each job under a deadline, never on the event loop.

A constraint's conversion and check can run for seconds (GBNF conversion is quadratic in pure
Python, holding the GIL; 450 patternProperties take 10 s in llguidance) or crash the compiler (a
long enough chain of rules overflows its stack). In a thread they would still starve the loop
(the GIL) or take the worker down; in a child process the loop only waits on a pipe. A job past
`timeout_s` has its process killed and is answered `timeout`; a process that dies mid-job is
answered `crashed`. At most `procs` processes run, started when first needed and replaced after a
kill; a job that finds every one busy for `timeout_s` is answered `busy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.grammar_child import _HEADER, frame

log = logging.getLogger("ringserve.api")

START_TIMEOUT_S = 60.0  # a grammar process loads llguidance and the tokenizer (about a second)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A job's end: `kind` ok (with `grammar`) | refused (with `code`, `message`) | timeout |
    crashed | busy."""

    kind: str
    grammar: str = ""
    code: str = ""
    message: str = ""


class _Child:
    __slots__ = ("proc",)

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def call(self, payload: bytes) -> object:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None:
            raise RuntimeError("a grammar process without its pipes")
        stdin.write(payload)
        await stdin.drain()
        (size,) = _HEADER.unpack(await stdout.readexactly(_HEADER.size))
        return msgspec.msgpack.decode(await stdout.readexactly(size))

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


class GrammarPool:
    """Up to `procs` grammar processes for one worker; `init()` gives the first frame each one
    reads (the tokenizer), computed once, off the loop."""

    def __init__(self, init: Callable[[], Awaitable[bytes]], *, procs: int, timeout_s: float) -> None:
        self._init = init
        self._init_frame: bytes | None = None
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(procs)
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self.started = 0  # processes started (replacements included), for tests and logs
        self.killed = 0

    async def run(self, job: list) -> Outcome:
        """Convert and check one constraint (`grammar_child.py` names the job's fields)."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except TimeoutError:
            return Outcome("busy")
        try:
            child = self._idle.pop() if self._idle else await self._start()
            try:
                answer = await asyncio.wait_for(child.call(frame(job)), self.timeout_s)
            except TimeoutError:
                self.killed += 1
                await self._discard(child)
                return Outcome("timeout")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                await self._discard(child)
                log.warning("a grammar process died on a job (exit %s): %s", child.proc.returncode, exc)
                return Outcome("crashed", message=f"exit status {child.proc.returncode}")
            except BaseException:  # cancelled (the client left): its job may run on, so it goes
                await asyncio.shield(self._discard(child))
                raise
            self._idle.append(child)
        finally:
            self._slots.release()
        if answer[0] == "ok":  # type: ignore[index]
            return Outcome("ok", grammar=answer[1])  # type: ignore[index]
        return Outcome("refused", code=answer[1], message=answer[2])  # type: ignore[index]

    async def _start(self) -> _Child:
        if self._init_frame is None:
            self._init_frame = await self._init()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "ringserve.api.grammar_child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        child = _Child(proc)
        self._all.add(child)
        self.started += 1
        try:
            ready = await asyncio.wait_for(child.call(self._init_frame), START_TIMEOUT_S)
        except BaseException:
            await asyncio.shield(self._discard(child))
            raise
        if ready != ["ready"]:
            await self._discard(child)
            raise RuntimeError(f"a grammar process answered {ready!r} to its start")
        return child

    async def _discard(self, child: _Child) -> None:
        self._all.discard(child)
        await child.kill()

    async def close(self) -> None:
        """Kill every grammar process (the worker is stopping)."""
        children, self._all, self._idle = list(self._all), set(), []
        await asyncio.gather(*(c.kill() for c in children), return_exceptions=True)
