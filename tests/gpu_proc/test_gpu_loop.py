"""The GPU process end to end over real rings: a real child process, a test worker on the other side."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from ringserve.config import Config
from ringserve.shm import layout as L
from ringserve.shm import messages as M
from ringserve.shm.instance import ShmInstance

TIMEOUT_S = 120


class _Worker:
    """Slot 0's side of the rings, driven synchronously by the test."""

    def __init__(self, shm: ShmInstance) -> None:
        self.shm = shm
        self.req, self.out = shm.worker_rings(0)
        self.messages: list[M.Message] = []

    def send(self, msg) -> None:
        assert self.req.try_push(M.encode(msg))
        self.shm.input_bell.ring()

    def pump(self, until, timeout: float = TIMEOUT_S):
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                stats = self.shm.control.gpu_stats.read()
                raise TimeoutError(f"condition not met; stats {stats}; last {self.messages[-3:]}")
            self.shm.output_bells[0].wait(0.05)
            self.messages += [M.decode(b) for b in self.out.pop_many()]

    def tokens(self, rid: int, index: int = 0) -> list[int]:
        return [
            t.token_id
            for m in self.messages
            if isinstance(m, M.StepOutput)
            for t in m.tokens
            if t.rid == rid and t.index == index
        ]

    def finishes(self, rid: int) -> list[M.Finish]:
        return [f for m in self.messages if isinstance(m, M.StepOutput) for f in m.finishes if f.rid == rid]

    def reply(self, rid: int):
        return next((m for m in self.messages if isinstance(m, (M.Accepted, M.Rejected)) and m.rid == rid), None)


@pytest.fixture
def gpu_process(tiny_model_dir, tmp_path, request):
    """The GPU process on the tiny model (`indirect` parameters: Config overrides)."""
    overrides = getattr(request, "param", {})
    config = Config(num_blocks=64, max_rows=8, prefill_budget=32, context_limit=512, max_tokens_limit=256, **overrides)
    shm = ShmInstance.create(ring_bytes=1 << 20, n_workers=1, directory=str(tmp_path))
    shm.control.bump_gpu_generation()
    shm.control.start_worker_slot(0, os.getpid())
    fds = ",".join(str(fd) for fd in shm.bell_fds())
    env = dict(os.environ, RINGSERVE_CONFIG_JSON=config.to_json())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringserve.gpu_proc.main",
            "--instance",
            shm.instance,
            "--shm-dir",
            str(tmp_path),
            "--bell-fds",
            fds,
            "--model-dir",
            str(tiny_model_dir),
        ],
        env=env,
        pass_fds=shm.bell_fds(),
    )
    deadline = time.monotonic() + TIMEOUT_S
    while shm.control.gpu_state != L.GpuState.READY:
        assert proc.poll() is None, f"GPU process exited with {proc.returncode}"
        assert time.monotonic() < deadline, "GPU process not ready in time"
        time.sleep(0.05)
    yield shm, proc
    proc.kill()
    proc.wait()
    shm.unlink()
    shm.close()


def _submit(rid, prompt, max_tokens=8, tenant="t", **sampling):
    sampling.setdefault("temperature", 0.0)
    now = time.time()
    return M.Submit(
        rid=rid,
        request_id=f"req-{rid}",
        tenant=tenant,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=M.SamplingParams(ignore_eos=True, **sampling),
        arrival_ts=now,
        deadline_ts=now + 60,
    )


def test_submit_streams_tokens_and_finishes(gpu_process):
    """A Submit is accepted, streams max_tokens tokens, finishes with `length` and usage."""
    shm, _ = gpu_process
    w = _Worker(shm)
    w.send(_submit(1, [5, 6, 7, 8, 9], max_tokens=6))
    w.pump(lambda: w.finishes(1))
    assert isinstance(w.reply(1), M.Accepted)
    assert len(w.tokens(1)) == 6
    (fin,) = w.finishes(1)
    assert (fin.reason, fin.prompt_tokens, fin.completion_tokens) == ("length", 5, 6)
    w.pump(lambda: shm.control.gpu_stats.read()["kv_blocks_free"] == 64)


def test_batched_requests_match_solo(gpu_process):
    """Greedy tokens of requests run together equal each request run alone."""
    shm, _ = gpu_process
    w = _Worker(shm)
    prompts = [[3 + i] * (4 + 9 * i) for i in range(5)]
    solo = []
    for i, p in enumerate(prompts):
        w.send(_submit(100 + i, p))
        w.pump(lambda rid=100 + i: w.finishes(rid))
        solo.append(w.tokens(100 + i))
    for i, p in enumerate(prompts):
        w.send(_submit(200 + i, p))
    w.pump(lambda: all(w.finishes(200 + i) for i in range(len(prompts))))
    assert [w.tokens(200 + i) for i in range(len(prompts))] == solo


def test_over_context_limit_is_400_and_cancel_frees_blocks(gpu_process):
    """Prompt + max_tokens over the context limit is refused with 400; a cancel ends a stream early."""
    shm, _ = gpu_process
    w = _Worker(shm)
    w.send(_submit(1, [5] * 400, max_tokens=200))
    w.pump(lambda: w.reply(1))
    assert isinstance(w.reply(1), M.Rejected) and w.reply(1).status == 400
    w.send(_submit(2, [5, 6, 7], max_tokens=200))
    w.pump(lambda: len(w.tokens(2)) >= 2)
    w.send(M.Cancel(rid=2))
    w.pump(lambda: w.finishes(2))
    assert w.finishes(2)[0].reason == "cancelled"
    assert len(w.tokens(2)) < 200
    w.pump(lambda: shm.control.gpu_stats.read()["kv_blocks_free"] == 64)


def test_bad_token_id_is_400(gpu_process):
    """A prompt token outside the vocabulary is refused, and the process keeps serving."""
    shm, proc = gpu_process
    w = _Worker(shm)
    w.send(_submit(1, [10**9]))
    w.pump(lambda: w.reply(1))
    assert w.reply(1).status == 400 and "vocabulary" in w.reply(1).message
    w.send(_submit(2, [5, 6]))
    w.pump(lambda: w.finishes(2))
    assert proc.poll() is None


def test_repetition_penalty_outside_its_range_is_refused(gpu_process):
    """A repetition_penalty far from 1 overflowed the penalized logits into a NaN distribution that
    crashed top-p sampling (1e-40: two GPU-process restarts from one request); the GPU process
    refuses it (400) whatever the worker let through, and keeps serving."""
    shm, proc = gpu_process
    w = _Worker(shm)
    for rid, penalty in ((1, 1e-40), (2, 1e300), (3, math.nan)):
        w.send(_submit(rid, [5, 6, 5], temperature=1.0, top_p=0.5, repetition_penalty=penalty))
        w.pump(lambda rid=rid: w.reply(rid))
        assert w.reply(rid).status == 400 and "repetition_penalty" in w.reply(rid).message
    w.send(_submit(4, [5, 6, 5], temperature=1.0, top_p=0.5, repetition_penalty=0.01))
    w.pump(lambda: w.finishes(4))
    assert proc.poll() is None


def test_stop_token_ids_over_the_cap_are_refused(gpu_process):
    """A Submit with more than MAX_STOP_TOKEN_IDS stop ids is refused (400) by the GPU process
    itself, whatever the worker let through; one at the cap runs and stops on its stop id."""
    shm, proc = gpu_process
    w = _Worker(shm)
    w.send(_submit(1, [5, 6], stop_token_ids=tuple(range(M.MAX_STOP_TOKEN_IDS + 1))))
    w.pump(lambda: w.reply(1))
    assert w.reply(1).status == 400 and "stop_token_ids" in w.reply(1).message
    w.send(_submit(2, [5, 6, 7], max_tokens=20))
    w.pump(lambda: w.finishes(2))
    first = w.tokens(2)[0]
    ids = tuple(range(10_000, 10_000 + M.MAX_STOP_TOKEN_IDS - 1)) + (first,)
    w.send(_submit(3, [5, 6, 7], max_tokens=20, stop_token_ids=ids))
    w.pump(lambda: w.finishes(3))
    assert w.finishes(3)[0].reason == "stop" and w.tokens(3) == [first]
    assert proc.poll() is None


def test_restarted_worker_keeps_its_own_requests_and_loses_its_predecessors(gpu_process):
    """A worker restarted in a slot numbers its requests from its own slot generation: when the GPU
    process sees the new generation it cancels the dead worker's request (its blocks come back)
    but not the one the successor already sent, which streams to the end."""
    shm, _ = gpu_process
    old_gen = shm.control.worker_slot(0)["generation"]
    w = _Worker(shm)
    dead = M.first_rid(old_gen)
    w.send(_submit(dead, [5, 6, 7], max_tokens=200))
    w.pump(lambda: w.tokens(dead))
    new_gen = shm.control.start_worker_slot(0, os.getpid())
    successor = _Worker(shm)
    mine = M.first_rid(new_gen)
    successor.send(_submit(mine, [1, 2, 3], max_tokens=8))
    successor.pump(lambda: successor.finishes(mine))
    assert [f.reason for f in successor.finishes(mine)] == ["length"]
    assert len(successor.tokens(mine)) == 8
    # Output pushed for the dead request before the GPU process saw the new generation may still
    # reach the successor, but under a rid it never made (its client drops such records).
    others = {t.rid for m in successor.messages if isinstance(m, M.StepOutput) for t in m.tokens} - {mine}
    assert others <= {dead} and M.rid_generation(dead) != new_gen
    successor.pump(lambda: shm.control.gpu_stats.read()["kv_blocks_free"] == 64)


# A loaded box slows the steps and so raises the cost model's price of the 400-token prompt: past
# the default 2 s queue limit the short request behind it was refused 429 and never ran.
@pytest.mark.parametrize("gpu_process", [{"queue_limit_s": 60.0}], indirect=True)
def test_step_in_flight_names_the_running_step_and_is_cleared_after(gpu_process):
    """While a step runs, the control block names its requests (slot, rid, fingerprint) under this
    process's generation: what the supervisor reads after a death. Between steps and once idle,
    nothing is in flight."""
    shm, proc = gpu_process
    w = _Worker(shm)
    w.send(msgspec.structs.replace(_submit(1, [5 + i % 300 for i in range(400)], max_tokens=100), fingerprint=0xFEED))
    w.send(msgspec.structs.replace(_submit(2, [7, 8, 9], max_tokens=100), fingerprint=0xBEEF))
    seen: set[tuple[int, int, int]] = set()
    deadline = time.monotonic() + TIMEOUT_S
    while len(seen) < 2 and time.monotonic() < deadline:
        w.messages += [M.decode(b) for b in w.out.pop_many()]
        assert not any(isinstance(w.reply(rid), M.Rejected) for rid in (1, 2)), w.messages[:2]
        os.kill(proc.pid, signal.SIGSTOP)  # a step frozen mid-flight, as a death would leave it
        try:
            record = shm.control.step_record.read()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        if record is not None and record.requests:
            assert record.generation == shm.control.gpu_generation
            seen |= {(r.slot, r.rid, r.fingerprint) for r in record.requests}
        time.sleep(0.003)
    assert seen == {(0, 1, 0xFEED), (0, 2, 0xBEEF)}
    w.pump(lambda: w.finishes(1) and w.finishes(2))
    w.pump(lambda: shm.control.gpu_stats.read()["running_rows"] == 0)
    time.sleep(0.3)
    assert shm.control.step_record.read().requests == ()


def _pattern_grammar(n: int) -> str:
    """The issue's schema (n patternProperties `^xI[a-z]+$` -> integer) in serialized form, as a
    worker would submit it (450: ~10 s to compile on this machine)."""
    import llguidance

    from tests.helpers.grammars import pattern_schema

    return llguidance.LLMatcher.grammar_from_json_schema(pattern_schema(n), defaults={"whitespace_flexible": False})


def test_a_grammar_over_the_caps_is_refused_before_it_compiles(gpu_process):
    """Whatever a worker let through, the GPU process measures a grammar before compiling it:
    the 450-pattern schema is a 400 naming --grammar-max-patterns, at once."""
    shm, proc = gpu_process
    w = _Worker(shm)
    t0 = time.monotonic()
    w.send(_submit(1, [5, 6], grammar=_pattern_grammar(450)))
    w.pump(lambda: w.reply(1))
    reply = w.reply(1)
    assert isinstance(reply, M.Rejected) and (reply.status, reply.code) == (400, "grammar_too_complex")
    assert "--grammar-max-patterns" in reply.message and time.monotonic() - t0 < 1.0
    w.send(_submit(2, [5, 6]))
    w.pump(lambda: w.finishes(2))
    assert proc.poll() is None


@pytest.mark.parametrize("gpu_process", [{"grammar_max_patterns": 100_000, "grammar_timeout_s": 0.5}], indirect=True)
def test_a_compile_past_its_deadline_holds_no_step_and_is_refused(gpu_process):
    """The 450-pattern schema past the caps (raised here) compiles for seconds: it waits outside
    the scheduler and is refused 400 grammar_too_complex at its deadline (2 x 0.5 s), while
    another tenant's requests stream at their usual pace, the heartbeat beats, the process lives;
    a resend is refused at once."""
    shm, proc = gpu_process
    w = _Worker(shm)
    control = shm.control
    w.send(_submit(1, [5, 6], max_tokens=4, tenant="a", grammar=_pattern_grammar(450), temperature=1.0))
    t0 = time.monotonic()
    w.send(_submit(2, [7, 8, 9], max_tokens=200, tenant="b"))
    arrivals: list[float] = []
    ages: list[float] = []

    def progressed() -> bool:
        n = len(w.tokens(2))
        while len(arrivals) < n:
            arrivals.append(time.monotonic())
        ages.append(control.gpu_heartbeat_age_s() or 0.0)
        return bool(w.reply(1)) and bool(w.finishes(2))

    w.pump(progressed, timeout=30)
    refused = w.reply(1)
    assert isinstance(refused, M.Rejected) and (refused.status, refused.code) == (400, "grammar_too_complex")
    assert "did not compile within 1 s" in refused.message
    gaps = [b - a for a, b in zip([t0, *arrivals], arrivals)]
    assert len(w.tokens(2)) == 200 and max(gaps) < 1.0, max(gaps)
    assert max(ages) < 1.0, max(ages)
    assert w.finishes(1) == [] and proc.poll() is None
    t1 = time.monotonic()
    w.send(_submit(3, [5, 6], max_tokens=4, tenant="a", grammar=_pattern_grammar(450)))
    w.pump(lambda: w.reply(3))
    assert w.reply(3).code == "grammar_too_complex" and time.monotonic() - t1 < 0.5
