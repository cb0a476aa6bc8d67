"""What `/v1/chat/completions` sends back: `chat.completion.chunk` events, the `chat.completion`
body, and OpenAI's chat logprobs shape.

A stream is: one chunk per choice with the role (`delta: {"role": "assistant", "content": ""}`),
one chunk per token (`delta: {"content": text}`), one chunk per choice with its `finish_reason`,
then the usage chunk (`"choices": []`) only when `stream_options.include_usage` is true, then
`[DONE]`. Usage comes only on that last chunk, as OpenAI and vLLM send it: LangChain
(`stream_usage=True`) adds up the usage of every chunk, and counted it twice when the finishing
chunk carried it too. ringserve's own fields ride along: `request_id`, `index`, `text`,
`token_id` and `logprob` on token chunks, `timing` on finish chunks and the usage chunk; with
`continuous_usage_stats` every choice chunk, the finishing one included, carries the choice's
usage so far.
"""

from __future__ import annotations

from ringserve.api.generation import Generation
from ringserve.api.logprobs import LOGPROB_FLOOR, token_text
from ringserve.api.sse import EventEncoder
from ringserve.api.tokenizer import TextCodec


class ChatLogprobs:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`"""

    __slots__ = ("tokens_as_ids",)

    def __init__(self, tokens_as_ids: bool = False) -> None:
        self.tokens_as_ids = tokens_as_ids

    def entry(
        self,
        codec: TextCodec,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        want: int,
        offset: int,
    ) -> tuple[dict, int]:
        alternatives = [self._token(codec, tid, lp) for tid, lp in (top or ())[:want]]
        return {**self._token(codec, token_id, logprob), "top_logprobs": alternatives}, 0

    def event(self, entries: list) -> dict:
        return {"content": entries}

    collect = event

    def _token(self, codec: TextCodec, token_id: int, logprob: float | None) -> dict:
        table = codec.byte_table
        raw = table[token_id] if table is not None and 0 <= token_id < len(table) else None
        text = token_text(codec, token_id, self.tokens_as_ids)
        return {
            "token": text,
            "logprob": max(logprob, LOGPROB_FLOOR) if logprob is not None else None,
            "bytes": list(raw if raw is not None else codec.token_text(token_id).encode()),
        }


CHAT_LOGPROBS = ChatLogprobs()


class ChatEventEncoder(EventEncoder):
    """Encodes one chat request's SSE chunks: a token's text is the choice's `delta.content`."""

    OBJECT = "chat.completion.chunk"
    USAGE_ON_FINISH = False  # usage comes once, on the usage chunk (or on every chunk when continuous)
    _TEXT_OPEN = b',"delta":{"content":'
    _TEXT_CLOSE = b'},"logprobs":'

    __slots__ = ()

    def start(self, n: int) -> bytes:
        """The first chunk of every choice: the assistant role, no text yet."""
        return b"".join(
            self._chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            for i in range(n)
        )

    def text(self, index: int, text: str, logprobs: dict | None) -> bytes:
        """Content that is not a generated token."""
        return self._chunk(
            [{"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}],
            index=index,
            text=text,
        )

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes:
        """A choice's last chunk: any text still held back, its finish_reason, and (our own
        fields) the request's timing, and the choice's usage with `continuous_usage_stats`."""
        delta = {"content": text} if text else {}
        extra = {"usage": usage} if usage is not None else {}
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
            index=index,
            finish_reason=reason,
            **extra,
            timing=timing,
        )


def chat_body(request_id: str, model: str, gen: Generation) -> dict:
    """The `chat.completion` body of a non-streamed request."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(s.parts)},
            "logprobs": gen.sample_logprobs(s),
            "finish_reason": s.reason,
        }
        for i, s in enumerate(gen.samples)
    ]
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(gen.arrival),
        "model": model,
        "choices": choices,
        "usage": gen.usage(),
        "timing": gen.timing(),
        "request_id": request_id,
    }
    if gen.show_prompt_logprobs is not None:  # vLLM's field, on the response
        body["prompt_logprobs"] = gen.prompt_logprobs(0)
    return body
