"""What /v1/chat/completions sends back for a request with tools: the answer split into content and
`tool_calls` by the choice's parser (`tool_parsers.py`), streamed as `delta.tool_calls[]` pieces
(the first piece of a call carries its `index`, `id`, `type` and `function.name`, the later ones
`function.arguments` fragments) and answered as `message.tool_calls`, with `finish_reason:
"tool_calls"` when the answer called a tool and was not cut short. Logprobs ride only on content
chunks (text held back as a possible call carries none).

With `--reasoning-parser` the same encoder and body carry a reasoning model's thinking
(`reasoning_parsers.py`): streamed as `delta.reasoning` (and `delta.reasoning_content`, vLLM's
older name, which clients still read), answered as `message.reasoning` and
`message.reasoning_content` (null when the answer did not think), its content `null` when the
answer was all thinking."""

from __future__ import annotations

from collections.abc import Callable

from ringserve.api.chat.output import ChatEventEncoder, chat_body
from ringserve.api.chat.reasoning_parsers import ReasoningThenTools
from ringserve.api.chat.tool_parsers import Delta, ToolCallParser, parse_all
from ringserve.api.generation import Generation

ParserFactory = Callable[[], ToolCallParser]


def _reason(parser: ToolCallParser, reason: str) -> str:
    return "tool_calls" if parser.called and reason == "stop" else reason


class ToolChatEncoder(ChatEventEncoder):
    """`ChatEventEncoder` with each choice's text run through its tool-call parser."""

    __slots__ = ("_new_parser", "_parsers")

    def __init__(
        self, request_id: str, model: str, created: int, include_usage: bool = False, *, parser: ParserFactory
    ) -> None:
        super().__init__(request_id, model, created, include_usage)
        self._new_parser = parser
        self._parsers: dict[int, ToolCallParser] = {}

    def _parser(self, index: int) -> ToolCallParser:
        p = self._parsers.get(index)
        if p is None:
            p = self._parsers[index] = self._new_parser()
        return p

    def token(self, index, text, token_id, logprob, logprobs=None, usage=None) -> bytes:
        deltas = self._parser(index).feed(text)
        return b"".join(self._delta(index, d, logprobs) for d in deltas)

    def finish(self, index: int, text: str, reason: str, usage: dict | None, timing: dict) -> bytes:
        parser = self._parser(index)
        deltas = (parser.feed(text) if text else []) + parser.finish()
        head = b"".join(self._delta(index, d, None) for d in deltas)
        return head + super().finish(index, "", _reason(parser, reason), usage, timing)

    def _delta(self, index: int, d: Delta, logprobs: dict | None) -> bytes:
        if d.reasoning:
            delta = {"reasoning": d.text, "reasoning_content": d.text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            return self._chunk([choice], index=index) if d.text else b""
        if d.index is None:
            return self.text(index, d.text, logprobs) if d.text else b""
        call: dict = {"index": d.index}
        if d.id is not None:
            call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments})
        else:
            call["function"] = {"arguments": d.arguments}
        choice = {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        return self._chunk([choice], index=index)


def tool_chat_body(parser: ParserFactory, request_id: str, model: str, gen: Generation) -> dict:
    """The `chat.completion` body, each choice's answer split into reasoning, content and tool
    calls."""
    body = chat_body(request_id, model, gen)
    for choice in body["choices"]:
        p = parser()
        reasoning, content, calls = parse_all(p, choice["message"]["content"])
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message.update(content=content.strip() or None, tool_calls=calls)
            choice["finish_reason"] = _reason(p, choice["finish_reason"])
        if isinstance(p, ReasoningThenTools):
            message.update(reasoning=reasoning, reasoning_content=reasoning)
            if reasoning is not None and not content:
                message["content"] = None
        choice["message"] = message
    return body
