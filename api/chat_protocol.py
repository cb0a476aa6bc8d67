"""`POST /v1/chat/completions` bodies: decoded with msgspec, validated into a frozen `ChatRequest`.

The sampling fields are `protocol.SamplingBody`'s, validated by the same `parse_sampling` as
/v1/completions. On top: `messages` (system / user / assistant; content a string or a list of text
parts, joined with newlines as vLLM does for string-content templates), `max_tokens` /
`max_completion_tokens` (unset: up to the context limit), `logprobs` + `top_logprobs`,
`stream_options.include_usage`. OpenAI fields we cannot honour (tools, response formats, audio,
...) are accepted only at their neutral values (unset, null, empty, "none", text); anything else
is a 400 that names the field, never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ringserve.api.errors import bad_request
from ringserve.api.protocol import (MAX_LOGPROBS, SamplingBody, SamplingFields, check_max_tokens,
                                    check_neutral, decode_body, parse_sampling)

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 4096


class _Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    # what an assistant message returned by the API may carry back; accepted when empty
    tool_calls: list | None = None
    function_call: dict | None = None
    refusal: str | None = None
    audio: dict | None = None
    annotations: list | None = None


class _ChatBody(SamplingBody):
    """The wire shape; types only."""

    messages: list[_Message] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # accepted only at their neutral values
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    store: bool | None = None
    metadata: dict | None = None
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
    include_usage: bool


_decoder = msgspec.json.Decoder(_ChatBody)


def parse_chat_body(raw: bytes, *, max_tokens_limit: int) -> ChatRequest:
    """Decode and validate a chat request body, raising `ApiError(400)` naming the field."""
    body = decode_body(_decoder, raw)
    _check_unsupported(body)
    messages = _messages(body.messages)
    max_tokens = _max_tokens(body, max_tokens_limit)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got "
                              f"{body.top_logprobs}.", "top_logprobs")
    options = body.stream_options
    if options is not None and options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported by ringserve; "
                          "leave it unset or false.", "stream_options", code="unsupported_value")
    return ChatRequest(messages=messages, model=body.model, max_tokens=max_tokens,
                       common=parse_sampling(body),
                       logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                       include_usage=options is not None and options.include_usage)


def _check_unsupported(body: _ChatBody) -> None:
    """No tool calling, structured output, audio or stored completions: only their neutral values."""
    check_neutral({
        "tools": not body.tools,
        "tool_choice": body.tool_choice in (None, "none"),
        "functions": not body.functions,
        "function_call": body.function_call in (None, "none"),
        "response_format": body.response_format is None or body.response_format == {"type": "text"},
        "modalities": body.modalities in (None, ["text"]),
        "audio": body.audio is None,
        "prediction": body.prediction is None,
        "reasoning_effort": body.reasoning_effort is None,
        "store": not body.store,
        "metadata": not body.metadata,
        "service_tier": body.service_tier in (None, "auto", "default"),
        "web_search_options": body.web_search_options is None,
    })


def _max_tokens(body: _ChatBody, limit: int) -> int | None:
    given = [(name, v) for name, v in (("max_completion_tokens", body.max_completion_tokens),
                                       ("max_tokens", body.max_tokens)) if v is not None]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise bad_request("max_tokens and max_completion_tokens differ; send one of them "
                          "(max_tokens is the older name).", "max_tokens")
    if not given:
        return None
    return check_max_tokens(given[0][1], limit, given[0][0])


def _messages(messages: list[_Message] | None) -> tuple[dict, ...]:
    if not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects.",
                          "messages", code="missing_messages" if messages is None else "invalid_value")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages holds at most {MAX_MESSAGES} messages, got {len(messages)}.",
                          "messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(m: _Message, i: int) -> dict:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        hint = " (use system for developer instructions)" if m.role == "developer" else ""
        raise bad_request(f"{where}.role {m.role!r} is not supported; use one of "
                          f"{', '.join(ROLES)}{hint}. Tool and function messages need tool "
                          "calling, which ringserve does not support.", f"{where}.role")
    check_neutral({f"{where}.tool_calls": not m.tool_calls,
                   f"{where}.function_call": m.function_call is None,
                   f"{where}.refusal": not m.refusal,
                   f"{where}.audio": m.audio is None,
                   f"{where}.annotations": not m.annotations})
    out = {"role": m.role, "content": _content(m.content, where)}
    if m.name is not None:
        out["name"] = m.name
    return out


def _content(content: str | list[dict] | None, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise bad_request(f"{where}.content must be a string or a list of text parts.",
                          f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise bad_request(f"{where}.content[{j}].type {kind!r} is not supported: ringserve "
                              "serves text-only models; send text parts.", f"{where}.content[{j}].type")
        text = part.get("text")
        if not isinstance(text, str) or set(part) - {"type", "text"}:
            raise bad_request(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": "
                              "string}.", f"{where}.content[{j}]")
        texts.append(text)
    return "\n".join(texts)
