"""What /v1/messages sends back: Anthropic's `message` object and its stream events, built from the
answer's text as the chat route's parsers read it (`chat/reasoning_parsers.py` for thinking,
`chat/tool_parsers.py` for tool calls).

Content blocks, in the order the model wrote them: `thinking` (`thinking`, an empty `signature`:
ringserve signs nothing), `text`, and `tool_use` (`id` "toolu_...", `name`, `input` the call's
arguments as an object). Whitespace alone between calls is no block; an answer with nothing in it
is one empty text block. `stop_reason`: `tool_use` when the answer called a tool and ended by
itself, `stop_sequence` (with `stop_sequence` the string) when a stop sequence ended it,
`max_tokens` when the token limit or the context did, else `end_turn` (a cancelled answer too).

A stream is: `message_start` (the message, no content yet, its `input_tokens`), `ping`; per block
`content_block_start`, `content_block_delta`... (`text_delta`, `thinking_delta`,
`input_json_delta` with `partial_json`), `content_block_stop`; then `message_delta` (`stop_reason`,
`stop_sequence`, `usage.output_tokens`) and `message_stop`. A failure after the stream began (a
GPU-process restart mid-answer) is an `error` event (`{"type": "error", "error": {"type",
"message"}}`), after which nothing follows. Every event is `event: <type>` + `data: {"type", ...}`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import msgspec

from ringserve.api.chat.tool_output import ParserFactory
from ringserve.api.chat.tool_parsers import Delta, ToolCallParser
from ringserve.api.errors import ApiError
from ringserve.api.generation import Generation
from ringserve.api.request_flow import Output

_enc = msgspec.json.encode
Emit = Callable[[str, dict], None]

# Anthropic's error types by HTTP status (its own 529 "overloaded" is our 503)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(err: ApiError, request_id: str | None) -> dict:
    """An `ApiError` in Anthropic's shape (its message names the field, as the OpenAI shape's
    `param` does)."""
    body: dict = {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
    if request_id:
        body["request_id"] = request_id
    return body


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(reason: str | None, called: bool, stop_sequence: str | None) -> str:
    """Anthropic's `stop_reason` for an answer that ended with the sample's finish `reason`."""
    if reason == "length":
        return "max_tokens"
    if reason == "stop" and called:
        return "tool_use"
    if reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


class ContentBlocks:
    """One answer's content blocks, built from its text (through `parser` when it has tools or a
    reasoning parser); `emit(type, fields)`, when given, hears every stream event."""

    def __init__(self, parser: ToolCallParser | None, emit: Emit | None = None) -> None:
        self.parser = parser
        self.emit = emit
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._arguments = ""  # the open tool_use block's JSON so far
        self._held = ""  # whitespace that may only separate calls: shown once text follows it

    @property
    def called(self) -> bool:
        return self.parser is not None and self.parser.called

    def feed(self, text: str) -> None:
        if text:
            for d in self.parser.feed(text) if self.parser is not None else [Delta(text=text)]:
                self._delta(d)

    def finish(self) -> None:
        for d in self.parser.finish() if self.parser is not None else ():
            self._delta(d)
        if not any(b["type"] != "thinking" for b in self.blocks):
            self._text("text", self._held)  # an answer of whitespace (or nothing) is that text
        self._close()

    def _delta(self, d: Delta) -> None:
        if d.reasoning:
            self._text("thinking", d.text)
        elif d.index is None:
            if self._kind() != "text" and not (self._held + d.text).strip():
                self._held += d.text
                return
            text, self._held = self._held + d.text, ""
            self._text("text", text)
        elif d.id is not None:
            self._close()
            self._held = ""
            self._start({"type": "tool_use", "id": "toolu_" + d.id.removeprefix("call_"), "name": d.name, "input": {}})
            self._arguments = ""
            if d.arguments:
                self._delta(Delta(index=d.index, arguments=d.arguments))
        elif self._kind() == "tool_use" and d.arguments:
            self._arguments += d.arguments
            self._event("content_block_delta", delta={"type": "input_json_delta", "partial_json": d.arguments})

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _text(self, kind: str, text: str) -> None:
        """`text` into the open block of `kind` (text, thinking), opened first when another is."""
        if self._kind() != kind:
            self._close()
            self._start({"type": "text", "text": ""} if kind == "text" else {"type": kind, kind: "", "signature": ""})
        if text and self._open is not None:
            self._open[kind] += text
            self._event("content_block_delta", delta={"type": f"{kind}_delta", kind: text})

    def _start(self, block: dict) -> None:
        self._open = block
        self.blocks.append(block)
        self._event("content_block_start", content_block=msgspec.json.decode(_enc(block)))

    def _close(self) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if block["type"] == "tool_use":
            try:
                block["input"] = msgspec.json.decode(self._arguments or "{}")
            except msgspec.DecodeError:
                block["input"] = {}  # NOTE: a parser only ends a call on JSON it could read
        self._event("content_block_stop", index=self.blocks.index(block))

    def _event(self, kind: str, **fields) -> None:
        if self.emit is not None:
            if "index" not in fields:
                fields = {"index": len(self.blocks) - 1, **fields}
            self.emit(kind, fields)


class MessageShell:
    """What every message object of one request repeats."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.id = new_message_id()
        self.model = model
        self.prompt_tokens = prompt_tokens

    def message(self, content: list[dict], reason: str | None, stop_sequence: str | None, output_tokens: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(output_tokens),
        }

    def usage(self, output_tokens: int) -> dict:
        return {
            "input_tokens": self.prompt_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }


class MessageEventEncoder:
    """The `sse.Encoder` of a streamed /v1/messages request (one answer: choice 0)."""

    USAGE_ON_FINISH = False
    END = b""  # message_stop ends the stream

    def __init__(self, shell: MessageShell, parser: ParserFactory | None) -> None:
        self.shell = shell
        self.blocks = ContentBlocks(parser() if parser is not None else None, self._event)
        self.stop_sequence: str | None = None  # set once the answer is finished (`MessagesOutput`)
        self.reason: str | None = None
        self._out: list[bytes] = []

    def start(self, n: int) -> bytes:
        self._event("message_start", {"message": self.shell.message([], None, None, 0)})
        self._event("ping", {})
        return self._flush()

    def token(self, index, text, token_id, logprob, logprobs=None, usage=None) -> bytes:
        self.blocks.feed(text)
        return self._flush()

    def text(self, index: int, text: str, logprobs: dict | None) -> bytes:
        self.blocks.feed(text)
        return self._flush()

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes:
        self.blocks.feed(text)
        self.blocks.finish()
        self.reason = reason
        return self._flush()

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The end: `message_delta` (stop reason, output tokens) and `message_stop`."""
        reason = stop_reason(self.reason, self.blocks.called, self.stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": self.stop_sequence if reason == "stop_sequence" else None}
        self._event("message_delta", {"delta": delta, "usage": {"output_tokens": usage["completion_tokens"]}})
        self._event("message_stop", {})
        return self._flush()

    def error(self, body: dict) -> bytes:
        err = body["error"]
        kind = "overloaded_error" if err.get("code") == "overloaded" else "api_error"
        self._event("error", {"error": {"type": kind, "message": err["message"]}})
        return self._flush()

    def _event(self, kind: str, fields: dict) -> None:
        self._out.append(b"event: " + kind.encode() + b"\ndata: " + _enc({"type": kind, **fields}) + b"\n\n")

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out


class MessagesOutput:
    """One /v1/messages request's `request_flow.Output`: the stream encoder or the JSON body."""

    def __init__(self, shell: MessageShell, parser: ParserFactory | None) -> None:
        self.shell = shell
        self.parser = parser
        self._encoder: MessageEventEncoder | None = None

    def output(self) -> Output:
        return Output(encoder=self._new_encoder, body=self._body, finished=self._finished)

    def _new_encoder(self, request_id: str, model: str, created: int, include_usage: bool) -> MessageEventEncoder:
        self._encoder = MessageEventEncoder(self.shell, self.parser)
        return self._encoder

    async def _finished(self, request_id: str, gen: Generation) -> None:
        if self._encoder is not None:
            self._encoder.stop_sequence = _matched(gen)

    def _body(self, request_id: str, model: str, gen: Generation) -> dict:
        sample = gen.samples[0]
        blocks = ContentBlocks(self.parser() if self.parser is not None else None)
        blocks.feed("".join(sample.parts))
        blocks.finish()
        matched = _matched(gen)
        reason = stop_reason(sample.reason, blocks.called, matched)
        body = self.shell.message(
            blocks.blocks, reason, matched if reason == "stop_sequence" else None, gen.usage()["completion_tokens"]
        )
        return {**body, "request_id": request_id}  # ringserve's: DELETE /v1/requests/{request_id} cancels it


def _matched(gen: Generation) -> str | None:
    stops = gen.samples[0].stops
    return stops.matched if stops is not None else None
