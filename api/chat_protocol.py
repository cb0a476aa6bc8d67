"""`POST /v1/chat/completions` bodies: decoded with msgspec, validated into a frozen `ChatRequest`.

The sampling fields are `protocol.SamplingBody`'s, validated by the same `parse_sampling` as
/v1/completions. On top: `messages` (system / user / assistant; content a string or a list of text
parts, joined with newlines as vLLM does for string-content templates), `max_tokens` /
`max_completion_tokens` (unset or null: up to the context limit), `logprobs` + `top_logprobs`,
vLLM's template options (`add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, `add_special_tokens`). OpenAI and vLLM fields we cannot honour (tools,
audio, a request's own template, ...) are accepted only at their neutral values (unset, null,
empty, "none", text); anything else is a 400 that names the field. Unknown fields are ignored
and named (`body.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ringserve.api.body import decode_body
from ringserve.api.errors import bad_request, quoted
from ringserve.api.protocol import (
    MAX_LOGPROBS,
    SamplingBody,
    SamplingFields,
    check_max_tokens,
    check_neutral,
    parse_sampling,
)

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 4096


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    """A content part; only text parts are served (their other keys are ignored and named)."""

    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[_Part] | None = None
    name: str | None = None
    # what an assistant message returned by the API may carry back; accepted when empty
    tool_calls: list | None = None
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
    # accepted only at their neutral values
    echo: bool | None = False
    chat_template: str | None = None
    documents: list | None = None
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
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict | None = None


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
    return ChatRequest(
        messages=messages,
        model=body.model,
        max_tokens=max_tokens,
        common=parse_sampling(body),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        add_special_tokens=bool(body.add_special_tokens),
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message),
        template_kwargs=kwargs,
    )


def _check_unsupported(body: _ChatBody) -> None:
    """No tool calling, structured output, audio or stored completions: only their neutral values."""
    check_neutral(
        {
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
            "echo": not body.echo,
            "chat_template": body.chat_template is None,
            "documents": not body.documents,
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


def parse_messages(messages: list[Message] | None) -> tuple[dict, ...]:
    """Template-ready messages (`role`, `content`, and `name` when given), or a 400."""
    if not messages:
        raise bad_request(
            "messages must be a non-empty list of {role, content} objects.",
            "messages",
            code="missing_messages" if messages is None else "invalid_value",
        )
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"messages holds at most {MAX_MESSAGES} messages, got {len(messages)}.", "messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(m: Message, i: int) -> dict:
    where = f"messages[{i}]"
    if m.role not in ROLES:
        hint = " (use system for developer instructions)" if m.role == "developer" else ""
        raise bad_request(
            f"{where}.role {quoted(m.role)} is not supported; use one of "
            f"{', '.join(ROLES)}{hint}. Tool and function messages need tool "
            "calling, which ringserve does not support.",
            f"{where}.role",
        )
    check_neutral(
        {
            f"{where}.tool_calls": not m.tool_calls,
            f"{where}.function_call": m.function_call is None,
            f"{where}.refusal": not m.refusal,
            f"{where}.audio": m.audio is None,
            f"{where}.annotations": not m.annotations,
        }
    )
    out = {"role": m.role, "content": _content(m.content, where)}
    if m.name is not None:
        out["name"] = m.name
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
