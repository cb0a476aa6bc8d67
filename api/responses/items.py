"""The Responses API's conversation items as chat messages: the translation that lets
/v1/responses run on the chat route's machinery (`docs/api.md#post-v1responses`).

An `InputItem` is one of:
- a message (`type` "message" or unset): `role` user, assistant, system or developer, `content` a
  string or a list of text parts (`input_text`, `output_text`, or a `refusal`'s text; joined with
  newlines as chat joins its parts); an assistant's is what a response returned;
- a `function_call` (`call_id`, `name`, `arguments`): a call the model made, which joins the
  assistant message before it (a response's output is a message, then its calls);
- a `function_call_output` (`call_id`, `output`, a string or text parts): the tool's answer, a
  `tool` message.
- a `reasoning` item (a reasoning model's thinking, as a response returned it): accepted and left
  out of the prompt, as thinking models' templates leave earlier turns' thinking out.
Any other item (`item_reference`, hosted tools' calls) or content part (images, files, audio) is
a 400 naming it. A response's output items are items of the same kind, so a
stored conversation is its input items plus its output, and `previous_response_id` continues it.
"""

from __future__ import annotations

import msgspec

from ringserve.api.chat.protocol import MAX_MESSAGES, AssistantToolCall, CalledFunction, Message, parse_messages
from ringserve.api.errors import bad_request, quoted

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    logprobs: list | None = None


class InputItem(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Any input item (the fields of all three kinds; which apply depends on `type`)."""

    type: str | None = None
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    summary: list | None = None  # a reasoning item's
    encrypted_content: str | None = None  # a reasoning item's (ringserve never sends one)


def input_items(value: str | list[InputItem] | None) -> tuple[InputItem, ...]:
    """The request's `input`: a string is one user message."""
    if value is None or value == []:
        raise bad_request(
            "input must be a string or a non-empty list of items (messages, function_call, function_call_output).",
            "input",
            code="missing_input" if value is None else "invalid_value",
        )
    if isinstance(value, str):
        return (InputItem(type="message", role="user", content=value),)
    if len(value) > MAX_MESSAGES:
        raise bad_request(f"input holds at most {MAX_MESSAGES} items, got {len(value)}.", "input")
    return tuple(value)


def chat_messages(
    instructions: str | None, history: tuple[InputItem, ...], items: tuple[InputItem, ...]
) -> tuple[dict, ...]:
    """Template-ready chat messages: the instructions as a system message, then the stored
    conversation `history` (a previous response's) and this request's `items`, or a 400 naming the
    item (`input[i]`)."""
    count = len(history) + len(items) + (instructions is not None)
    if count > MAX_MESSAGES:
        raise bad_request(
            f"a conversation holds at most {MAX_MESSAGES} items (the instructions count as one); with the "
            f"previous response's this one would hold {count}. Start a new conversation.",
            "previous_response_id" if history else "input",
        )
    messages: list[Message] = [Message(role="system", content=instructions)] if instructions is not None else []
    for i, item in enumerate((*history, *items)):
        _add(messages, item, f"input[{i - len(history)}]")
    return parse_messages(messages)


def _add(messages: list[Message], item: InputItem, where: str) -> None:
    kind = item.type or "message"
    if kind == "message":
        if item.role not in ROLES:
            raise bad_request(
                f"{where}.role {quoted(str(item.role))} is not supported; use one of {', '.join(ROLES)}.",
                f"{where}.role",
            )
        messages.append(Message(role=item.role, content=_text(item.content, f"{where}.content")))
    elif kind == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            raise bad_request(f"{where}: a function_call has a call_id, a name and arguments.", where)
        call = AssistantToolCall(function=CalledFunction(item.name, item.arguments), id=item.call_id)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or ()), call]  # the calls of that assistant turn
        else:
            messages.append(Message(role="assistant", content=None, tool_calls=[call]))
    elif kind == "reasoning":
        return
    elif kind == "function_call_output":
        if item.call_id is None or item.output is None:
            raise bad_request(f"{where}: a function_call_output has a call_id and an output.", where)
        messages.append(Message(role="tool", content=_text(item.output, f"{where}.output"), tool_call_id=item.call_id))
    else:
        raise bad_request(
            f"{where}.type {quoted(kind)} is not supported; ringserve reads messages, function_call, "
            "function_call_output and reasoning items.",
            f"{where}.type",
            code="unsupported_value",
        )


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise bad_request(f"{where} must be a string or a list of text parts.", where)
    texts = []
    for j, part in enumerate(content):
        text = part.refusal if part.type == "refusal" else part.text if part.type in _TEXT_PARTS else None
        if text is None:
            raise bad_request(
                f"{where}[{j}] must be a text part ({', '.join(_TEXT_PARTS)} with its text); ringserve serves "
                "text-only models.",
                f"{where}[{j}].type" if part.type not in (*_TEXT_PARTS, "refusal") else f"{where}[{j}]",
                code="unsupported_value",
            )
        texts.append(text)
    return "\n".join(texts)


def encode_items(items: tuple[InputItem, ...], output: list[dict]) -> bytes:
    """A conversation as stored: its items, then a response's output items."""
    return msgspec.json.encode([*items, *output])


def decode_items(raw: bytes) -> tuple[InputItem, ...]:
    return tuple(msgspec.json.decode(raw, type=list[InputItem]))
