"""What /v1/responses sends back: the `response` object, its output items, and the typed stream
events of OpenAI's Responses API, built from the answer's text as the chat route's tool-call
parser splits it (`chat/tool_parsers.py`).

Output items: a `reasoning` item (one `reasoning_text` part, no summary) for a reasoning model's
thinking (`--reasoning-parser`, `chat/reasoning_parsers.py`), a `message` (`output_text` part) for
the answer's text, a `function_call` (`call_id`, `name`, `arguments`) for each call, in the order
the model wrote them. Whitespace
alone between calls is no message; an answer with neither text nor calls is one empty message.
The same `OutputItems` builds a streamed answer (emitting events as it goes) and a whole one, so
both have the same items.

A stream is: `response.created`, `response.in_progress`; per message `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` (a reasoning item the same, with
`response.reasoning_text.delta` and `.done`); per call
`response.output_item.added`, `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, `response.output_item.done`; then
`response.completed`, or `response.incomplete` (max_output_tokens reached, or cancelled by
DELETE), or `response.failed` (a GPU-process restart mid-answer, with its error code). Every
event is `event: <type>` + `data: {"type", "sequence_number", ...}`, numbered from 0; no
`[DONE]` follows (OpenAI sends none).

Status: `completed` when the answer ended by itself; `incomplete` with `incomplete_details.reason`
`max_output_tokens` when it was cut by the token limit, `cancelled` when cancelled; `failed` with
`error` when it failed. Usage: `input_tokens`, `output_tokens`, `total_tokens` (cached and
reasoning tokens are not counted: 0).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.chat.tool_output import ParserFactory
from ringserve.api.chat.tool_parsers import Delta, ToolCallParser
from ringserve.api.generation import Generation
from ringserve.api.request_flow import Output

_enc = msgspec.json.encode
Emit = Callable[[str, dict], None]


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class ResponseShell:
    """What every response object of one request repeats: its id, the model, and the request's
    settings (`ResponsesRequest.settings`, with `store` as the server honours it)."""

    id: str
    model: str
    settings: dict

    def response(
        self,
        request_id: str,
        created_at: int,
        status: str,
        output: list[dict],
        *,
        usage: dict | None = None,
        error: dict | None = None,
        incomplete: dict | None = None,
    ) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            **self.settings,
            "usage": usage,
            "request_id": request_id,  # ringserve's: DELETE /v1/requests/{request_id} cancels it
        }


def status_of(reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of an answer that ended with the sample's finish `reason`."""
    if reason == "stop":
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if reason == "length" else reason or "cancelled"}


def responses_usage(usage: dict) -> dict:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


# The two kinds of text item: its id prefix, the type of its one part, and the events of its text
# (`<event>.delta`, `<event>.done`)
_TEXT_ITEMS = {
    "message": ("msg_", "output_text", "response.output_text"),
    "reasoning": ("rs_", "reasoning_text", "response.reasoning_text"),
}


class OutputItems:
    """One answer's output items, built from its text (through `parser` when it has tools or a
    reasoning parser); `emit(type, fields)`, when given, hears every stream event as the items
    change."""

    def __init__(self, parser: ToolCallParser | None, emit: Emit | None = None) -> None:
        self.parser = parser
        self.emit = emit
        self.items: list[dict] = []  # closed and open, in output order
        self._message: dict | None = None  # the open message item
        self._reasoning: dict | None = None  # the open reasoning item
        self._call: dict | None = None  # the open function call item
        self._held = ""  # whitespace that may only separate calls: shown once text follows it

    def feed(self, text: str) -> None:
        if text:
            for d in self.parser.feed(text) if self.parser is not None else [Delta(text=text)]:
                self._delta(d)

    def finish(self, reason: str | None) -> None:
        """The answer ended: close what is open (`incomplete` items when it was cut short)."""
        for d in self.parser.finish() if self.parser is not None else ():
            self._delta(d)
        status = "completed" if reason == "stop" else "incomplete"
        self._close_call(status)
        self._close_reasoning(status)
        if not any(i["type"] != "reasoning" for i in self.items):
            self._text(self._held)  # an answer of whitespace (or nothing) is that message
        self._close_message(status)

    # -- deltas --------------------------------------------------------------------------------
    def _delta(self, d: Delta) -> None:
        if d.reasoning:
            if d.text:
                self._reasoning = self._append(self._reasoning, "reasoning", d.text)
            return
        self._close_reasoning("completed")
        if d.index is None:
            if not d.text:
                return
            self._close_call("completed")
            if self._message is None and not (self._held + d.text).strip():
                self._held += d.text
                return
            self._text(d.text)
        elif d.id is not None:
            self._close_message("completed")
            self._close_call("completed")
            self._held = ""
            self._open_call(d)
        elif self._call is not None and d.arguments:
            self._call["arguments"] += d.arguments
            self._event(
                "response.function_call_arguments.delta",
                item_id=self._call["id"],
                output_index=len(self.items) - 1,
                delta=d.arguments,
            )

    def _text(self, text: str) -> None:
        """Text of the answer's message (opened by its first text)."""
        text, self._held = self._held + text, ""
        self._message = self._append(self._message, "message", text)

    def _append(self, item: dict | None, kind: str, text: str) -> dict:
        """`text` added to the open text item of `kind` (message, reasoning), opened first when
        `item` is None; the open item."""
        prefix, part_type, event = _TEXT_ITEMS[kind]
        if item is None:
            own: dict = {"role": "assistant"} if kind == "message" else {"summary": []}
            item = {"id": _item_id(prefix), "type": kind, "status": "in_progress", **own, "content": []}
            self.items.append(item)
            index = len(self.items) - 1
            self._event("response.output_item.added", output_index=index, item=_copy(item))
            part: dict = {"type": part_type, "text": ""}
            if kind == "message":
                part.update(annotations=[], logprobs=[])
            item["content"].append(part)
            self._event("response.content_part.added", **self._where(item), part=_copy(part))
        if text:
            item["content"][0]["text"] += text
            extra: dict = {"logprobs": []} if kind == "message" else {}
            self._event(event + ".delta", **self._where(item), delta=text, **extra)
        return item

    def _close_message(self, status: str) -> None:
        message, self._message = self._message, None
        self._close_text(message, status)

    def _close_reasoning(self, status: str) -> None:
        reasoning, self._reasoning = self._reasoning, None
        self._close_text(reasoning, status)

    def _close_text(self, item: dict | None, status: str) -> None:
        """Close a text item (message, reasoning) if there is one."""
        if item is None:
            return
        part, where = item["content"][0], self._where(item)
        extra: dict = {"logprobs": []} if item["type"] == "message" else {}
        self._event(_TEXT_ITEMS[item["type"]][2] + ".done", **where, text=part["text"], **extra)
        self._event("response.content_part.done", **where, part=_copy(part))
        item["status"] = status
        self._event("response.output_item.done", output_index=where["output_index"], item=_copy(item))

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def _open_call(self, d: Delta) -> None:
        call = self._call = {
            "id": _item_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": d.id,
            "name": d.name,
            "arguments": "",
        }
        self.items.append(call)
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(call))
        if d.arguments:
            self._delta(Delta(index=d.index, arguments=d.arguments))

    def _close_call(self, status: str) -> None:
        call, self._call = self._call, None
        if call is None:
            return
        index = self.items.index(call)
        self._event(
            "response.function_call_arguments.done",
            item_id=call["id"],
            output_index=index,
            name=call["name"],
            arguments=call["arguments"],
        )
        call["status"] = status
        self._event("response.output_item.done", output_index=index, item=_copy(call))

    def _event(self, kind: str, **fields) -> None:
        if self.emit is not None:
            self.emit(kind, fields)


def _copy(item: dict) -> dict:
    """An item as an event shows it now (the item itself keeps changing)."""
    return msgspec.json.decode(_enc(item))


class ResponseEventEncoder:
    """The `sse.Encoder` of a streamed /v1/responses request (one answer: choice 0)."""

    USAGE_ON_FINISH = False
    END = b""  # the terminal event ends the stream

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        include_usage: bool = False,
        *,
        shell: ResponseShell,
        parser: ParserFactory | None,
    ) -> None:
        self.request_id = request_id
        self.created = created
        self.shell = shell
        self.items = OutputItems(parser() if parser is not None else None, self._event)
        self.final: dict | None = None  # the finished response object (`ResponseOutput.finished`)
        self._seq = 0
        self._out: list[bytes] = []

    def start(self, n: int) -> bytes:
        for kind in ("response.created", "response.in_progress"):
            self._event(kind, {"response": self._snapshot("in_progress")})
        return self._flush()

    def token(self, index, text, token_id, logprob, logprobs=None, usage=None) -> bytes:
        self.items.feed(text)
        return self._flush()

    def text(self, index: int, text: str, logprobs: dict | None) -> bytes:
        self.items.feed(text)
        return self._flush()

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes:
        self.items.feed(text)
        self.items.finish(reason)
        return self._flush()

    def usage(self, usage: dict, timing: dict) -> bytes:
        """The terminal event: `response.completed` or `response.incomplete`."""
        final = self.final
        if final is None:
            raise RuntimeError("a finished response stream has its response object")
        self._event(
            "response.completed" if final["status"] == "completed" else "response.incomplete", {"response": final}
        )
        return self._flush()

    def error(self, body: dict) -> bytes:
        """`response.failed`: the output so far and the error (its code, e.g. gpu_process_restart)."""
        err = body["error"]
        error = {"code": err["code"], "message": err["message"], "tokens_streamed": err.get("tokens_streamed")}
        self._event("response.failed", {"response": self._snapshot("failed", error=error)})
        return self._flush()

    def _snapshot(self, status: str, **extra) -> dict:
        return self.shell.response(self.request_id, self.created, status, _copy_list(self.items.items), **extra)

    def _event(self, kind: str, fields: dict) -> None:
        data = _enc({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        self._out.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    def _flush(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out


def _copy_list(items: list[dict]) -> list[dict]:
    return [_copy(i) for i in items]


class ResponseOutput:
    """One /v1/responses request's `request_flow.Output`: the stream encoder or the JSON body,
    and, once the answer is finished, its response object, handed to `keep` (the store) before
    the client gets it."""

    def __init__(
        self,
        shell: ResponseShell,
        parser: ParserFactory | None,
        keep: Callable[[dict, list[dict]], Awaitable[None]] | None = None,
    ) -> None:
        self.shell = shell
        self.parser = parser
        self.keep = keep
        self.final: dict | None = None
        self._encoder: ResponseEventEncoder | None = None

    def output(self) -> Output:
        return Output(encoder=self._new_encoder, body=self._body, finished=self._finished)

    def _new_encoder(self, request_id: str, model: str, created: int, include_usage: bool) -> ResponseEventEncoder:
        self._encoder = ResponseEventEncoder(
            request_id, model, created, include_usage, shell=self.shell, parser=self.parser
        )
        return self._encoder

    async def _finished(self, request_id: str, gen: Generation) -> None:
        sample = gen.samples[0]
        if self._encoder is not None:
            items = self._encoder.items
        else:
            items = OutputItems(self.parser() if self.parser is not None else None)
            items.feed("".join(sample.parts))
            items.finish(sample.reason)
        status, incomplete = status_of(sample.reason)
        self.final = self.shell.response(
            request_id,
            int(gen.arrival),
            status,
            items.items,
            usage=responses_usage(gen.usage()),
            incomplete=incomplete,
        )
        if self.keep is not None:
            await self.keep(self.final, items.items)
        if self._encoder is not None:
            self._encoder.final = self.final

    def _body(self, request_id: str, model: str, gen: Generation) -> dict:
        if self.final is None:
            raise RuntimeError("a finished response has its response object")
        return self.final
