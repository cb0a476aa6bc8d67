"""What a model wrote, as content and tool calls: one incremental parser per choice, fed the
answer's text as it is detokenized (the same parser runs over the whole text of a non-streamed
answer), as vLLM's `--tool-call-parser` plugins do.

- `hermes` (Qwen 2.5/3, Hermes, and the ChatML tools template ringserve ships for SmolLM2):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, text around
  them is content. A call left open at the end is still a call when its JSON parses.
- `llama3_json` (Llama 3.1+ JSON tool calls): an answer that starts with `{` (after an optional
  `<|python_tag|>`) is one or more `{"name": ..., "parameters": {...}}` objects separated by `;`;
  any other answer is content.
- `forced`: the answer is the JSON the grammar forced for `tool_choice` (`tool_calls.py`): a
  named function's arguments (streamed as they come), or for `required` an array of
  `{"name", "parameters"}` (each call sent once its element is complete).

Each `feed(text)` / `finish()` returns `Delta`s: content text, or a piece of call `index` (its
first piece carries the id and name, later ones argument fragments), which is exactly what the
openai SDK's stream accumulator expects. Text that may still turn out to be part of a call (a
prefix of `<tool_call>`) is held back until it is known not to be. A call's JSON is read and its
arguments written again by `json_text.py` (numbers as written; `NaN` is not JSON, so no call;
a lone surrogate stays its escape), so what a call carries is always JSON a client can decode.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

from ringserve.api import json_text

PARSERS = ("hermes", "llama3_json")
_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True, slots=True)
class Delta:
    """Content text (`index` None), or a piece of tool call `index`: its `id` and `name` on the
    first piece, then `arguments` fragments; `reasoning` text is the thinking of a reasoning
    model (`reasoning_parsers.py`), not content."""

    text: str = ""
    reasoning: bool = False
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallParser:
    """Base: counts calls; subclasses split text into content and calls."""

    def __init__(self) -> None:
        self.calls = 0

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        raise NotImplementedError

    def _call(self, name: str, arguments) -> list[Delta]:
        """A whole call: its header, then its arguments as one fragment."""
        index = self.calls
        self.calls += 1
        args = arguments if isinstance(arguments, str) else json_text.dumps(arguments)
        return [Delta(index=index, id=call_id(), name=name), Delta(index=index, arguments=args)]


def _as_call(obj, arguments_key: str) -> tuple[str, object] | None:
    """(name, arguments) of a parsed call object, None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json_text.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class HermesParser(ToolCallParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE) :]
                self._inside = False
                out += self._body(body)
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                if start:
                    out.append(Delta(text=self._buf[:start]))
                self._buf = self._buf[start + len(self.OPEN) :]
                self._inside = True
                continue
            keep = _partial_suffix(self._buf, self.OPEN)
            if len(self._buf) > keep:
                out.append(Delta(text=self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            return out

    def _body(self, body: str) -> list[Delta]:
        try:
            call = _as_call(json_text.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:  # not a call after all: what the model wrote is content
            return [Delta(text=self.OPEN + body + self.CLOSE)]
        return self._call(*call)

    def finish(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        if not self._inside:
            return [Delta(text=buf)] if buf else []
        self._inside = False
        try:
            call = _as_call(json_text.loads(buf), "arguments")
        except ValueError:
            call = None
        return self._call(*call) if call is not None else [Delta(text=self.OPEN + buf)]


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls"

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "content":
            return [Delta(text=text)] if text else []
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG) :].lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            self._mode = "calls" if head.startswith("{") else "content"
            if self._mode == "content":
                buf, self._buf = self._buf, ""
                return [Delta(text=buf)]
        return []

    def finish(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        if self._mode == "content" or not buf.strip():
            return [Delta(text=buf)] if buf else []
        text = buf.strip().removeprefix(self.TAG)
        calls = []
        for part in _json_values(text, separators=";"):
            call = _as_call(part, "parameters")
            if call is None:
                return [Delta(text=buf)]
            calls.append(call)
        if not calls:
            return [Delta(text=buf)]
        out: list[Delta] = []
        for name, args in calls:
            out += self._call(name, args)
        return out


class NamedParser(ToolCallParser):
    """`tool_choice` names a function: the whole answer is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        out = []
        if not self.calls:
            self.calls = 1
            out.append(Delta(index=0, id=call_id(), name=self.name))
        if text:
            out.append(Delta(index=0, arguments=text))
        return out

    def finish(self) -> list[Delta]:
        return self.feed("") if not self.calls else []


class RequiredParser(ToolCallParser):
    """`tool_choice: required`: the answer is `[{"name": ..., "parameters": {...}}, ...]`; each
    call goes out when its element is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._scan = _ElementScanner()

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for element in self._scan.feed(text):
            try:
                call = _as_call(json_text.loads(element), "parameters")
            except ValueError:
                call = None
            if call is not None:
                out += self._call(*call)
        return out

    def finish(self) -> list[Delta]:
        return []


class _ElementScanner:
    """Splits a JSON array arriving in pieces into the text of its complete top-level elements."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.current: list[str] = []

    def feed(self, text: str) -> list[str]:
        done: list[str] = []
        for ch in text:
            if self.in_string:
                self.current.append(ch)
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch in "[{":
                self.depth += 1
                if self.depth == 1:
                    continue  # the array itself
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 0:
                    continue
            elif ch == "," and self.depth == 1:
                done.append("".join(self.current))
                self.current = []
                continue
            elif ch == '"':
                self.in_string = True
            if self.depth >= 1:
                self.current.append(ch)
            if self.depth == 1 and ch == "}" and self.current:
                done.append("".join(self.current))
                self.current = []
        return [d for d in (e.strip() for e in done) if d]


def _json_values(text: str, separators: str) -> list:
    """The JSON values in `text`, one after another, between optional separator characters; []
    when anything else is there."""
    out, i = [], 0
    while i < len(text):
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            break
        try:
            value, i = json_text.raw_decode(text, i)
        except ValueError:
            return []
        out.append(value)
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def make_parser(kind: str, *, named: str | None = None) -> ToolCallParser:
    """The parser of one choice: `hermes` / `llama3_json` for `tool_choice: auto`; `required`, or
    `named` (the function) for a forced choice."""
    if named is not None:
        return NamedParser(named)
    if kind == "required":
        return RequiredParser()
    if kind == "llama3_json":
        return Llama3JsonParser()
    return HermesParser()


def parse_all(parser: ToolCallParser, text: str) -> tuple[str | None, str, list[dict]]:
    """A non-streamed answer: (its reasoning, None when it has none; its content; its tool calls as
    OpenAI's message objects)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict] = []
    for d in parser.feed(text) + parser.finish():
        if d.reasoning:
            reasoning.append(d.text)
        elif d.index is None:
            content.append(d.text)
        elif d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return ("".join(reasoning) if reasoning else None), "".join(content), calls
