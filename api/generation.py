"""One request's output state: GPU records in, client-visible text and finish reasons out.

`Generation.consume(batch)` turns a batch of `Token` / `Finish` / `PromptScores` / `Error`
records into per-choice text (detokenized incrementally, stop strings applied) and, when
streaming, SSE event bytes. A request has one or more prompts (a batch of prompts fans out into
one Submit each) of `n` choices each; choice `p * n + j` is sample j of prompt p, as OpenAI
numbers them. It knows nothing about HTTP: the handler writes what it returns and asks it when to
cancel and when the request is over.

Per choice, in order: the echoed prompt (`echo`: the prompt's text, with its tokens' logprobs when
asked), then the generated text. A stop token's text is not shown, and a matched stop string is
cut off, unless `include_stop_str_in_output`; no stop string ends a choice before it has more than
`min_tokens` tokens (vLLM's rules). With `score_only` (max_tokens 0 with echo) the one token the
GPU generates is not shown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringserve.api.detokenizer import Detokenizer
from ringserve.api.errors import error_object, error_type
from ringserve.api.logprobs import COMPLETION_LOGPROBS, LogprobFormat
from ringserve.api.prompt_scores import PromptSheet
from ringserve.api.protocol import OutputOptions
from ringserve.api.request_stream import PooledChunk, PromptScores
from ringserve.api.request_trace import timeline_ms
from ringserve.api.sse import Encoder
from ringserve.api.stop_strings import StopMatcher
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import Error, Finish, FinishReason, Pooled, Token


@dataclass(frozen=True, slots=True)
class LocalCancel:
    """Fed into a request's stream by the worker itself (DELETE): end every sample `cancelled`."""

    reason: str = "cancelled"


@dataclass(slots=True)
class PoolSum:
    """One prompt's pooled hidden states so far (`shm.messages.Pooled` chunks), added in float64."""

    total: np.ndarray | None = None
    count: int = 0

    def add(self, rec: Pooled) -> None:
        values = np.frombuffer(rec.values, dtype="<f4").astype(np.float64)
        self.total = values if self.total is None else self.total + values
        self.count += rec.count

    def mean(self) -> np.ndarray:
        """The mean hidden state of the pooled positions (one for last-token pooling)."""
        if self.total is None or not self.count:
            raise RuntimeError("no hidden states were pooled for this prompt")
        return self.total / self.count


@dataclass(slots=True)
class Sample:
    detok: Detokenizer
    stops: StopMatcher | None
    prompt: int  # which prompt of the request this choice answers
    parts: list[str] = field(default_factory=list)  # the text so far (non-streaming only)
    tokens: int = 0
    reason: str | None = None  # the client-visible finish reason, once finished
    gpu_done: bool = False  # the GPU process reported this sample's Finish
    logprobs: list | None = None  # per-token logprob entries (non-streaming, when asked for)
    offset: int = 0  # the text offset of the next logprobs entry
    echoed: bool = False
    finish: Finish | None = None  # the GPU process's record of its end (timing)


class Generation:
    """Output state of one request: `len(prompts) * n` choices."""

    def __init__(
        self,
        codec: TextCodec,
        *,
        n: int,
        stop: tuple[str, ...],
        prompts: list[list[int]],
        arrival: float,
        encoder: Encoder | None,
        logprobs: int | None = None,
        logprob_format: LogprobFormat = COMPLETION_LOGPROBS,
        options: OutputOptions = OutputOptions(),
        stop_ids: frozenset[int] = frozenset(),
        echo: list[str] | None = None,
        score_only: bool = False,
        scored: bool = False,
        continuous_usage: bool = False,
        show_prompt_logprobs: int | None = None,
        pooled: bool = False,
        detail: bool = False,
    ) -> None:
        """`encoder` writes the route's SSE events (None: not streaming); `logprobs` is the
        request's setting (None: no logprobs objects), shown as `logprob_format` says; `stop_ids`
        the request's stop token ids (their text is not shown); `echo` each prompt's text to show
        first; `scored`: the GPU sends the prompts' logprobs (echo with logprobs, prompt_logprobs);
        `show_prompt_logprobs`: vLLM's `prompt_logprobs` field on the body, with that many
        alternatives (None: not shown); `pooled`: the GPU sends each prompt's hidden-state sums
        (an embedding request), added up in `pools`."""
        self.codec = codec
        self.n = n
        self.detail = detail  # the timing carries each sample's GPU timeline
        self.prompts = prompts
        self.options = options
        skip = options.skip_special_tokens
        self.samples = [
            Sample(
                Detokenizer(codec, skip_special_tokens=skip),
                StopMatcher(stop, options.include_stop_str) if stop else None,
                i // n,
                logprobs=[] if logprobs is not None else None,
            )
            for i in range(n * len(prompts))
        ]
        self.logprob_format = logprob_format
        self.prompt_tokens = sum(map(len, prompts))
        self.arrival = arrival
        self.encoder = encoder
        self.want_logprobs = logprobs
        self.stop_ids = stop_ids if not options.include_stop_str else frozenset()
        self.echo = echo
        self.score_only = score_only
        self.continuous_usage = continuous_usage
        self.show_prompt_logprobs = show_prompt_logprobs
        # Per prompt: what the response shows of its scores, built as they arrive.
        echo_logprobs = logprobs if echo is not None else None
        self.sheets: list[PromptSheet] | None = (
            [PromptSheet(codec, p, logprob_format, echo_logprobs, show_prompt_logprobs) for p in prompts]
            if scored
            else None
        )
        self.pools: list[PoolSum] | None = [PoolSum() for _ in prompts] if pooled else None
        self.error: Error | None = None
        self.queue_ms: float | None = None  # from the GPU process's Finish records
        self.gpu_ttft_ms: float | None = None
        # Seen from the worker (for its latency histograms): first and last token arrival, the
        # longest gap between two arrivals, on the monotonic clock.
        self.worker_ttft_ms: float | None = None
        self.first_token_t = 0.0
        self.last_token_t = 0.0
        self.max_gap_s = 0.0
        self.gaps: list[float] = []  # between two arrivals of tokens, s (vLLM's inter-token latency)
        self.tokens = 0
        self.unfinished = len(self.samples)  # samples without a client-visible finish
        self.stopped: list[int] = []  # samples a stop string ended, whose GPU rows may still run

    # ------------------------------------------------------------------------------------------
    def consume(self, batch: list) -> list[bytes]:
        """Apply records; returns SSE events (empty when not streaming)."""
        out: list[bytes] = []
        samples = self.samples
        tokens_before = self.tokens
        for item in batch:
            if self.error is not None:
                break  # the request failed: nothing after its error event is shown
            kind = type(item)
            if kind is Token:
                s = samples[item.index]
                if s.reason is not None or self.score_only:
                    continue  # after a stop string ended the sample, or the hidden scoring token
                if self.echo is not None and not s.echoed:
                    self._echo(s, item.index, out)
                self._token(s, item, out)
            elif kind is Finish:
                self._gpu_finish(samples[item.index], item, out)
            elif kind is PromptScores:
                self._prompt_scores(item)
            elif kind is PooledChunk:
                if self.pools is not None:
                    self.pools[item.prompt].add(item.record)
            elif kind is LocalCancel:
                for i, s in enumerate(samples):
                    if s.reason is None:
                        self._finish(s, i, self._tail(s), "cancelled", out)
            elif kind is Error:
                self._fail(item, out)
        if self.tokens != tokens_before:
            self._arrived()
        return out

    def _token(self, s: Sample, item: Token, out: list[bytes]) -> None:
        s.tokens += 1
        self.tokens += 1
        index = item.index
        # A stop token ends the sample; like a stop string, its text is not part of the answer.
        text = "" if item.token_id in self.stop_ids else s.detok.push(item.token_id)
        hit = False
        if s.stops is not None and s.tokens > self.options.min_tokens:
            text, hit = s.stops.feed(text)
        lp = None
        if self.want_logprobs is not None:
            entry = self._entry(s, item.token_id, item.logprob, item.top_logprobs)
            lp = self.logprob_format.event([entry]) if self.encoder is not None else None
        enc = self.encoder
        if enc is not None:
            out.append(enc.token(index, text, item.token_id, item.logprob, lp, self._usage_of(s)))
        elif text:
            s.parts.append(text)
        if hit:
            self._finish(s, index, "", "stop", out)
            self.stopped.append(index)

    def _gpu_finish(self, s: Sample, item: Finish, out: list[bytes]) -> None:
        s.gpu_done = True
        s.finish = item
        if self.queue_ms is None:
            self.queue_ms = item.queue_ms
        self.gpu_ttft_ms = item.ttft_ms if self.gpu_ttft_ms is None else min(self.gpu_ttft_ms, item.ttft_ms)
        if s.reason is not None:
            return
        finish = FinishReason(item.reason)
        if finish is FinishReason.ERROR:  # the GPU process failed this request's row
            self._fail(
                Error(
                    code="gpu_error", rid=item.rid, message="the GPU process could not finish this request; retry it"
                ),
                out,
            )
            return
        if self.echo is not None and not s.echoed:
            self._echo(s, item.index, out)
        self._finish(s, item.index, self._tail(s), finish.client, out)

    def _prompt_scores(self, item: PromptScores) -> None:
        if self.sheets is not None:
            self.sheets[item.prompt].add(item.record)

    def _echo(self, s: Sample, index: int, out: list[bytes]) -> None:
        """Show the choice's prompt before its first token (or its finish)."""
        s.echoed = True
        if self.echo is None:
            return
        text = self.echo[s.prompt]
        lp = None
        if self.want_logprobs is not None:
            # NOTE: a request that echoes with logprobs is scored, so it has its sheets.
            sheet = (
                self.sheets[s.prompt]
                if self.sheets is not None
                else PromptSheet(self.codec, self.prompts[s.prompt], self.logprob_format, self.want_logprobs, None)
            )
            s.offset = sheet.echo_width
            if self.encoder is not None:
                lp = sheet.echo_event()
            elif s.logprobs is not None:
                s.logprobs += sheet.echo_entries
        if self.encoder is not None:
            out.append(self.encoder.text(index, text, lp))
        else:
            s.parts.append(text)

    def _entry(self, s: Sample, token_id: int, logprob: float | None, top) -> object:
        # NOTE: called only for requests that asked for logprobs (want_logprobs is set).
        want = self.want_logprobs or 0
        entry, width = self.logprob_format.entry(self.codec, token_id, logprob, top, want, s.offset)
        s.offset += width
        if self.encoder is None and s.logprobs is not None:
            s.logprobs.append(entry)
        return entry

    def _arrived(self) -> None:
        """Tokens arrived in this batch: track first-token time and the longest gap."""
        now = time.monotonic()
        if self.worker_ttft_ms is None:
            self.worker_ttft_ms = (time.time() - self.arrival) * 1000.0
            self.first_token_t = now
        else:
            gap = now - self.last_token_t
            self.gaps.append(gap)
            if gap > self.max_gap_s:
                self.max_gap_s = gap
        self.last_token_t = now

    def _fail(self, err: Error, out: list[bytes]) -> None:
        if self.error is not None:
            return
        self.error = err
        if self.encoder is not None:
            out.append(self.encoder.error(self.error_body()))

    def error_body(self) -> dict:
        """The OpenAI error object for the request's failure, with how many tokens the client
        already has (all samples together), so it knows what a retry repeats."""
        err = self.error
        if err is None:
            raise RuntimeError("error_body() of a request that has not failed")
        return error_object(err.message, err.code, type_=error_type(err.code), extra={"tokens_streamed": self.tokens})

    # ------------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every sample has its client-visible finish (or the request failed)."""
        return self.unfinished == 0 or self.error is not None

    @property
    def gpu_done(self) -> bool:
        return all(s.gpu_done for s in self.samples)

    @property
    def needs_cancel(self) -> bool:
        """Every sample is finished for the client but the GPU still runs some (stop strings)."""
        return self.unfinished == 0 and not self.gpu_done

    def usage(self) -> dict:
        """The whole request's usage: every prompt once, every choice's tokens."""
        completion = sum(s.tokens for s in self.samples)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def sample_usage(self, s: Sample) -> dict:
        """One choice's usage: its prompt and its tokens."""
        prompt = len(self.prompts[s.prompt])
        return {"prompt_tokens": prompt, "completion_tokens": s.tokens, "total_tokens": prompt + s.tokens}

    def _usage_of(self, s: Sample) -> dict | None:
        return self.sample_usage(s) if self.continuous_usage else None

    def timing(self) -> dict:
        """Where the request's time went on the server, ms: its queue wait and TTFT (the worker's
        TTFT if the GPU's never came), and over the samples finished so far the longest prefill
        (first join to first token) and decode (first token to last), and their preemptions; with
        `detail` (the client sent `x-ringserve-timing: 1`) each sample's GPU timeline too."""
        ttft = self.gpu_ttft_ms if self.gpu_ttft_ms is not None else self.worker_ttft_ms
        ends = [s.finish for s in self.samples if s.finish is not None]
        out: dict[str, Any] = {
            "queue_ms": self.queue_ms,
            "ttft_ms": ttft,
            "prefill_ms": max((f.prefill_ms for f in ends), default=None),
            "decode_ms": max((f.decode_ms for f in ends), default=None),
            "preemptions": sum(f.preemptions for f in ends),
        }
        if self.detail:
            out["timeline"] = [timeline_ms(self.arrival, f) for f in ends]
        return out

    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, as the client saw the tokens arrive."""
        per_sample = self.tokens / len(self.samples)
        if per_sample <= 1:
            return None
        return (self.last_token_t - self.first_token_t) * 1000.0 / (per_sample - 1)

    def choices(self) -> list[dict]:
        """The /v1/completions choices of a non-streamed request."""
        choices: list[dict[str, Any]] = [
            {"index": i, "text": "".join(s.parts), "logprobs": self.sample_logprobs(s), "finish_reason": s.reason}
            for i, s in enumerate(self.samples)
        ]
        if self.show_prompt_logprobs is not None:
            for choice, s in zip(choices, self.samples):
                choice["prompt_logprobs"] = self.prompt_logprobs(s.prompt)
        return choices

    def sample_logprobs(self, s: Sample) -> dict | None:
        """A non-streamed sample's logprobs object, None when the request did not ask for one."""
        return None if s.logprobs is None else self.logprob_format.collect(s.logprobs)

    def prompt_logprobs(self, prompt: int) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` of a prompt: None for its first token, then per token
        `{token id: {"logprob", "rank", "decoded_token"}}` holding the token and its
        `show_prompt_logprobs` most probable alternatives (one list, shared by its choices)."""
        return self.sheets[prompt].vllm if self.sheets is not None else None

    # ------------------------------------------------------------------------------------------
    def _tail(self, s: Sample) -> str:
        """Text still held at the GPU's finish: an incomplete character, a stop-string prefix."""
        text = s.detok.flush()
        if s.stops is None:
            return text
        text, hit = s.stops.feed(text)
        return text if hit else text + s.stops.flush()

    def _finish(self, s: Sample, index: int, tail: str, reason: str, out: list[bytes]) -> None:
        s.reason = reason
        self.unfinished -= 1
        enc = self.encoder
        if enc is not None:
            usage = self.sample_usage(s) if enc.USAGE_ON_FINISH or self.continuous_usage else None
            out.append(enc.finish(index, tail, reason, usage, self.timing()))
        elif tail:
            s.parts.append(tail)
