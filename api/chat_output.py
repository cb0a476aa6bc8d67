"""What `/v1/chat/completions` sends back: `chat.completion.chunk` events, the `chat.completion`
body, and OpenAI's chat logprobs shape.

A stream is: one chunk per choice with the role (`delta: {"role": "assistant", "content": ""}`),
one chunk per token (`delta: {"content": text}`), one chunk per choice with its `finish_reason`,
then the usage chunk (`"choices": []`) only when `stream_options.include_usage` is true, then
`[DONE]`. ringserve's own fields ride along as on /v1/completions: `request_id`, `index`, `text`,
`token_id` and `logprob` on token chunks, `timing` on finish and usage chunks.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from ringserve.api.generation import Generation
from ringserve.api.tokenizer import TextCodec
from ringserve.shm.messages import Token

_enc = msgspec.json.encode


class ChatLogprobs:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`"""

    def entry(self, codec: TextCodec, item: Token, offset: int) -> dict:
        top = [_token_logprob(codec, tid, lp) for tid, lp in item.top_logprobs or ()]
        return {**_token_logprob(codec, item.token_id, item.logprob), "top_logprobs": top}

    def event(self, entry: dict) -> dict:
        return {"content": [entry]}

    def collect(self, entries: list) -> dict:
        return {"content": entries}


CHAT_LOGPROBS = ChatLogprobs()


def _token_logprob(codec: TextCodec, token_id: int, logprob: float) -> dict:
    table = codec.byte_table
    raw = table[token_id] if table is not None and 0 <= token_id < len(table) else None
    text = codec.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(raw if raw is not None else text.encode())}


class ChatEventEncoder:
    """Encodes one chat request's SSE chunks (the interface of `sse.EventEncoder`)."""

    __slots__ = ("request_id", "model", "created", "include_usage", "timing", "_head", "_tail_head")

    def __init__(self, request_id: str, model: str, created: int, timing: Callable[[], dict], *,
                 include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.timing = timing
        self._head = (b'data: {"id":' + _enc(request_id) + b',"object":"chat.completion.chunk",'
                      b'"created":' + _enc(created) + b',"model":' + _enc(model)
                      + b',"choices":[{"index":')
        self._tail_head = b',"request_id":' + _enc(request_id) + b',"index":'

    def start(self, n: int) -> bytes:
        """The first chunk of every choice: the assistant role, no text yet."""
        return b"".join(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                        for i in range(n))

    def token(self, index: int, text: str, token_id: int, logprob: float,
              logprobs: dict | None = None) -> bytes:
        t = _enc(text)
        idx = str(index).encode()
        return b"".join((self._head, idx, b',"delta":{"content":', t, b'},"logprobs":',
                         b"null" if logprobs is None else _enc(logprobs),
                         b',"finish_reason":null}]', self._tail_head, idx, b',"text":', t,
                         b',"token_id":', str(token_id).encode(), b',"logprob":', _enc(logprob),
                         b"}\n\n"))

    def finish(self, index: int, text: str, reason: str) -> bytes:
        """A choice's last chunk: any text still held back, and its finish_reason."""
        delta = {"content": text} if text else {}
        return self._chunk([{"index": index, "delta": delta, "logprobs": None,
                             "finish_reason": reason}],
                           index=index, finish_reason=reason, timing=self.timing())

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The usage chunk, only when the client asked for it (`stream_options.include_usage`)."""
        if not self.include_usage:
            return b""
        return self._chunk([], usage=usage, timing=timing)

    def error(self, body: dict) -> bytes:
        """An error in the middle of a stream (e.g. the GPU process restarted): OpenAI's error object."""
        return b"data: " + _enc({**body, "request_id": self.request_id}) + b"\n\n"

    def _chunk(self, choices: list, **extra) -> bytes:
        return b"data: " + _enc({"id": self.request_id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.model, "choices": choices,
                                 "request_id": self.request_id, **extra}) + b"\n\n"


def chat_body(request_id: str, model: str, gen: Generation) -> dict:
    """The `chat.completion` body of a non-streamed request."""
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(s.parts)},
                "logprobs": gen.sample_logprobs(s), "finish_reason": s.reason}
               for i, s in enumerate(gen.samples)]
    return {"id": request_id, "object": "chat.completion", "created": int(gen.arrival),
            "model": model, "choices": choices, "usage": gen.usage(), "timing": gen.timing(),
            "request_id": request_id}
