"""Server-sent event bytes for a streaming completion, built for the per-token hot path.

Every per-token event has the same shape, so the constant parts (id, created, model, request id)
are encoded once per request and each event is a `bytes.join` of those pieces with the token's
text, index, id and logprob; only the text and the logprob go through the JSON encoder.

A stream is: an event per token per choice (the echoed prompt first, with `echo`), an event per
choice with its `finish_reason` (carrying ringserve's `usage` of that choice and the request's
`timing`), the `"choices": []` usage event only when `stream_options.include_usage` is true (as
vLLM and OpenAI send it: a client's `chunk.choices[0]` never fails otherwise), then `[DONE]`.
With `continuous_usage_stats`, every choice event carries that choice's usage so far.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

_enc = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
_INDEX = [str(i).encode() for i in range(64)]


class Encoder(Protocol):
    """What a route's SSE encoder provides (`EventEncoder` here, `chat_output.ChatEventEncoder`)."""

    USAGE_ON_FINISH: bool  # the finish event carries the choice's usage even without continuous stats
    END: bytes  # what ends the stream after its last event ([DONE]; /v1/responses sends nothing)

    def start(self, n: int) -> bytes:
        """Bytes before the first token (may be empty)."""

    def token(
        self,
        index: int,
        text: str,
        token_id: int,
        logprob: float,
        logprobs: dict | None = None,
        usage: dict | None = None,
    ) -> bytes: ...

    def text(self, index: int, text: str, logprobs: dict | None) -> bytes:
        """A choice's text that is not a generated token (the echoed prompt)."""

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes: ...

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The event after every sample finished (empty unless the client asked for usage)."""

    def error(self, body: dict) -> bytes: ...


class EventEncoder:
    """Encodes one /v1/completions request's events: token, text, finish, usage, error. A route with
    another chunk shape (`chat_output.ChatEventEncoder`) changes the object name, how a token's
    text sits in its choice, and the events built from dicts."""

    OBJECT = "text_completion"
    # ringserve's `usage` of the choice on its finish event (chat sends usage only at the end, as
    # OpenAI does: LangChain adds up every usage it sees, `chat/output.py`)
    USAGE_ON_FINISH = True
    END = DONE
    _TEXT_OPEN = b',"text":'  # a token's text in its choice ...
    _TEXT_CLOSE = b',"logprobs":'  # ... and what follows it

    __slots__ = ("request_id", "model", "created", "include_usage", "_head", "_tail_head")

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self._head = (
            b'data: {"id":'
            + _enc(request_id)
            + b',"object":'
            + _enc(self.OBJECT)
            + b',"created":'
            + _enc(created)
            + b',"model":'
            + _enc(model)
            + b',"choices":[{"index":'
        )
        self._tail_head = b',"request_id":' + _enc(request_id) + b',"index":'

    def start(self, n: int) -> bytes:
        """No preamble: the first event already carries the first token."""
        return b""

    def token(
        self,
        index: int,
        text: str,
        token_id: int,
        logprob: float,
        logprobs: dict | None = None,
        usage: dict | None = None,
    ) -> bytes:
        """`{"id","object","created","model","choices":[{"index","text","logprobs","finish_reason":null}],
        "request_id","index","text","token_id","logprob"[,"usage"]}`, spliced from bytes: the hot path."""
        t = _enc(text)
        idx = _INDEX[index] if index < 64 else str(index).encode()
        return b"".join(
            (
                self._head,
                idx,
                self._TEXT_OPEN,
                t,
                self._TEXT_CLOSE,
                b"null" if logprobs is None else _enc(logprobs),
                b',"finish_reason":null}]',
                self._tail_head,
                idx,
                b',"text":',
                t,
                b',"token_id":',
                _INDEX[0] if token_id == 0 else str(token_id).encode(),
                b',"logprob":',
                _enc(logprob),
                b"}\n\n" if usage is None else b',"usage":' + _enc(usage) + b"}\n\n",
            )
        )

    def text(self, index: int, text: str, logprobs: dict | None) -> bytes:
        """A choices event with text that is not a generated token (the echoed prompt)."""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return self._chunk([choice], index=index, text=text)

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes:
        """A sample's last choices event: any text still held back, its finish_reason, and (our
        own fields, which OpenAI clients ignore) its usage and the request's timing."""
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        extra = {"usage": usage} if usage is not None else {}
        return self._chunk([choice], index=index, text=text, finish_reason=reason, **extra, timing=timing)

    def usage(self, usage: dict, timing: dict) -> bytes:
        """With `include_usage`, the event after every sample finished: `"choices":[]`, usage
        and timing; otherwise nothing."""
        if not self.include_usage:
            return b""
        return self._chunk([], usage=usage, timing=timing)

    def error(self, body: dict) -> bytes:
        """An error in the middle of a stream (e.g. the GPU process restarted): OpenAI's error object."""
        return b"data: " + _enc({**body, "request_id": self.request_id}) + b"\n\n"

    def _chunk(self, choices: list, **extra) -> bytes:
        head = {"id": self.request_id, "object": self.OBJECT, "created": self.created, "model": self.model}
        return b"data: " + _enc({**head, "choices": choices, "request_id": self.request_id, **extra}) + b"\n\n"
