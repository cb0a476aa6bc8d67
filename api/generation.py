"""One request's output state: GPU records in, client-visible text and finish reasons out.

`Generation.consume(batch)` turns a batch of `Token` / `Finish` / `Error` records into per-sample
text (detokenized incrementally, stop strings applied) and, when streaming, SSE event bytes. It
knows nothing about HTTP: the handler writes what it returns and asks it when to cancel and when
the request is over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ringserve.api.detokenizer import Detokenizer
from ringserve.api.errors import error_object, error_type
from ringserve.api.sse import Encoder
from ringserve.api.stop_strings import StopMatcher
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import Error, Finish, Token

# GPU finish reasons as the client sees them (the API promises stop | length | cancelled).
_CLIENT_REASON = {"stop": "stop", "length": "length", "cancelled": "cancelled",
                  "deadline": "cancelled"}


class LogprobFormat(Protocol):
    """How a route shows token logprobs: one entry per token, one object per streamed event, and
    the object of a whole sample (non-streaming)."""

    def entry(self, codec: TextCodec, item: Token, offset: int) -> object:
        """One token's entry; `offset` is where its text starts in the sample's text."""

    def event(self, entry: object) -> dict:
        """The logprobs object of the streamed event carrying that one token."""

    def collect(self, entries: list) -> dict:
        """The logprobs object of a whole sample."""


class CompletionLogprobs:
    """/v1/completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` columns."""

    def entry(self, codec: TextCodec, item: Token, offset: int) -> tuple:
        top = None
        if item.top_logprobs:
            top = {codec.decode([tid]): lp for tid, lp in item.top_logprobs}
        return codec.decode([item.token_id]), item.logprob, top, offset

    def event(self, entry: tuple) -> dict:
        token, logprob, top, _ = entry
        return {"tokens": [token], "token_logprobs": [logprob],
                "top_logprobs": [top] if top is not None else None, "text_offset": [0]}

    def collect(self, entries: list) -> dict:
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}


COMPLETION_LOGPROBS = CompletionLogprobs()


@dataclass(frozen=True, slots=True)
class LocalCancel:
    """Fed into a request's stream by the worker itself (DELETE): end every sample `cancelled`."""

    reason: str = "cancelled"


@dataclass(slots=True)
class Sample:
    detok: Detokenizer
    stops: StopMatcher | None
    parts: list[str] = field(default_factory=list)  # the text so far (non-streaming only)
    tokens: int = 0
    reason: str | None = None  # the client-visible finish reason, once finished
    gpu_done: bool = False  # the GPU process reported this sample's Finish
    logprobs: list | None = None  # per-token logprob entries (non-streaming, when asked for)
    chars: int = 0  # characters of text so far (the logprobs text_offset)


class Generation:
    """Output state of one request with `n` samples."""

    def __init__(self, codec: TextCodec, *, n: int, stop: tuple[str, ...], prompt_tokens: int,
                 arrival: float, encoder: Encoder | None, logprobs: int | None = None,
                 logprob_format: LogprobFormat = COMPLETION_LOGPROBS) -> None:
        """`encoder` writes the route's SSE events (None: not streaming); `logprobs` is the
        request's setting (None: no logprobs objects), shown as `logprob_format` says."""
        self.codec = codec
        self.samples = [Sample(Detokenizer(codec), StopMatcher(stop) if stop else None,
                               logprobs=[] if logprobs is not None else None)
                        for _ in range(n)]
        self.logprob_format = logprob_format
        self.prompt_tokens = prompt_tokens
        self.arrival = arrival
        self.encoder = encoder
        self.want_logprobs = logprobs
        self.error: Error | None = None
        self.queue_ms: float | None = None  # from the GPU process's Finish records
        self.gpu_ttft_ms: float | None = None
        # Seen from the worker (for its latency histograms): first and last token arrival, the
        # longest gap between two arrivals, on the monotonic clock.
        self.worker_ttft_ms: float | None = None
        self.first_token_t = 0.0
        self.last_token_t = 0.0
        self.max_gap_s = 0.0
        self.tokens = 0
        self.unfinished = n  # samples without a client-visible finish
        self.stopped: list[int] = []  # samples a stop string ended, whose GPU rows may still run

    # ------------------------------------------------------------------------------------------
    def consume(self, batch: list) -> list[bytes]:
        """Apply records; returns SSE events (empty when not streaming)."""
        out: list[bytes] = []
        samples = self.samples
        enc = self.encoder
        tokens_before = self.tokens
        for item in batch:
            if self.error is not None:
                break  # the request failed: nothing after its error event is shown
            kind = type(item)
            if kind is Token:
                s = samples[item.index]
                if s.reason is not None:
                    continue  # arrived after a stop string ended the sample; never shown
                s.tokens += 1
                self.tokens += 1
                text = s.detok.push(item.token_id)
                hit = False
                if s.stops is not None:
                    text, hit = s.stops.feed(text)
                lp = self._logprobs(s, item) if self.want_logprobs is not None else None
                if enc is not None:
                    out.append(enc.token(item.index, text, item.token_id, item.logprob, lp))
                elif text:
                    s.parts.append(text)
                    s.chars += len(text)
                if hit:
                    self._finish(s, item.index, "", "stop", out)
                    self.stopped.append(item.index)
            elif kind is Finish:
                s = samples[item.index]
                s.gpu_done = True
                if self.queue_ms is None:
                    self.queue_ms = item.queue_ms
                self.gpu_ttft_ms = item.ttft_ms if self.gpu_ttft_ms is None \
                    else min(self.gpu_ttft_ms, item.ttft_ms)
                if s.reason is not None:
                    continue
                reason = _CLIENT_REASON.get(item.reason)
                if reason is None:  # "error": the GPU process failed this request's row
                    self._fail(Error(code="gpu_error", rid=item.rid, message="the GPU process "
                                     "could not finish this request; retry it"), out)
                else:
                    self._finish(s, item.index, self._tail(s), reason, out)
            elif kind is LocalCancel:
                for i, s in enumerate(samples):
                    if s.reason is None:
                        self._finish(s, i, self._tail(s), "cancelled", out)
            elif kind is Error:
                self._fail(item, out)
        if self.tokens != tokens_before:
            self._arrived()
        return out

    def _arrived(self) -> None:
        """Tokens arrived in this batch: track first-token time and the longest gap."""
        now = time.monotonic()
        if self.worker_ttft_ms is None:
            self.worker_ttft_ms = (time.time() - self.arrival) * 1000.0
            self.first_token_t = now
        elif now - self.last_token_t > self.max_gap_s:
            self.max_gap_s = now - self.last_token_t
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
        return error_object(err.message, err.code, type_=error_type(err.code),
                            extra={"tokens_streamed": self.tokens})

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
        completion = sum(s.tokens for s in self.samples)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def timing(self) -> dict:
        """The GPU process's queue and TTFT times; the worker's TTFT if those never came."""
        ttft = self.gpu_ttft_ms if self.gpu_ttft_ms is not None else self.worker_ttft_ms
        return {"queue_ms": self.queue_ms, "ttft_ms": ttft}

    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, as the client saw the tokens arrive."""
        per_sample = self.tokens / len(self.samples)
        if per_sample <= 1:
            return None
        return (self.last_token_t - self.first_token_t) * 1000.0 / (per_sample - 1)

    def choices(self) -> list[dict]:
        """The /v1/completions choices of a non-streamed request."""
        return [{"index": i, "text": "".join(s.parts), "logprobs": self.sample_logprobs(s),
                 "finish_reason": s.reason} for i, s in enumerate(self.samples)]

    def sample_logprobs(self, s: Sample) -> dict | None:
        """A non-streamed sample's logprobs object, None when the request did not ask for one."""
        return None if s.logprobs is None else self.logprob_format.collect(s.logprobs)

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
        if self.encoder is not None:
            out.append(self.encoder.finish(index, tail, reason))
        elif tail:
            s.parts.append(tail)
            s.chars += len(tail)

    def _logprobs(self, s: Sample, item: Token) -> dict | None:
        """The streamed event's logprobs object; when not streaming, the entry is kept instead."""
        entry = self.logprob_format.entry(self.codec, item, s.chars)  # the offset before this text
        if self.encoder is not None:
            return self.logprob_format.event(entry)
        s.logprobs.append(entry)
        return None
