"""`POST /v1/messages` (Anthropic's Messages API) bodies, validated into the chat request they stand
for: like /v1/responses, a translation onto the chat route, not a pipeline of its own
(`docs/api.md#post-v1messages`).

Honoured: `model`, `max_tokens` (required, as Anthropic requires it; a cap, held to the room the
context leaves), `messages` (user and assistant turns, and system messages between them; `content` a string or blocks: `text`, `tool_use` on an assistant turn,
`tool_result` on a user turn, which becomes a tool message; `thinking` and `redacted_thinking`
blocks are accepted and left out of the prompt, as thinking models' templates leave earlier turns'
thinking out), `system` (a string or text blocks: a system message first), `tools` (custom tools:
`name`, `description`, `input_schema`), `tool_choice` (`auto`, `any` = chat's `required`, `tool`
= a named function, `none`; `disable_parallel_tool_use`), `stop_sequences`, `temperature`,
`top_p`, `top_k`, `stream`, `thinking` (`enabled` / `disabled`: the template variable
`enable_thinking` where the template reads it), and chat's sampling extras (`seed`, ...).
Accepted without effect: `metadata` (`user_id`), `service_tier`, a block's `cache_control` and
`citations`; server tools (`web_search_...`, which ringserve does not run) are left out and named
as ignored. Images, documents and MCP servers are a 400 naming them. Unknown fields are ignored and named in `x-ringserve-ignored-fields`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from msgspec import structs

from ringserve.api.body import decode_body
from ringserve.api.chat.protocol import AssistantToolCall, CalledFunction, ChatRequest, Message, check_count
from ringserve.api.chat.protocol import parse_messages as parse_chat_messages
from ringserve.api.chat.tool_calls import Function, Tool, parse_tools
from ringserve.api.errors import bad_request, quoted
from ringserve.api.protocol import SamplingBody, check_max_tokens, parse_sampling

THINKING = ("enabled", "disabled", "adaptive")
ROLES = ("user", "assistant", "system")


class Block(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Any content block (the fields of every kind; which apply depends on `type`)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: object = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    cache_control: dict | None = None  # hints, no effect
    citations: list | None = None


class Turn(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[Block]


class CustomTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    input_schema: dict | None = None
    description: str | None = None
    type: str | None = None  # "custom" or unset; a server tool names its own type
    cache_control: dict | None = None


class _MessagesBody(SamplingBody, forbid_unknown_fields=True):
    max_tokens: int | None = None
    messages: list[Turn] | None = None
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    thinking: dict | None = None
    service_tier: str | None = None
    mcp_servers: list | None = None
    container: str | dict | None = None


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated /v1/messages request: the chat request it is, and what only this route reads."""

    chat: ChatRequest
    stream: bool
    thinking: bool | None  # the `thinking` setting: True enabled, False disabled, None unset

    @property
    def model(self) -> str | None:
        return self.chat.model


_decoder = msgspec.json.Decoder(_MessagesBody)


def parse_messages_body(
    raw: bytes, *, max_tokens_limit: int, on_ignored=lambda names: None, count_only: bool = False
) -> MessagesRequest:
    """Decode and validate a /v1/messages body (`count_only`: a count_tokens body, which has no
    `max_tokens`), raising `ApiError(400)` naming the field; `on_ignored(names)` hears of unknown
    fields first."""
    body, ignored = decode_body(_decoder, raw)
    on_ignored(ignored)
    if body.mcp_servers:
        raise bad_request(
            "mcp_servers are not supported: ringserve runs no MCP client.", "mcp_servers", "unsupported_value"
        )
    if body.container is not None:
        raise bad_request("container is not supported: ringserve runs no code.", "container", "unsupported_value")
    max_tokens = None
    if not count_only:
        if body.max_tokens is None:
            raise bad_request("max_tokens is required.", "max_tokens", code="missing_max_tokens")
        # NOTE: a cap (`ChatRequest.max_tokens_is_cap`): held to the server's limit, not refused by it
        wanted = min(body.max_tokens, max_tokens_limit) if max_tokens_limit else body.max_tokens
        max_tokens = check_max_tokens(wanted, max_tokens_limit, "max_tokens")
    if body.stop is not None:
        raise bad_request("stop is the OpenAI field; on /v1/messages send stop_sequences.", "stop", "unsupported_value")
    sampling_body = structs.replace(body, stop=body.stop_sequences, stream_options=None)
    common = parse_sampling(sampling_body)
    messages = _chat_messages(body.system, body.messages)
    chat_tools, choice, parallel, server_tools = _chat_tools(body.tools, body.tool_choice)
    on_ignored(server_tools)
    tools = parse_tools(chat_tools, choice, parallel, function_path="")
    thinking = _thinking(body.thinking)
    prefilled = body.messages is not None and body.messages[-1].role == "assistant"
    chat = ChatRequest(
        messages=messages,
        model=body.model,
        max_tokens=max_tokens,
        common=common,
        logprobs=None,
        # NOTE: a last assistant turn is the start of the answer (Anthropic's prefill), continued
        add_generation_prompt=not prefilled,
        continue_final_message=prefilled,
        template_kwargs={"enable_thinking": thinking} if thinking is not None else None,
        tools=tools,
        max_tokens_is_cap=True,
    )
    return MessagesRequest(chat=chat, stream=bool(body.stream), thinking=thinking)


def _thinking(value: dict | None) -> bool | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in THINKING:
        raise bad_request(
            f"thinking.type must be one of {', '.join(THINKING)}, got {quoted(str(kind))}.", "thinking.type"
        )
    return kind != "disabled"


def _chat_messages(system: str | list[Block] | None, turns: list[Turn] | None) -> tuple[dict, ...]:
    """The conversation as the chat route's messages: the system prompt first, each tool_result a
    tool message, each tool_use a call of the assistant turn it is in."""
    check_count(turns, "turns")
    out: list[Message] = []
    if system is not None:
        text = _texts_of(system, "system")
        if text:
            out.append(Message(role="system", content=text))
    for i, turn in enumerate(turns or ()):
        where = f"messages[{i}]"
        if turn.role not in ROLES:
            raise bad_request(
                f"{where}.role must be user, assistant or system, got {quoted(turn.role)}.", f"{where}.role"
            )
        if turn.role == "system":  # a system message between turns (Claude Code sends reminders so)
            out.append(Message(role="system", content=_texts_of(turn.content, f"{where}.content")))
            continue
        if isinstance(turn.content, str):
            out.append(Message(role=turn.role, content=turn.content))
            continue
        texts: list[str] = []
        calls: list[AssistantToolCall] = []
        for j, block in enumerate(turn.content):
            at = f"{where}.content[{j}]"
            kind = block.type
            if kind == "text" and block.text is not None:
                texts.append(block.text)
            elif kind in ("thinking", "redacted_thinking") and turn.role == "assistant":
                continue
            elif kind == "tool_use" and turn.role == "assistant":
                if block.id is None or block.name is None:
                    raise bad_request(f"{at}: a tool_use block has an id, a name and an input.", at)
                args = msgspec.json.encode(block.input if block.input is not None else {}).decode()
                calls.append(AssistantToolCall(function=CalledFunction(block.name, args), id=block.id))
            elif kind == "tool_result" and turn.role == "user":
                if block.tool_use_id is None:
                    raise bad_request(f"{at}: a tool_result block has a tool_use_id.", f"{at}.tool_use_id")
                result = block.content if block.content is not None else ""
                text = _texts_of(result, f"{at}.content")
                if block.is_error:
                    text = f"Error: {text}"
                out.append(Message(role="tool", content=text, tool_call_id=block.tool_use_id))
            else:
                raise bad_request(
                    f"{at}.type {quoted(kind)} is not supported on a {turn.role} turn; ringserve serves text-only "
                    "models and reads text, tool_use (assistant), tool_result (user) and thinking blocks.",
                    f"{at}.type",
                    code="unsupported_value",
                )
        if texts or calls or not turn.content:
            out.append(
                Message(
                    role=turn.role, content="\n".join(texts) if texts or not calls else None, tool_calls=calls or None
                )
            )
    return parse_chat_messages(out)


def _texts_of(content: str | list[Block], where: str) -> str:
    return content if isinstance(content, str) else _texts(content, where)


def _texts(blocks: list[Block], where: str) -> str:
    """Text blocks joined as one text, or a 400 naming the first other block."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"{where}[{j}] must be a text block; ringserve serves text-only models.",
                f"{where}[{j}].type",
                code="unsupported_value",
            )
        texts.append(block.text)
    return "\n".join(texts)


def _chat_tools(
    tools: list[CustomTool] | None, choice: dict | None
) -> tuple[list[Tool] | None, object, bool | None, tuple[str, ...]]:
    """(tools, tool_choice, parallel_tool_calls) as the chat route reads them, and the server tools
    (`web_search_...`, which ringserve does not run) left out, named `tools[i]`."""
    custom: list[Tool] = []
    server: list[str] = []
    for i, t in enumerate(tools or ()):
        if t.type not in (None, "custom"):
            server.append(f"tools[{i}]")
            continue
        schema = t.input_schema if t.input_schema is not None else {"type": "object"}
        custom.append(Tool(type="function", function=Function(t.name, t.description, schema)))
    chat_tools = custom or ([] if tools is not None and not server else None)
    if choice is None:
        return chat_tools, None, None, tuple(server)
    kind = choice.get("type")
    parallel = None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return chat_tools, kind, parallel, tuple(server)
    if kind == "any":
        return chat_tools, "required", parallel, tuple(server)
    if kind == "tool" and isinstance(choice.get("name"), str):
        return chat_tools, {"type": "function", "function": {"name": choice["name"]}}, parallel, tuple(server)
    raise bad_request(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}.',
        "tool_choice",
    )
