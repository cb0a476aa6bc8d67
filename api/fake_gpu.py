"""An in-process stand-in for the GPU process, speaking the ring protocol through `Transport`.

It admits every Submit (unless `admit` says otherwise), then runs "steps" on the event loop: each
step emits one token for every running sample and finishes samples at `max_tokens` (`length`), at
a stop token id (`stop`), at the context limit, or on Cancel (`cancelled`, or `stop` for a stop
string), with usage and timing like the real engine: the finish rule is the GPU process's own
(`ringserve.rules.finish_reason`). It is a double of the protocol, not of the scheduler: it admits
at once (no queue, no deadlines, no 429 unless `admit` says so) and prices nothing; the tests of
those run against the real GPU process on the tiny model.
The tokens a sample produces come from `script(submit, index)`, by default the prompt ids repeated
in order, so a test knows exactly which text must come out. A Submit asking for prompt logprobs
gets them in its first step: every prompt token from 1 on at -1.0, rank 1, and itself as its one
alternative; a pooling Submit (an embedding) gets its `Pooled` record there too: the sum of its pooled
positions' made-up hidden states (`fake_hidden`). The one GPU stand-in: `FakeEngine` holds those
rules; `FakeGpu` drives it on the worker's event loop for the API tests and `ringserve bench api
--inproc` (where `step_interval_s=0` makes it a producer that never waits), and the bench producer
(`tools/bench/producer.py`) drives it from its own process over a real shared-memory ring.

`restart()` simulates a GPU-process death and the supervisor's fence: the fingerprints it is given
are quarantined, rows are dropped, the worker is told (the generation-change Error the ring
transport delivers), and until `come_back()` the fake
is not ready and silently discards every Submit, as a new GPU process adopting its rings with
discard=True does with records pushed before it was READY.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ringserve.api.gpu_status import DEFAULT_RELOAD_S
from ringserve.api.metrics import StatsSnapshot
from ringserve.api.worker_stats import WorkerStats
from ringserve.config import DEFAULTS
from ringserve.rules import finish_reason
from ringserve.shm.messages import (
    Accepted,
    Cancel,
    CancelReason,
    Error,
    Finish,
    FinishReason,
    LoadLora,
    Message,
    Pooled,
    PromptLogprobs,
    Rejected,
    StepOutput,
    Submit,
    ToGpu,
    Token,
    UnloadLora,
    decode,
    encode,
)
from ringserve.shm.stats_schema import GPU_STAT_NAMES

FAKE_HIDDEN_SIZE = 8  # the width of the fake's hidden states (an embedding's dimensions)


def fake_hidden(token_id: int) -> list[float]:
    """A token's made-up final hidden state: a fixed function of its id, so tests know the pooled sums."""
    return [((token_id * 31 + j * 17) % 101) / 101 - 0.5 for j in range(FAKE_HIDDEN_SIZE)]


def echo_prompt(submit: Submit, index: int) -> Iterator[int]:
    """The default script: the prompt's ids, cycled."""
    return itertools.cycle(submit.prompt_ids)


@dataclass(slots=True)
class _Row:
    submit: Submit
    tokens: list[Iterator[int]]
    generated: list[int]
    live: list[bool]
    arrival: float
    first_token: float | None = None
    stop_token_ids: frozenset[int] = frozenset()
    cancelled: dict[int, FinishReason] = field(default_factory=dict)  # sample -> finish, cancelled one by one


@dataclass
class FakeEngine:
    """The stand-in's engine, without an event loop or a transport: `take` admits a Submit or notes a
    Cancel, `step` runs one step over every running row. `FakeGpu` drives it on the event loop in the
    worker's process; the bench producer (`tools/bench/producer.py`) drives it over a real ring."""

    script: Callable[[Submit, int], Iterator[int]] = echo_prompt
    eos_token_ids: frozenset[int] = frozenset()
    context_limit: int = 1 << 30  # as the real engine, a sample also ends where the context does
    admit: Callable[[Submit], Rejected | None] | None = None
    submits: list[Submit] = field(default_factory=list)
    cancels: list[Cancel] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)
    _rows: dict[int, _Row] = field(default_factory=dict)
    _cancelled: dict[int, FinishReason] = field(default_factory=dict)  # rid -> finish of the whole request
    _step: int = 0

    @property
    def running(self) -> int:
        return len(self._rows)

    def take(self, msg: Submit | Cancel) -> Accepted | Rejected | None:
        """A Submit's answer (Accepted, or the `admit` refusal); None for a Cancel, which the next
        step finishes."""
        if isinstance(msg, Cancel):
            self.cancels.append(msg)
            row = self._rows.get(msg.rid)
            reason = CancelReason(msg.reason).finish  # as the GPU process finishes it
            if row is not None and msg.index is not None:
                row.cancelled[msg.index] = reason
            elif row is not None:
                self._cancelled[msg.rid] = reason
            return None
        self.submits.append(msg)
        refusal = self.admit(msg) if self.admit is not None else None
        if refusal is not None:
            return refusal
        self._rows[msg.rid] = _Row(
            msg,
            [self.script(msg, i) for i in range(msg.n)],
            [0] * msg.n,
            [True] * msg.n,
            time.time(),
            stop_token_ids=frozenset(msg.sampling.stop_token_ids),
        )
        return Accepted(rid=msg.rid, est_gpu_ms=1.0)

    def drop(self) -> None:
        """Every row gone, as when the GPU process dies."""
        self._rows.clear()
        self._cancelled.clear()

    def step(self) -> StepOutput:
        """One token for every live sample, the finishes this step makes, and a new row's prompt
        logprobs or pooled record in its first step."""
        self._step += 1
        now = time.time()
        tokens: list[Token] = []
        finishes: list[Finish] = []
        prompts: list[PromptLogprobs] = []
        pooled: list[Pooled] = []
        for rid, row in list(self._rows.items()):
            submit = row.submit
            if row.first_token is None:
                row.first_token = now
                self._first_step(row, prompts, pooled)
            cancelled = self._cancelled.get(rid)
            alternatives = submit.logprobs
            for i in range(submit.n):
                if not row.live[i]:
                    continue
                ended = cancelled or row.cancelled.get(i)
                if ended is not None:
                    finishes.append(self._finish(row, i, ended, now))
                    continue
                tid = next(row.tokens[i])
                generated = row.generated[i] = row.generated[i] + 1
                tokens.append(Token(rid, i, tid, -0.5, [(tid, -0.5)] * alternatives if alternatives else None))
                reason = finish_reason(
                    tid,
                    generated,
                    len(submit.prompt_ids) + generated,
                    eos_token_ids=self.eos_token_ids,
                    stop_token_ids=row.stop_token_ids,
                    ignore_eos=submit.sampling.ignore_eos,
                    max_tokens=submit.max_tokens,
                    context_limit=self.context_limit,
                )
                if reason is not None:
                    finishes.append(self._finish(row, i, reason, now))
            if not any(row.live):
                del self._rows[rid]
                self._cancelled.pop(rid, None)
        return StepOutput(step=self._step, tokens=tokens, finishes=finishes, prompt_logprobs=prompts, pooled=pooled)

    @staticmethod
    def _first_step(row: _Row, prompts: list[PromptLogprobs], pooled: list[Pooled]) -> None:
        """A row's prompt logprobs and pooled record, which come with its first step."""
        submit = row.submit
        if submit.pooling is not None:
            ids = submit.prompt_ids if submit.pooling == "mean" else submit.prompt_ids[-1:]
            total = [sum(col) for col in zip(*map(fake_hidden, ids))]
            pooled.append(
                Pooled(submit.rid, len(submit.prompt_ids) - len(ids), len(ids), struct.pack(f"<{len(total)}f", *total))
            )
        if submit.prompt_logprobs is not None:
            ids = submit.prompt_ids[1:]
            top = [[(t, -1.0)] for t in ids] if submit.prompt_logprobs else None
            prompts.append(PromptLogprobs(submit.rid, 1, [-1.0] * len(ids), [1] * len(ids), top))

    def _finish(self, row: _Row, i: int, reason: FinishReason, now: float) -> Finish:
        row.live[i] = False
        self.finished[reason] = self.finished.get(reason, 0) + 1
        first = row.first_token if row.first_token is not None else now
        return Finish(
            row.submit.rid,
            i,
            reason,
            len(row.submit.prompt_ids),
            row.generated[i],
            0.1,
            (first - row.submit.arrival_ts) * 1000.0,
        )


@dataclass
class FakeGpu(FakeEngine):
    """Transport implementation over a `FakeEngine`; see the module docstring. Not thread-safe (one
    event loop)."""

    step_interval_s: float = 0.0
    wire: bool = True  # round-trip every message through msgpack, as the ring does
    paused: bool = False  # hold every running row (no tokens) until resumed
    ready: bool = True  # False between restart() and come_back()
    restarts: int = 0
    discarded: list[Submit] = field(default_factory=list)  # Submits sent while not ready
    quarantined: dict[int, float] = field(default_factory=dict)  # the supervisor's quarantine: fingerprint -> until
    _deliver: Callable[[Message], None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _timer: asyncio.Handle | None = None

    # Transport -------------------------------------------------------------------------------
    def open(self, deliver: Callable[[Message], None]) -> None:
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()

    def send(self, msg: ToGpu) -> bool:
        if isinstance(msg, (LoadLora, UnloadLora)):  # the fake runs no adapters
            self._post(
                Rejected(rid=msg.rid, status=400, code="invalid_request", message="The fake GPU runs no adapters.")
            )
            return True
        if self.wire:
            msg = _round_trip(msg)
        if not self.ready:
            if isinstance(msg, Submit):
                self.discarded.append(msg)
            return True  # pushed onto a ring the next process will discard
        answer = self.take(msg)
        if answer is not None:
            self._post(answer)
        self._wake()
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._deliver = None

    # control ---------------------------------------------------------------------------------
    def resume(self) -> None:
        self.paused = False
        self._wake()

    def fail(self, code: str = "gpu_restart", message: str = "the GPU process restarted") -> None:
        """Simulate a GPU-process crash: every open request gets an error, rows are dropped."""
        self.drop()
        self._post(Error(code=code, message=message))

    def restart(self, quarantine: tuple[int, ...] = ()) -> None:
        """The GPU process died and the supervisor fenced the rings: see the module docstring.
        `quarantine`: fingerprints the supervisor quarantines at this death (published before
        the fence, as it does)."""
        for fp in quarantine:
            self.quarantined[fp] = time.time() + 600.0
        self.drop()
        self.ready = False
        self.restarts += 1
        self._post(Error(code="gpu_restart", message="The GPU process restarted."))

    def come_back(self) -> None:
        """The restarted GPU process adopted the rings and is READY."""
        self.ready = True

    def stats(self) -> dict[str, float]:
        """A GPU stats region snapshot (every stat `shm.stats_schema.GPU_STATS` declares), as
        `api.metrics` renders it."""
        return {name: 0.0 for name in GPU_STAT_NAMES} | {
            "running_rows": float(len(self._rows)),
            "kv_blocks_free": 100.0,
            "kv_blocks_total": 128.0,
            "steps": float(self._step),
        }

    # the step loop ---------------------------------------------------------------------------
    def _post(self, msg: Message) -> None:
        if self._deliver is None or self._loop is None:
            return
        if self.wire:
            msg = decode(encode(msg))
        self._loop.call_soon(self._deliver_if_open, msg)

    def _deliver_if_open(self, msg: Message) -> None:
        if self._deliver is not None:
            self._deliver(msg)

    def _wake(self) -> None:
        if self._timer is None and self._rows and not self.paused and self._loop is not None:
            if self.step_interval_s > 0:
                self._timer = self._loop.call_later(self.step_interval_s, self._run_step)
            else:
                self._timer = self._loop.call_soon(self._run_step)

    def _run_step(self) -> None:
        self._timer = None
        if self.paused or self._deliver is None:
            return
        self._post(self.step())
        self._wake()


def _round_trip(msg: Submit | Cancel) -> Submit | Cancel:
    """`msg` through msgpack and back, as the ring carries it."""
    back = decode(encode(msg))
    if not isinstance(back, (Submit, Cancel)):
        raise TypeError(f"{type(msg).__name__} came back as {type(back).__name__}")
    return back


class FakeStatus:
    """`GpuStatus` (`api/gpu_status.py`) of a worker on the fake GPU: no control block, no restarts;
    ready while `ready()` says so (the fake's own flag by default)."""

    def __init__(self, fake: FakeGpu, ready: Callable[[], bool] | None = None) -> None:
        self.fake = fake
        self._ready = ready if ready is not None else (lambda: fake.ready)

    def ready(self) -> bool:
        return self._ready()

    def snapshot(self, own: WorkerStats) -> StatsSnapshot:
        return StatsSnapshot(gpu=self.fake.stats(), workers=[own.as_dict()], block_size=DEFAULTS.block_size)

    def reload_s(self) -> float:
        return DEFAULT_RELOAD_S

    def restart_status(self) -> dict | None:
        return None

    def eos_token_ids(self) -> frozenset[int]:
        return self.fake.eos_token_ids

    def health(self) -> dict:
        return {}

    def quarantined(self) -> dict[int, float]:
        return self.fake.quarantined

    def fingerprint_key(self) -> bytes:
        return b""

    def loras(self) -> tuple:
        return ()  # the fake runs no adapters

    def tenants(self) -> tuple:
        return ()  # nor keeps per-tenant counts

    def publish(self, own: WorkerStats) -> None:
        """Nowhere to publish: this worker's counters are the only ones."""

    def refused_retry_after(self, tenant: str) -> int | None:
        return None  # the fake decides every request itself

    def note_price(self, tenant: str, est_ms: float) -> None:
        pass
