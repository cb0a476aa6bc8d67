"""A reasoning model's thinking, read out of its answer (`--reasoning-parser`, as vLLM's): the text
between `<think>` and `</think>` is the answer's reasoning, the rest its content, which then goes
through the tool-call parser when the request has tools (tool calls come after the thinking).

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3 thinking-2507): the template opens the
  thinking in the prompt, so the answer is reasoning from its first token up to `</think>` (a
  leading `<think>` the model writes anyway is dropped); an answer that never closes it is all
  reasoning, as vLLM reads it.
- `qwen3` (Qwen3 hybrid models): thinking only when the answer starts with `<think>` (after
  whitespace); otherwise, as with `enable_thinking: false` (the template then writes an empty
  `<think></think>` into the prompt), the whole answer is content.

`ThinkSplitter.feed` returns `(is_reasoning, text)` pieces as the text streams; text that may still
be part of a tag (a prefix of `<think>` at the start, of `</think>` inside the thinking) is held
back until it is known, so no tag ever reaches the client in pieces. An answer forced by a grammar
(a forced `tool_choice`, structured output) has no thinking: the grammar applies from its first
token, so it is read as content whatever the parser.
"""

from __future__ import annotations

from ringserve.api.chat.tool_parsers import Delta, ToolCallParser

REASONING_PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """One answer's text as thinking and content (module docstring)."""

    __slots__ = ("implicit", "state", "held")

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.implicit = parser == "deepseek_r1"  # thinking from the first token, tag or not
        self.state = "start"  # start (nothing known yet), thinking, content
        self.held = ""

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        text = self.held + text
        self.held = ""
        if self.state == "start":
            body = text.lstrip()
            if body.startswith(OPEN):
                self.state, text = "thinking", body[len(OPEN) :]
            elif OPEN.startswith(body):  # whitespace, or the tag so far: not known yet
                self.held = text
                return out
            else:
                self.state = "thinking" if self.implicit else "content"
        if self.state == "thinking":
            end = text.find(CLOSE)
            if end < 0:
                keep = _held_prefix(text, CLOSE)
                self.held, text = text[len(text) - keep :], text[: len(text) - keep]
                return [(True, text)] if text else out
            if end:
                out.append((True, text[:end]))
            self.state, text = "content", text[end + len(CLOSE) :]
        if text:
            out.append((False, text))
        return out

    def finish(self) -> list[tuple[bool, str]]:
        """The answer ended: what is held is what it looks like (a lone prefix of a tag is text)."""
        held, self.held = self.held, ""
        if not held:
            return []
        if self.state == "start":
            return [(self.implicit, held)]
        return [(self.state == "thinking", held)]


class ReasoningThenTools(ToolCallParser):
    """A `ToolCallParser` that reads the thinking first (`Delta.reasoning`) and hands the content
    to `tools` (a tool-call parser, or None: content as it is)."""

    def __init__(self, parser: str, tools: ToolCallParser | None = None) -> None:
        super().__init__()
        self.splitter = ThinkSplitter(parser)
        self.tools = tools

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> list[Delta]:
        return self._read(self.splitter.feed(text))

    def finish(self) -> list[Delta]:
        out = self._read(self.splitter.finish())
        return out + (self.tools.finish() if self.tools is not None else [])

    def _read(self, pieces: list[tuple[bool, str]]) -> list[Delta]:
        out: list[Delta] = []
        for reasoning, text in pieces:
            if reasoning:
                out.append(Delta(text=text, reasoning=True))
            elif self.tools is not None:
                out += self.tools.feed(text)
            else:
                out.append(Delta(text=text))
        return out
