"""`POST /v1/responses` bodies: decoded with msgspec and validated into a `ResponsesRequest`, which
is then the chat request it stands for (`chat`): /v1/responses is a translation onto the chat
route, not a pipeline of its own (`docs/api.md#post-v1responses`).

Honoured: `model`, `input` (`items.py`), `instructions` (a system message first; not
carried over by `previous_response_id`, as OpenAI does), `tools` (function tools, in the
Responses API's flat shape), `tool_choice`, `parallel_tool_calls` (`chat/tool_calls.py`),
`text.format` (text, json_object, json_schema: structured output, `structured_output.py`),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `store`, `previous_response_id`,
`metadata`, `user`, and every sampling extra of the chat route (`protocol.SamplingBody`: `seed`,
`top_k`, `stop`, the penalties, `structured_outputs`, ...). Accepted and without effect, being
hints: `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier`, `service_tier` auto or
default, and `include` values naming outputs ringserve never produces (reasoning, hosted tools,
images). Accepted only at their neutral values (anything else a 400 naming the field):
`background`, `conversation`, `prompt`, `reasoning`, `truncation` ("disabled"), `top_logprobs`,
`max_tool_calls`, `context_management`, `text.verbosity` ("medium"), chat's `response_format`
(use `text.format`), `n` (1), `prompt_logprobs`. Unknown fields are ignored and named (`body.py`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from ringserve.api.body import decode_body
from ringserve.api.chat.protocol import ChatRequest
from ringserve.api.chat.reasoning import SUMMARIES, check_effort
from ringserve.api.chat.tool_calls import Function, Tool, ToolRequest, parse_tools
from ringserve.api.errors import bad_request, quoted
from ringserve.api.protocol import SamplingBody, SamplingFields, check_max_tokens, check_neutral, parse_sampling
from ringserve.api.responses.items import InputItem, chat_messages, input_items
from ringserve.api.structured_output import format_spec

MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_RESPONSE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
# `include` values that name outputs ringserve never produces: asking for them changes nothing
_NOTHING_TO_INCLUDE = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)


class _TextFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: str
    name: str | None = None
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class _Text(msgspec.Struct, forbid_unknown_fields=True):
    format: _TextFormat | None = None
    verbosity: str | None = None


class _Tool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A Responses API tool: a function's fields sit on the tool itself."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    tools: list[_Tool] | None = None  # a namespace's function tools (Codex groups its agent tools so)


class _ResponsesBody(SamplingBody):
    """The wire shape; types only."""

    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: _Text | None = None
    max_output_tokens: int | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    # hints, accepted without effect
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # accepted at their neutral values only
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    context_management: list | None = None


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated /v1/responses request. `settings` are the fields the response object repeats
    (instructions, tools, tool_choice, text, temperature, ...), `store` whether the client asked
    for the response to be kept."""

    model: str | None
    input: tuple[InputItem, ...]
    instructions: str | None
    max_output_tokens: int | None
    common: SamplingFields
    tools: ToolRequest | None
    store: bool
    previous_response_id: str | None
    settings: dict
    reasoning_effort: str | None = None

    def chat(self, history: tuple[InputItem, ...]) -> ChatRequest:
        """The chat request this is, after the stored conversation `history` (a 400 naming an
        input item it cannot read)."""
        return ChatRequest(
            messages=chat_messages(self.instructions, history, self.input),
            model=self.model,
            max_tokens=self.max_output_tokens,
            common=self.common,
            logprobs=None,
            tools=self.tools,
            reasoning_effort=self.reasoning_effort,
        )


_decoder = msgspec.json.Decoder(_ResponsesBody)


def parse_responses_body(raw: bytes, *, max_tokens_limit: int, on_ignored=lambda names: None) -> ResponsesRequest:
    """Decode and validate a /v1/responses body, raising `ApiError(400)` naming the field;
    `on_ignored(names)` hears of unknown fields first."""
    body, ignored = decode_body(_decoder, raw)
    on_ignored(ignored)
    _check_unsupported(body)
    items = input_items(body.input)
    fmt = body.text.format if body.text is not None else None
    text_spec = format_spec(fmt.type, msgspec.to_builtins(fmt), "text.format", "text.format.schema") if fmt else None
    common = parse_sampling(body)
    if text_spec is not None and common.structured is not None:
        raise bad_request(
            f"set one structured-output constraint, not several (text.format, {common.structured.param}).",
            common.structured.param,
        )
    common = dataclasses.replace(common, structured=text_spec or common.structured)
    check_neutral({"n": (common.n == 1, "1"), "prompt_logprobs": (common.prompt_logprobs is None, "null")})
    chat_tools, hosted = _chat_tools(body.tools)
    on_ignored(hosted)
    tools = parse_tools(chat_tools, _tool_choice(body.tool_choice), body.parallel_tool_calls, function_path="")
    if tools is not None and tools.forced is not None and common.structured is not None:
        raise bad_request(
            f"{common.structured.param} cannot be combined with tool_choice {tools.choice!r}, which forces "
            "the answer's structure itself.",
            common.structured.param,
        )
    max_tokens = None
    if body.max_output_tokens is not None:
        max_tokens = check_max_tokens(body.max_output_tokens, max_tokens_limit, "max_output_tokens")
    if body.previous_response_id is not None and not _RESPONSE_ID.match(body.previous_response_id):
        raise bad_request(
            f"previous_response_id {quoted(body.previous_response_id)} is not a response id.", "previous_response_id"
        )
    _check_metadata(body.metadata)
    settings = _settings(body, common)  # parses `reasoning` once: the response repeats it
    return ResponsesRequest(
        model=body.model,
        input=items,
        instructions=body.instructions,
        max_output_tokens=max_tokens,
        common=common,
        tools=tools,
        store=body.store is not False,  # OpenAI's default: stored
        previous_response_id=body.previous_response_id,
        settings=settings,
        reasoning_effort=settings["reasoning"]["effort"],
    )


def _reasoning(reasoning: dict | None) -> tuple[str | None, str | None]:
    """(effort, summary) of the `reasoning` object; no summary is ever produced (`chat/reasoning.py`)."""
    reasoning = reasoning or {}
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise bad_request(
            f"reasoning.{unknown[0]} is not a field of reasoning (effort, summary).", f"reasoning.{unknown[0]}"
        )
    effort = check_effort(reasoning.get("effort"), "reasoning.effort")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in SUMMARIES:
        raise bad_request(
            f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {quoted(str(summary))}.", "reasoning.summary"
        )
    return effort, summary


def _check_unsupported(body: _ResponsesBody) -> None:
    if body.response_format is not None:
        raise bad_request(
            "response_format is the chat completions field; on /v1/responses send text.format.",
            "response_format",
            code="unsupported_value",
        )
    check_neutral(
        {
            "background": (not body.background, "false"),
            "conversation": (body.conversation is None, "null (send previous_response_id)"),
            "prompt": (body.prompt is None, "null"),
            "truncation": (body.truncation in (None, "disabled"), '"disabled"'),
            "top_logprobs": (not body.top_logprobs, "0"),
            "max_tool_calls": (body.max_tool_calls is None, "null"),
            "context_management": (not body.context_management, "null"),
            "service_tier": (body.service_tier in (None, "auto", "default"), '"auto" or "default"'),
            "text.verbosity": (body.text is None or body.text.verbosity in (None, "medium"), '"medium"'),
        }
    )
    for value in body.include or ():
        if value not in _NOTHING_TO_INCLUDE:
            raise bad_request(
                f"include {quoted(value)} is not supported by ringserve (its responses carry no logprobs, "
                "reasoning or hosted tools' results); leave it out.",
                "include",
                code="unsupported_value",
            )


def _chat_tools(tools: list[_Tool] | None) -> tuple[list[Tool] | None, tuple[str, ...]]:
    """The flat Responses tools as the chat route's (`parse_tools` checks them): a namespace's
    function tools join the others (their calls come back as plain function calls), and hosted
    tools (`web_search`, `file_search`, ...), which ringserve cannot run, are left out; the second
    item names them (`tools[i]`, for x-ringserve-ignored-fields)."""
    if tools is None:
        return None, ()
    out: list[Tool] = []
    hosted: list[str] = []
    for i, t in enumerate(tools):
        members = [(f"tools[{i}].tools[{j}]", m) for j, m in enumerate(t.tools or ())] if t.type == "namespace" else []
        for where, fn in members or [(f"tools[{i}]", t)]:
            if fn.type != "function":
                hosted.append(where)
                continue
            if fn.name is None:
                raise bad_request(f"{where}.name: a function tool needs a name.", f"{where}.name")
            out.append(Tool(type="function", function=Function(fn.name, fn.description, fn.parameters, fn.strict)))
    return (out if out or not hosted else None), tuple(hosted)


def _tool_choice(choice):
    """The Responses API's `{"type": "function", "name"}` as chat's; other objects (hosted tools,
    `allowed_tools`) are refused."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}; ringserve '
        "serves function tools only.",
        "tool_choice",
        code="unsupported_value",
    )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata holds at most {MAX_METADATA} pairs, got {len(metadata)}.", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise bad_request(
                f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                f"{MAX_METADATA_VALUE}; {quoted(key)} is longer.",
                "metadata",
            )


def _settings(body: _ResponsesBody, common: SamplingFields) -> dict:
    """The request's settings as the response object repeats them."""
    fmt = body.text.format if body.text is not None else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": dict(zip(("effort", "summary"), _reasoning(body.reasoning))),
        "service_tier": "default",
        "temperature": common.sampling.temperature,
        "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [msgspec.to_builtins(t) for t in body.tools or ()],
        "top_logprobs": 0,
        "top_p": common.sampling.top_p,
        "truncation": "disabled",
        "user": body.user,
    }
