"""Nothing of a grammar holds a step (issue 32): a row whose matcher is not ready is paused (it
emits nothing, its last token is computed again next step) while the step goes on for the other
rows; a pause changes no token; a late mask costs its row a step, never a livelock; the block a
paused row had completed is not served from the prefix cache before it is written again."""

from __future__ import annotations

import time

import llguidance
import pytest

from ringserve.config import Config
from ringserve.gpu_proc import grammar as grammar_mod
from ringserve.gpu_proc import grammar_compile
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import SamplingParams

WORDS = llguidance.LLMatcher.grammar_from_regex(r"[a-z]+( [a-z]+){12,20}\.")


@pytest.fixture
def engine(tiny_model_dir):
    config = Config(num_blocks=64, max_rows=8, prefill_budget=64, context_limit=512)
    eng = build_executor(config, tiny_model_dir)
    yield config, eng
    eng.grammar.close()


def _request(i: int, prompt: list[int], sp: SamplingParams, max_tokens: int = 30) -> Request:
    return Request(
        key=(0, i),
        request_id=str(i),
        tenant="t",
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=sp,
        arrival_ts=0.0,
        deadline_ts=1e9,
    )


def _run(config, eng, requests, *, wait_compiled=True, before_step=None, max_steps=3000):
    """Serve `requests` (admitted at the step their index says: {step: [Request]}) to the end;
    (tokens per rid, each step's seconds, tokens each step gave each rid)."""
    sched = Scheduler(config, BlockManager(64, config.block_size), eos_token_ids=eng.eos_token_ids, clock=lambda: 0.0)
    tokens: dict[int, list[int]] = {}
    per_step: list[dict[int, int]] = []
    times: list[float] = []
    for step in range(max_steps):
        for req in requests.pop(step, []):
            if wait_compiled and req.sampling.grammar is not None:
                eng.grammar.compiler.wait(req.sampling.grammar)
            elif req.sampling.grammar is not None:
                eng.grammar.compiler.acquire(req.sampling.grammar)  # compiling while it runs
            assert sched.admit(req).accepted
        if not sched.has_work and not requests:
            break
        if before_step is not None:
            before_step(step, eng)
        t0 = time.perf_counter()
        batch = sched.schedule()
        samples = eng.step(batch) if batch.seqs else None
        events = sched.update(samples)
        times.append(time.perf_counter() - t0)
        got: dict[int, int] = {}
        for _, ev in events:
            if hasattr(ev, "token_id"):
                tokens.setdefault(ev.rid, []).append(ev.token_id)
                got[ev.rid] = got.get(ev.rid, 0) + 1
        per_step.append(got)
        sched.check_integrity()
    assert not sched.has_work
    return tokens, times, per_step


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * k + salt) % 200 + 3 for k in range(n)]


def test_a_row_whose_matcher_is_rebuilt_is_paused_not_the_step(engine, monkeypatch):
    """Matchers dropped mid-answer are rebuilt beside the steps (slowed to 0.3 s here): the
    constrained row is paused meanwhile while its neighbour gets a token every step, no step
    waits for the rebuild, and the tokens are those of a run that kept its matchers."""
    config, eng = engine
    target = SamplingParams(temperature=0.9, seed=77, grammar=WORDS)
    plain = SamplingParams(temperature=1.0, seed=3, ignore_eos=True)

    def reqs():
        return {0: [_request(0, _prompt(20), target, 40), _request(1, _prompt(24, 1), plain, 40)]}

    kept, _, _ = _run(config, eng, reqs())
    monkeypatch.setattr(grammar_mod, "INLINE_CATCHUP", 2)
    slow_replay = grammar_mod._replay

    def replay(base, output):
        time.sleep(0.3)
        return slow_replay(base, output)

    monkeypatch.setattr(grammar_mod, "_replay", replay)

    def drop(step, eng):
        if step == 8:
            eng.grammar._pool.submit(eng.grammar.seqs.clear).result()

    pauses = eng.grammar.pauses
    dropped, times, per_step = _run(config, eng, reqs(), before_step=drop)
    assert dropped == kept and len(kept[0]) > 12
    assert eng.grammar.pauses - pauses >= 2  # the rebuild took several steps
    paused_steps = [s for s in per_step if 0 not in s and 1 in s]
    assert len(paused_steps) >= 2 and max(times) < 0.25, (len(paused_steps), max(times))


def test_a_late_mask_pauses_its_row_and_serves_the_next_step(engine, monkeypatch):
    """Masks filled later than the step waits (no wait at all here, a slowed fill): their rows
    are paused, the late masks serve the next step, and every answer still ends, unchanged."""
    config, eng = engine
    rows = {0: [_request(i, _prompt(12, i), SamplingParams(temperature=1.0, seed=i, grammar=WORDS)) for i in range(3)]}
    kept, _, _ = _run(config, eng, {0: list(rows[0])})
    fill = grammar_mod.GrammarState._fill

    def slow_fill(self, jobs):
        time.sleep(0.02)
        return fill(self, jobs)

    monkeypatch.setattr(grammar_mod.GrammarState, "_fill", slow_fill)
    monkeypatch.setattr(grammar_mod, "MASK_WAIT_S", 0.0)
    pauses = eng.grammar.pauses
    late, _, per_step = _run(config, eng, {0: [_request(i, _prompt(12, i), r.sampling) for i, r in enumerate(rows[0])]})
    assert late == kept
    assert eng.grammar.pauses > pauses
    assert any(not s for s in per_step)  # a step whose every row was paused


def test_a_paused_rows_completed_block_is_not_served_before_it_is_written_again(engine, monkeypatch):
    """A constrained request paused at its prompt's last token (its grammar still compiling) had
    completed a KV block; a request sharing that prefix, joining next, must not be handed it (it
    is written again): the integrity check after every step holds, and both answers are right."""
    config, eng = engine
    compile_ = grammar_compile.GrammarCompiler._compile

    def slow_compile(self, grammar):
        time.sleep(0.3)
        return compile_(self, grammar)

    monkeypatch.setattr(grammar_compile.GrammarCompiler, "_compile", slow_compile)
    shared = _prompt(32)  # two full blocks: the paused row's last token completes the second
    target = SamplingParams(temperature=0.9, seed=5, grammar=llguidance.LLMatcher.grammar_from_regex("[a-z]{4,9}"))
    plain = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = {0: [_request(0, shared, target, 12)], 1: [_request(1, shared + _prompt(16, 9), plain, 6)]}
    tokens, _, per_step = _run(config, eng, reqs, wait_compiled=False)
    assert 0 not in per_step[0]  # paused: its grammar was not compiled yet
    alone, _, _ = _run(config, eng, {0: [_request(1, shared + _prompt(16, 9), plain, 6)]})
    assert tokens[1] == alone[1] and len(tokens[0]) >= 2 and tokens[0][-1] in eng.eos_token_ids
