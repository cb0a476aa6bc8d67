"""Grammar-constrained decoding, the GPU process's side (`docs/design.md#structured-output`): one
llguidance matcher per constrained sequence, and the step's token bitmask, filled in the grammar
thread while the forward runs.

A request's grammar arrives in llguidance's serialized form, built and checked by the API worker
(which refused what llguidance cannot compile, naming the construct). It is compiled into a base
matcher once per grammar text, in the compile threads under a deadline, while its Submit waits
outside the scheduler (`grammar_compile.py`, `grammar_gate.py`): a request joins a step only once
its grammar is compiled, and each constrained sequence then gets its own copy.

Per step, `begin(rows)` hands the constrained sampling rows to the grammar thread and returns at
once: there each matcher is brought up to its sequence's output (`RowControls.output_ids`: the
tokens sampled since its last step are consumed) and the rows' allowed tokens are written into one
int32 bitmask (bit t of a row: token t keeps the answer inside the grammar). The forward runs
meanwhile (on CUDA it is asynchronous; on the CPU torch drops the GIL in its ops, and llguidance
in its mask computation). `GrammarMasks.allowed()` waits for the thread and gives the masks as a
bool tensor on the device, which `logits_processors.ControlsPlan` applies before every other
control, the penalties, top-k and top-p.

Nothing unbounded waits in a step: a row whose matcher would first have to replay more than
`INLINE_CATCHUP` tokens (a sequence seen for the first time with output already, or evicted after
waiting) is *paused* (it samples nothing this step, the scheduler computes its last token again
next step) while its matcher is rebuilt in the preparing thread; and masks not filled within
`MASK_WAIT_S` after the forward pause their rows too, the late masks being used by the step that
asks for the same rows at the same output (so a slow mask costs a row a step, never a livelock).
`GrammarMasks.paused` names the paused sequences; the executor hands them to the scheduler.

Speculative decoding: a draft row is sampled at each position it verifies, and each position's
mask is its matcher's after the draft tokens before it (a copy that consumed them), so a kept
token was allowed exactly as it would have been without speculation.

The matcher state is thus a pure function of the sequence's tokens: preemption and recompute,
prefix-cache hits, a pause and a GPU-process restart change nothing, and a seeded constrained
request repeats exactly (the draw stays a function of seed, index and position). A matcher in an
error state (a grammar the worker should have refused, a token it rejects) allows only EOS, so the
answer ends rather than leaving its grammar; that is logged. Rows without a grammar pay nothing: a
step with none does no work here at all.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ringserve.config import DEFAULTS

from .grammar_compile import GrammarCompiler
from .step import RowControls, SeqStep

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("ringserve.gpu")

EVICT_AFTER_STEPS = 256  # a matcher unused this long (preempted, waiting) is freed; replayed on return
INLINE_CATCHUP = 32  # output tokens a row's matcher consumes in the fill; more are replayed beside the step
MASK_WAIT_S = 0.5  # how long after the forward a step waits for its masks before pausing their rows

_Key = tuple[int, int, tuple[int, ...]]  # (seq id, output tokens consumed, draft tokens): one row's mask


@dataclass(slots=True)
class _Seq:
    matcher: llguidance.LLMatcher
    grammar: str
    consumed: int  # output tokens the matcher has consumed
    last_step: int
    reported: bool = False  # its error was logged


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask `[n, ceil(V / 32)]` (bit t % 32 of word t // 32: token t) -> bool `[n, V]`."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = (bits.unsqueeze(-1) >> shifts).bitwise_and_(1).bool()  # [n, W, 32]
    return allowed.view(bits.shape[0], -1)[:, :vocab_size]


class GrammarMasks:
    """One step's constrained rows (indices into its sampling rows): those masked (`rows`, final
    once `allowed()` returned) and those paused (`paused`: their sequence ids)."""

    __slots__ = ("rows", "paused", "_fill_rows", "_keys", "_future", "_reused", "_owner", "_device", "_vocab")

    def __init__(
        self,
        owner: GrammarState,
        fill_rows: list[int],
        keys: list[_Key],
        future: Future | None,
        reused: dict[int, torch.Tensor],
        paused: set[int],
    ) -> None:
        self._owner = owner
        self._fill_rows = fill_rows
        self._keys = keys
        self._future = future
        self._reused = reused  # sampling row -> its late mask (host, as the fill gives it)
        self.paused = paused
        self.rows = sorted([*fill_rows, *reused])
        self._device = owner.device
        self._vocab = owner.vocab_size

    def allowed(self, wait_s: float | None = None) -> torch.Tensor:
        """bool `[len(rows), vocab]` on the device: True where the grammar allows the token. Rows
        whose masks are not filled within `wait_s` (`MASK_WAIT_S`) leave `rows` for `paused`."""
        host_rows: dict[int, torch.Tensor] = dict(self._reused)
        if self._future is not None:
            try:
                host = self._future.result(timeout=MASK_WAIT_S if wait_s is None else wait_s)
            except FutureTimeout:
                self._owner.late(self._future, self._keys)
                self.paused |= {k[0] for k in self._keys}
                self.rows = sorted(self._reused)
            else:
                if not self._reused:
                    return host if self._device.type == "cpu" else unpack_bitmask(host.to(self._device), self._vocab)
                host_rows.update(zip(self._fill_rows, host))
        if not self.rows:
            return torch.zeros(0, self._vocab, dtype=torch.bool, device=self._device)
        host = torch.stack([host_rows[i] for i in self.rows])
        if self._device.type == "cpu":
            return host  # unpacked in the grammar thread, beside the forward
        return unpack_bitmask(host.to(self._device, non_blocking=True), self._vocab)


class GrammarState:
    """The engine's side of structured output: compiled grammars, per-sequence matchers, masks."""

    def __init__(
        self,
        tokenizer_file: str | None,
        vocab_size: int,
        eos_token_ids,
        device: torch.device,
        max_rows: int = DEFAULTS.max_rows,  # the mask buffer's first size; it grows to a step's masked rows
        compile_timeout_s: float = 10.0,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos = sorted(eos_token_ids)
        self.seqs: dict[int, _Seq] = {}  # owned by the grammar thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._prep = ThreadPoolExecutor(1, thread_name_prefix="grammar-prep")
        self._preparing: dict[int, tuple[Future, str, int]] = {}  # seq id -> (its rebuild, grammar, consumed)
        self._late: list[tuple[Future, list[_Key]]] = []  # fills that missed their step
        self._step = 0
        self._words = (vocab_size + 31) // 32
        self._bits = torch.zeros(max_rows, self._words, dtype=torch.int32, pin_memory=_can_pin(device))
        # NOTE: built in the grammar thread (a fifth of a second for a 49k vocabulary) as the
        # process starts; a compile that needs it first waits for it in its own thread.
        self._tokenizer: Future | None = (
            self._pool.submit(_load_tokenizer, tokenizer_file, vocab_size, self.eos) if tokenizer_file else None
        )
        self.compiler = GrammarCompiler(self._tokenizer_now, compile_timeout_s)
        self._executor: llguidance.LLExecutor | None = None  # the parallel mask filler
        if tokenizer_file:
            self._pool.submit(self._warm_up)
        self.pauses = 0  # rows paused (a matcher rebuilt, a mask late), for tests and stats

    def _warm_up(self) -> None:
        """Grammar thread, at start: make the mask filler and fill one mask (not in a step)."""
        import llguidance

        self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._tokenizer_now(), llguidance.LLMatcher.grammar_from_regex("a"), log_level=0)
        _fill_bits(self._executor, [(matcher, 0)], self._bits[:1])

    def _tokenizer_now(self):
        if self._tokenizer is None:
            raise RuntimeError("structured output needs the model's tokenizer.json, which this engine was not given")
        return self._tokenizer.result()

    # -- per step --------------------------------------------------------------------------------

    def begin(self, rows: list[SeqStep]) -> GrammarMasks | None:
        """Fill the masks of the constrained rows among the step's sampling `rows` in the grammar
        thread; None (and no work) when none is constrained."""
        reused, filling = self._take_late()
        fill_rows: list[int] = []
        keys: list[_Key] = []
        jobs: list[tuple[int, str, list[int], int, list[int], bool | _Rebuilt]] = []
        found: dict[int, torch.Tensor] = {}
        paused: set[int] = set()
        for i, s in enumerate(rows):
            c = s.sampling.controls if s.sampling is not None else None
            if c is None or c.settings.grammar is None:
                continue
            n = len(c.output_ids)
            key = (s.seq_id, n, tuple(s.drafted))
            mask = reused.pop(key, None)
            if mask is not None:
                found[i] = mask
                continue
            if key in filling:  # a late fill is still computing this very mask: wait for it
                paused.add(s.seq_id)
                continue
            ready = self._ready(s.seq_id, c, n)
            if ready is None:
                paused.add(s.seq_id)
                continue
            fill_rows.append(i)
            keys.append(key)
            jobs.append((s.seq_id, c.settings.grammar, c.output_ids, n, s.drafted, ready))
        if not fill_rows and not found and not paused:
            return None
        self._step += 1
        self.pauses += len(paused)
        future = None
        if jobs:
            if len(jobs) > self._bits.shape[0]:
                self._bits = torch.zeros(len(jobs), self._words, dtype=torch.int32, pin_memory=_can_pin(self.device))
            future = self._pool.submit(self._fill, jobs)
        if self._step % EVICT_AFTER_STEPS == 0:
            self._pool.submit(self._evict)
        return GrammarMasks(self, fill_rows, keys, future, found, paused)

    def _ready(self, seq_id: int, c: RowControls, n: int) -> bool | _Rebuilt | None:
        """How the fill gets `seq_id`'s matcher to its `n` output tokens: True (its own, or a
        fresh copy, catching up inline), a rebuilt matcher (prepared beside the steps), or None
        (not yet: the row is paused and its rebuild started)."""
        grammar = c.settings.grammar or ""
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.grammar == grammar and seq.consumed <= n <= seq.consumed + INLINE_CATCHUP:
            return True
        if (seq is None or seq.grammar != grammar or seq.consumed > n) and n <= INLINE_CATCHUP:
            return True if self.compiler.base(grammar) is not None else None
        prep = self._preparing.get(seq_id)
        if prep is not None and prep[1] == grammar and prep[2] <= n <= prep[2] + INLINE_CATCHUP:
            if not prep[0].done():
                return None
            del self._preparing[seq_id]
            return prep[0].result()
        base = self.compiler.base(grammar)
        if base is not None:
            self._preparing[seq_id] = (self._prep.submit(_replay, base, c.output_ids[:n]), grammar, n)
        return None

    def late(self, future: Future, keys: list[_Key]) -> None:
        """A step gave up waiting for this fill: its masks serve the next step that asks for the
        same rows (`begin`), which until then are paused rather than filled again."""
        self._late.append((future, keys))

    def _take_late(self) -> tuple[dict[_Key, torch.Tensor], set[_Key]]:
        """The masks of late fills that have ended, and the rows of those still filling."""
        done: dict[_Key, torch.Tensor] = {}
        filling: set[_Key] = set()
        pending = []
        for future, keys in self._late:
            if future.done():
                done.update(zip(keys, future.result()))
            else:
                pending.append((future, keys))
                filling.update(keys)
        self._late = pending
        return done, filling

    def _fill(self, jobs) -> torch.Tensor:
        """Grammar thread: sync each row's matcher with its output, fill the rows' bitmask."""
        matchers = [
            (self._drafted(self._synced(seq_id, grammar, output, n, ready), drafted), k)
            for k, (seq_id, grammar, output, n, drafted, ready) in enumerate(jobs)
        ]
        bits = self._bits[: len(jobs)]
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        _fill_bits(self._executor, matchers, bits)
        if self.device.type == "cpu":
            return unpack_bitmask(bits, self.vocab_size)
        return bits.clone()  # NOTE: a late fill's masks outlive the buffer's next use

    def _synced(self, seq_id: int, grammar: str, output: list[int], n: int, ready):
        """`seq_id`'s matcher, having consumed exactly `output[:n]` (catching up, a fresh copy, or
        the rebuilt matcher `ready` installed)."""
        seq = self.seqs.get(seq_id)
        if isinstance(ready, _Rebuilt):
            seq = self.seqs[seq_id] = _Seq(ready.matcher, grammar, ready.consumed, self._step)
        elif seq is None or seq.grammar != grammar or seq.consumed > n:
            base = self.compiler.base(grammar)
            if base is None:  # NOTE: not reached: `_ready` saw it compiled, and running users pin it
                raise RuntimeError("a constrained row's grammar is not compiled")
            seq = self.seqs[seq_id] = _Seq(base.deep_copy(), grammar, 0, self._step)
        matcher = seq.matcher
        for token in output[seq.consumed : n]:
            # NOTE: a stopped matcher (its grammar ended and EOS was sampled) allows EOS alone
            # from then on; what follows (with ignore_eos) is not fed to it.
            if matcher.is_stopped():
                break
            matcher.consume_token(token)
        seq.consumed = max(seq.consumed, n)
        seq.last_step = self._step
        if not seq.reported and matcher.is_error():
            seq.reported = True
            why = matcher.get_error().splitlines()[:1]
            log.error("structured output: sequence %d left its grammar, only EOS allowed now: %s", seq_id, why)
        return matcher

    @staticmethod
    def _drafted(matcher, drafted: list[int]):
        """The matcher for a position that verifies a speculative draft: a copy that has consumed
        the draft tokens before it (`SeqStep.drafted`); the sequence's own, with none. A draft
        token the grammar rejects leaves the copy in error (EOS only), which is harmless: the
        position before it masked that token out, so no draft is kept past it."""
        if not drafted:
            return matcher
        copy = matcher.deep_copy()
        for token in drafted:
            if copy.is_stopped() or copy.is_error():
                break
            copy.consume_token(token)
        return copy

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that ended: drop their matchers (after any fill still running)."""
        for k in seq_ids:
            self._preparing.pop(k, None)
        if self.seqs and seq_ids:
            self._pool.submit(self._drop, list(seq_ids))

    def _drop(self, seq_ids: list[int]) -> None:
        for k in seq_ids:
            self.seqs.pop(k, None)

    def _evict(self) -> None:
        stale = [k for k, s in self.seqs.items() if self._step - s.last_step >= EVICT_AFTER_STEPS]
        for k in stale:
            del self.seqs[k]

    def close(self) -> None:
        self.compiler.close()
        self._prep.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _replay(base, output: list[int]):
    """Preparing thread: a fresh copy of `base` that has consumed `output` (as `_synced` would)."""
    matcher = base.deep_copy()
    for token in output:
        if matcher.is_stopped():
            break
        matcher.consume_token(token)
    return _Rebuilt(matcher, len(output))


@dataclass(slots=True)
class _Rebuilt:
    """A matcher rebuilt beside the steps, and how many output tokens it consumed."""

    matcher: llguidance.LLMatcher
    consumed: int


def _fill_bits(executor, matchers: list, bits: torch.Tensor) -> None:
    """Each (matcher, row) pair's next-token mask into row `row` of `bits` (int32 `[n, words]`,
    contiguous, on the host), in parallel with the GIL released. NOTE: llguidance.torch does the
    same, but importing it builds a `torch.compile` kernel, which imports torch._dynamo: 5 to 9 s
    on a loaded CPU box, which held the first constrained step (and once this moved to start-up,
    tripped the loading watchdog)."""
    if bits.dtype != torch.int32 or bits.device.type != "cpu" or not bits.is_contiguous():
        raise ValueError("the grammar bitmask must be a contiguous int32 host tensor")
    executor.unsafe_compute_mask_ptr(matchers, bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])


def _load_tokenizer(path: str, vocab_size: int, eos: list[int]):
    import llguidance

    with open(path, encoding="utf-8") as f:
        return llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos or None)


def _can_pin(device: torch.device) -> bool:
    return device.type == "cuda"
