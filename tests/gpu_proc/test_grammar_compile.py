"""The GPU process's grammar compiles (`gpu_proc/grammar_compile.py`): a compile past its deadline
is failed at once and abandoned (its thread replaced, so others keep compiling), a failure is
remembered so a resend costs nothing, compiled grammars in use are never dropped, and unused ones
are kept up to the cap."""

from __future__ import annotations

import time

import pytest

from ringserve.gpu_proc import grammar_compile as gc


class _Slow(gc.GrammarCompiler):
    """Compiles `slow:S` in S seconds, `bad` into an error, anything else at once."""

    def __init__(self, timeout_s: float, **kw) -> None:
        super().__init__(lambda: None, timeout_s, **kw)
        self.compiled: list[str] = []
        self.rings = 0
        self.on_done = self._ring

    def _ring(self) -> None:
        self.rings += 1

    def _compile(self, grammar: str):
        if grammar.startswith("slow:"):
            time.sleep(float(grammar.split(":")[1]))
        self.compiled.append(grammar)
        return (None, "bad grammar") if grammar == "bad" else (object(), None)


def _until(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_compile_past_its_deadline_is_abandoned_and_others_go_on():
    """`slow:3` with a 0.3 s deadline fails at the first poll past it, and its thread is replaced
    then: a grammar queued behind it compiles at once, within its own deadline; the late result
    is discarded."""
    c = _Slow(0.3)
    slow = c.acquire("slow:3")
    time.sleep(0.2)
    quick = c.acquire("quick")  # queued behind the slow one (one compile thread)
    time.sleep(0.15)
    c.poll()
    assert slow.done and slow.error.startswith("timeout") and c.timeouts == 1
    _until(lambda: quick.done, 0.15)  # before its own deadline: not behind the abandoned one
    assert quick.error is None and c.base("quick") is not None
    _until(lambda: "slow:3" in c.compiled, 5.0)
    assert c.base("slow:3") is None and slow.error.startswith("timeout")  # discarded when it ended
    assert c.rings >= 2  # each end rang the loop's doorbell


def test_a_failure_is_remembered_then_forgotten(monkeypatch):
    """A refused grammar sent again is answered from memory (no second compile) until
    FAILED_KEEP_S has passed; then it is compiled again."""
    c = _Slow(5.0)
    first = c.wait("bad")
    assert first.error == "bad grammar"
    c.release("bad")
    again = c.acquire("bad")
    assert again is first and c.compiled == ["bad"]
    c.release("bad")
    monkeypatch.setattr(gc, "FAILED_KEEP_S", 0.0)
    time.sleep(0.01)
    c.poll()
    assert c.find("bad") is None
    c.wait("bad")
    assert c.compiled == ["bad", "bad"]


def test_grammars_in_use_stay_and_unused_ones_are_capped(monkeypatch):
    """Past COMPILED_GRAMMARS unused grammars, the least recently used go; one in use never does."""
    monkeypatch.setattr(gc, "COMPILED_GRAMMARS", 3)
    c = _Slow(5.0)
    c.wait("pinned")  # never released
    for i in range(6):
        c.wait(f"g{i}")
        c.release(f"g{i}")
    c.poll()
    assert c.base("pinned") is not None
    assert [g for g in ("g0", "g1", "g2", "g3", "g4", "g5") if c.find(g)] == ["g3", "g4", "g5"]


def test_abandoned_threads_are_bounded(monkeypatch):
    """Once MAX_ABANDONED threads are busy with abandoned compiles, no more are started: new
    compiles queue and fail at their own deadlines (the process never grows a thread per request)."""
    monkeypatch.setattr(gc, "MAX_ABANDONED", 2)
    c = _Slow(0.1)
    jobs = []
    for i in range(4):  # one at a time, each running when its deadline passes
        jobs.append(c.acquire(f"slow:2.{i}"))
        time.sleep(0.15)
        c.poll()
    assert all(j.done and j.error.startswith("timeout") for j in jobs)
    assert c._alive == 2 and c._abandoned == 2  # the first two ran; the others never started
    _until(lambda: c._abandoned == 0, 10.0)
    assert sorted(c.compiled) == ["slow:2.0", "slow:2.1"]


@pytest.mark.parametrize("threads", [1, 2])
def test_compiles_run_beside_the_caller(threads):
    """acquire() returns at once, however long the compile: the loop never waits for it."""
    c = _Slow(5.0, threads=threads)
    t0 = time.monotonic()
    job = c.acquire("slow:0.3")
    assert time.monotonic() - t0 < 0.05 and not job.done
    _until(lambda: job.done)
    assert job.error is None
