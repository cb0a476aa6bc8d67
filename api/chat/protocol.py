"""`POST /v1/chat/completions` bodies: decoded with msgspec, validated into a frozen `ChatRequest`.

The sampling fields are `protocol.SamplingBody`'s, validated by the same `parse_sampling` as
/v1/completions (structured output included). On top: `messages` (system, developer, user,
assistant, tool; content a string or a list of text parts, joined with newlines as vLLM does for
string-content templates; an assistant's content may be null, and it may carry `tool_calls`; a
tool message names its `tool_call_id`), `tools` / `tool_choice` / `parallel_tool_calls`
(`tool_calls.py`), `max_tokens` / `max_completion_tokens` (unset or null: up to the context
limit), `logprobs` + `top_logprobs`, vLLM's template options (`add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `add_special_tokens`), and OpenAI's `store` and
`metadata` (accepted; nothing is stored). OpenAI and vLLM fields we cannot honour (legacy
`functions`, audio, a request's own template, ...) are accepted only at their neutral values
(unset, null, empty, "none", text); anything else is a 400 that names the field. Unknown fields
are ignored and named (`body.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.body import decode_body
from ringserve.api.chat.reasoning import check_effort
from ringserve.api.chat.tool_calls import Tool, ToolRequest, parse_tools
from ringserve.api.errors import bad_request, quoted
from ringserve.api.protocol import (
    MAX_LOGPROBS,
    SamplingBody,
    SamplingFields,
    check_max_tokens,
    check_neutral,
    parse_sampling,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    """A content part; only text parts are served (their other keys are ignored and named)."""

    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict = "{}"


class AssistantToolCall(msgspec.Struct, forbid_unknown_fields=True):
    """An assistant message's tool call, as the API returned it."""

    function: CalledFunction
    id: str | None = None
    type: str = "function"


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls (its content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # what an assistant message returned by the API may carry back; accepted when empty
    function_call: dict | None = None
    refusal: str | None = None
    audio: dict | None = None
    annotations: list | None = None


class _ChatBody(SamplingBody):
    """The wire shape; types only."""

    messages: list[Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_special_tokens: bool | None = False  # the template writes BOS and the turn markers
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None  # extra variables for the model's template
    # tool calling (`tool_calls.py`)
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's stored completions: accepted, nothing is stored (docs/api.md)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # accepted only at their neutral values
    echo: bool | None = False
    chat_template: str | None = None
    documents: list | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    web_search_options: dict | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated chat request. `messages` are template-ready dicts (`role`, `content`, and
    `name` when given); `max_tokens` None means up to the context limit; `logprobs` is the number
    of top alternatives per token (None: no logprobs object)."""

    messages: tuple[dict, ...]
    model: str | None
    max_tokens: int | None
    common: SamplingFields
    logprobs: int | None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None
    tools: ToolRequest | None = None  # None: no tools, or tool_choice none
    reasoning_effort: str | None = None  # `reasoning.py`: a template variable where the template reads it
    # max_tokens is a cap, held to the room the context leaves (Anthropic's clients send a fixed
    # one, e.g. Claude Code's 32,000, whatever the model's context), not a 400 when it does not fit
    max_tokens_is_cap: bool = False


_decoder = msgspec.json.Decoder(_ChatBody)


def parse_chat_body(
    raw: bytes, *, max_tokens_limit: int, on_ignored: Callable[[tuple[str, ...]], None] = lambda names: None
) -> ChatRequest:
    """Decode and validate a chat request body, raising `ApiError(400)` naming the field;
    `on_ignored(names)` hears of unknown fields first."""
    body, ignored = decode_body(_decoder, raw)
    on_ignored(ignored)
    _check_unsupported(body)
    messages = parse_messages(body.messages)
    max_tokens = _max_tokens(body, max_tokens_limit)
    if body.top_logprobs is not None:
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}.", "top_logprobs"
            )
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(set add_generation_prompt to false).",
            "continue_final_message",
        )
    kwargs = body.chat_template_kwargs or None
    if kwargs is not None and not all(
        isinstance(k, str) and k.isidentifier() and not k.startswith("_") for k in kwargs
    ):
        raise bad_request(
            "chat_template_kwargs keys must be identifiers not starting with '_'.", "chat_template_kwargs"
        )
    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    common = parse_sampling(body)
    if tools is not None and tools.forced is not None and common.structured is not None:
        raise bad_request(
            f"{common.structured.param} cannot be combined with tool_choice {tools.choice!r}, which forces "
            "the answer's structure itself.",
            common.structured.param,
        )
    if body.metadata is not None and len(body.metadata) > 16:
        raise bad_request(f"metadata holds at most 16 pairs, got {len(body.metadata)}.", "metadata")
    return ChatRequest(
        messages=messages,
        model=body.model,
        max_tokens=max_tokens,
        common=common,
        tools=tools,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        add_special_tokens=bool(body.add_special_tokens),
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=kwargs,
        reasoning_effort=check_effort(body.reasoning_effort, "reasoning_effort"),
    )


def _check_unsupported(body: _ChatBody) -> None:
    """No legacy function calling, audio or predictions: only their neutral values."""
    check_neutral(
        {
            "functions": (not body.functions, "null (send tools)"),
            "function_call": (body.function_call in (None, "none"), '"none" (send tool_choice)'),
            "modalities": (body.modalities in (None, ["text"]), '["text"]'),
            "audio": (body.audio is None, "null"),
            "prediction": (body.prediction is None, "null"),
            "service_tier": (body.service_tier in (None, "auto", "default"), '"auto" or "default"'),
            "web_search_options": (body.web_search_options is None, "null"),
            "echo": (not body.echo, "false"),
            "chat_template": (body.chat_template is None, "null (the model's own template)"),
            "documents": (not body.documents, "null"),
        }
    )


def _max_tokens(body: _ChatBody, limit: int) -> int | None:
    given = [
        (name, v)
        for name, v in (("max_completion_tokens", body.max_completion_tokens), ("max_tokens", body.max_tokens))
        if v is not None
    ]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise bad_request(
            "max_tokens and max_completion_tokens differ; send one of them (max_tokens is the older name).",
            "max_tokens",
        )
    if not given:
        return None
    return check_max_tokens(given[0][1], limit, given[0][0])


def check_count(messages: list | None, noun: str = "messages") -> None:
    """A 400 unless `messages` (a route's conversation: messages, turns) holds 1 to MAX_MESSAGES."""
    if not messages:
        raise bad_request(
            f"messages must be a non-empty list of {{role, content}} {'objects' if noun == 'messages' else noun}.",
            "messages",
            code="missing_messages" if messages is None else "invalid_value",
        )
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages holds at most {MAX_MESSAGES} {noun}, got {len(messages)}.", "messages")


def parse_messages(messages: list[Message] | None) -> tuple[dict, ...]:
    """Template-ready messages (`role`, `content`, and `name` when given), or a 400."""
    check_count(messages)
    return tuple(_message(m, i) for i, m in enumerate(messages or ()))


def _message(m: Message, i: int) -> dict:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        raise bad_request(
            f"{where}.role {quoted(m.role)} is not supported; use one of {', '.join(ROLES)}.", f"{where}.role"
        )
    check_neutral(
        {
            f"{where}.function_call": (m.function_call is None, "null (send tool_calls)"),
            f"{where}.refusal": (not m.refusal, "null"),
            f"{where}.audio": (m.audio is None, "null"),
            f"{where}.annotations": (not m.annotations, "null"),
        }
    )
    if m.tool_calls and m.role != "assistant":
        raise bad_request(f"{where}.tool_calls: only an assistant message carries tool calls.", f"{where}.tool_calls")
    if m.role == "tool" and m.tool_call_id is None:
        raise bad_request(f"{where}.tool_call_id: a tool message names the call it answers.", f"{where}.tool_call_id")
    # an assistant message may have no content (it called tools, or was cut): the template gets ""
    content = "" if m.content is None and m.role == "assistant" else _content(m.content, where)
    out: dict = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [_template_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _template_call(call: AssistantToolCall) -> dict:
    """A tool call as chat templates read it: arguments as an object where they parse as one
    (transformers' convention; vLLM does the same), else the string as sent."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    out: dict = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _content(content: str | list[_Part] | None, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise bad_request(f"{where}.content must be a string or a list of text parts.", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"{where}.content[{j}].type {quoted(part.type)} is not supported: ringserve "
                "serves text-only models; send text parts.",
                f"{where}.content[{j}].type",
            )
        if part.text is None:
            raise bad_request(
                f'{where}.content[{j}] must be {{"type": "text", "text": string}}.', f"{where}.content[{j}]"
            )
        texts.append(part.text)
    return "\n".join(texts)
