"""Grammar-constrained decoding, the GPU process's side (`docs/design.md#structured-output`): one
llguidance matcher per constrained sequence, and the step's token bitmask, filled in the grammar
thread while the forward runs.

A request's grammar arrives in llguidance's serialized form, built and checked by the API worker
(which refused what llguidance cannot compile, naming the construct). `prepare` compiles it into a
matcher in the grammar thread as soon as its Submit is admitted, once per grammar text (an LRU of
`COMPILED_GRAMMARS`); each constrained sequence then gets its own copy.

Per step, `begin(rows)` hands the constrained sampling rows to the grammar thread and returns at
once: there each matcher is brought up to its sequence's output (`RowControls.output_ids`: the
tokens sampled since its last step are consumed; a sequence seen for the first time, or evicted,
replays its whole output into a fresh copy) and the rows' allowed tokens are written into one
int32 bitmask (bit t of a row: token t keeps the answer inside the grammar). The forward runs
meanwhile (on CUDA it is asynchronous; on the CPU torch drops the GIL in its ops, and llguidance
in its mask computation). `GrammarMasks.allowed()` waits for the thread and gives the masks as a
bool tensor on the device, which `logits_processors.ControlsPlan` applies before every other
control, the penalties, top-k and top-p.

Speculative decoding: a draft row is sampled at each position it verifies, and each position's
mask is its matcher's after the draft tokens before it (a copy that consumed them), so a kept
token was allowed exactly as it would have been without speculation.

The matcher state is thus a pure function of the sequence's tokens: preemption and recompute,
prefix-cache hits and a GPU-process restart change nothing, and a seeded constrained request
repeats exactly (the draw stays a function of seed, index and position). A matcher in an error
state (a grammar the worker should have refused, a token it rejects) allows only EOS, so the answer
ends rather than leaving its grammar; that is logged. Rows without a grammar pay nothing: a step
with none does no work here at all.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .step import RowControls, SeqStep

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("ringserve.gpu")

COMPILED_GRAMMARS = 128  # grammar texts kept compiled (a sequence keeps its own copy regardless)
EVICT_AFTER_STEPS = 256  # a matcher unused this long (preempted, waiting) is freed; replayed on return


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
    """One step's constrained rows (indices into its sampling rows) and their pending masks."""

    __slots__ = ("rows", "_future", "_device", "_vocab")

    def __init__(self, rows: list[int], future: Future, device: torch.device, vocab: int) -> None:
        self.rows = rows
        self._future = future
        self._device = device
        self._vocab = vocab

    def allowed(self) -> torch.Tensor:
        """bool `[len(rows), vocab]` on the device: True where the grammar allows the token."""
        host = self._future.result()
        if self._device.type == "cpu":
            return host  # unpacked in the grammar thread, beside the forward
        return unpack_bitmask(host.to(self._device, non_blocking=True), self._vocab)


class GrammarState:
    """The engine's side of structured output: compiled grammars, per-sequence matchers, masks."""

    def __init__(
        self, tokenizer_file: str | None, vocab_size: int, eos_token_ids, device: torch.device, max_rows: int = 256
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos = sorted(eos_token_ids)
        self.seqs: dict[int, _Seq] = {}
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._step = 0
        self._words = (vocab_size + 31) // 32
        self._bits = torch.zeros(max_rows, self._words, dtype=torch.int32, pin_memory=_can_pin(device))
        # NOTE: built in the grammar thread (a fifth of a second for a 49k vocabulary), before any
        # compile queued behind it needs it.
        self._tokenizer: Future | None = (
            self._pool.submit(_load_tokenizer, tokenizer_file, vocab_size, self.eos) if tokenizer_file else None
        )
        self._executor: llguidance.LLExecutor | None = None  # the parallel mask filler, made at first use

    # -- compile (off the loop) ------------------------------------------------------------------

    def prepare(self, grammar: str) -> None:
        """Start compiling `grammar` (an admitted Submit's) in the grammar thread."""
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return
        self._compiled[grammar] = self._pool.submit(self._compile, grammar)
        while len(self._compiled) > COMPILED_GRAMMARS:
            self._compiled.popitem(last=False)

    def _compile(self, grammar: str):
        import llguidance

        if self._tokenizer is None:
            raise RuntimeError("structured output needs the model's tokenizer.json, which this engine was not given")
        return llguidance.LLMatcher(self._tokenizer.result(), grammar, log_level=0)

    def _fresh(self, grammar: str):
        """A new matcher at the start of `grammar` (runs in the grammar thread)."""
        future = self._compiled.get(grammar)
        base = future.result() if future is not None else self._compile(grammar)
        return base.deep_copy()

    # -- per step --------------------------------------------------------------------------------

    def begin(self, rows: list[SeqStep]) -> GrammarMasks | None:
        """Fill the masks of the constrained rows among the step's sampling `rows` in the grammar
        thread; None (and no work) when none is constrained."""
        picked: list[int] = []
        jobs: list[tuple[int, RowControls, list[int]]] = []
        for i, s in enumerate(rows):
            c = s.sampling.controls if s.sampling is not None else None
            if c is not None and c.settings.grammar is not None:
                picked.append(i)
                jobs.append((s.seq_id, c, s.drafted))
        if not picked:
            return None
        self._step += 1
        if len(picked) > self._bits.shape[0]:
            self._bits = torch.zeros(len(picked), self._words, dtype=torch.int32, pin_memory=_can_pin(self.device))
        future = self._pool.submit(self._fill, jobs)
        if self._step % EVICT_AFTER_STEPS == 0:
            self._pool.submit(self._evict)
        return GrammarMasks(picked, future, self.device, self.vocab_size)

    def _fill(self, jobs) -> torch.Tensor:
        """Grammar thread: sync each row's matcher with its output, fill the rows' bitmask."""
        import llguidance.torch as llt

        matchers = [
            (self._drafted(self._synced(seq_id, c.settings.grammar, c.output_ids), drafted), k)
            for k, (seq_id, c, drafted) in enumerate(jobs)
        ]
        bits = self._bits[: len(jobs)]
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        llt.fill_next_token_bitmask_par(self._executor, matchers, bits)
        if self.device.type == "cpu":
            return unpack_bitmask(bits, self.vocab_size)
        return bits

    def _synced(self, seq_id: int, grammar: str, output: list[int]):
        """`seq_id`'s matcher, having consumed exactly `output` (catching up, or replaying)."""
        n = len(output)
        seq = self.seqs.get(seq_id)
        if seq is None or seq.grammar != grammar or seq.consumed > n:
            seq = self.seqs[seq_id] = _Seq(self._fresh(grammar), grammar, 0, self._step)
        matcher = seq.matcher
        for token in output[seq.consumed :]:
            # NOTE: a stopped matcher (its grammar ended and EOS was sampled) allows EOS alone
            # from then on; what follows (with ignore_eos) is not fed to it.
            if matcher.is_stopped():
                break
            matcher.consume_token(token)
        seq.consumed = n
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
        self._pool.shutdown(wait=True, cancel_futures=True)


def _load_tokenizer(path: str, vocab_size: int, eos: list[int]):
    import llguidance

    with open(path, encoding="utf-8") as f:
        return llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos or None)


def _can_pin(device: torch.device) -> bool:
    return device.type == "cuda"
