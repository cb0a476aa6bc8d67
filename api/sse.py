"""Server-sent event bytes for a streaming completion, built for the per-token hot path.

Every per-token event has the same shape, so the constant parts (id, created, model, request id)
are encoded once per request and each event is a `bytes.join` of those pieces with the token's
text, index, id and logprob; only the text and the logprob go through the JSON encoder.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

_enc = msgspec.json.encode
DONE = b"data: [DONE]\n\n"
_INDEX = [str(i).encode() for i in range(64)]


class Encoder(Protocol):
    """What a route's SSE encoder provides (`EventEncoder` here, `chat_output.ChatEventEncoder`)."""

    def start(self, n: int) -> bytes:
        """Bytes before the first token (may be empty)."""

    def token(self, index: int, text: str, token_id: int, logprob: float,
              logprobs: dict | None = None) -> bytes: ...

    def finish(self, index: int, text: str, reason: str) -> bytes: ...

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The event after every sample finished (may be empty)."""

    def error(self, body: dict) -> bytes: ...


class EventEncoder:
    """Encodes one /v1/completions request's events: token, finish, usage, error."""

    __slots__ = ("request_id", "model", "created", "_head", "_tail_head")

    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self._head = (b'data: {"id":' + _enc(request_id) + b',"object":"text_completion","created":'
                      + _enc(created) + b',"model":' + _enc(model) + b',"choices":[{"index":')
        self._tail_head = b',"request_id":' + _enc(request_id) + b',"index":'

    def start(self, n: int) -> bytes:
        """No preamble: the first event already carries the first token."""
        return b""

    def token(self, index: int, text: str, token_id: int, logprob: float,
              logprobs: dict | None = None) -> bytes:
        """`{"id","object","created","model","choices":[{"index","text","logprobs","finish_reason":null}],
        "request_id","index","text","token_id","logprob"}`"""
        t = _enc(text)
        idx = _INDEX[index] if index < 64 else str(index).encode()
        return b"".join((self._head, idx, b',"text":', t, b',"logprobs":',
                         b"null" if logprobs is None else _enc(logprobs),
                         b',"finish_reason":null}]', self._tail_head, idx, b',"text":', t,
                         b',"token_id":', _INDEX[0] if token_id == 0 else str(token_id).encode(),
                         b',"logprob":', _enc(logprob), b"}\n\n"))

    def finish(self, index: int, text: str, reason: str) -> bytes:
        """A sample's last choices event: any text still held back, and its finish_reason."""
        return self._event({"id": self.request_id, "object": "text_completion",
                            "created": self.created, "model": self.model,
                            "choices": [{"index": index, "text": text, "logprobs": None,
                                         "finish_reason": reason}],
                            "request_id": self.request_id, "index": index, "text": text,
                            "finish_reason": reason})

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The event after every sample finished: `"choices":[]`, usage and timing."""
        return self._event({"id": self.request_id, "object": "text_completion",
                            "created": self.created, "model": self.model, "choices": [],
                            "request_id": self.request_id, "usage": usage, "timing": timing})

    def error(self, body: dict) -> bytes:
        """An error in the middle of a stream (e.g. the GPU process restarted): OpenAI's error object."""
        return self._event({**body, "request_id": self.request_id})

    @staticmethod
    def _event(obj: dict) -> bytes:
        return b"data: " + _enc(obj) + b"\n\n"
