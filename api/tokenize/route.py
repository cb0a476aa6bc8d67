"""vLLM's tokenizer routes: `POST /tokenize` and `POST /detokenize`, same request and response shapes.

/tokenize takes a completion-style `prompt` (special tokens added unless `add_special_tokens` is
false) or chat-style `messages` and `tools` (rendered with the model's template, as
/v1/chat/completions renders them: no special tokens added unless asked), capped like a completion prompt (at most
the context limit of tokens, a longer text refused by its length before it is tokenized), and
answers `{"count", "max_model_len", "tokens"}` (plus `token_strs`, the vocabulary's pieces, with `return_token_strs`). /detokenize
takes `{"tokens": [...]}` and answers `{"prompt": text}`, special tokens included. Neither touches
the GPU process. vLLM's benchmark client aligns its prompts to the server's tokenizer with them.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from ringserve.api.body import decode_body
from ringserve.api.chat.protocol import Message, parse_messages
from ringserve.api.chat.template import ChatTemplateError
from ringserve.api.chat.tool_calls import Tool, parse_tools
from ringserve.api.errors import bad_request
from ringserve.api.prompt_limits import check_fits, min_prompt_tokens, tokenize
from ringserve.api.protocol import check_model, check_neutral, token_ids
from ringserve.api.state import STATE, ignored_header, note_ignored


class _TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool | None = False
    tools: list[Tool] | None = None  # rendered into the prompt as /v1/chat/completions renders them
    # accepted at its neutral value only
    chat_template: str | None = None


class _DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int] | None = None


_tokenize = msgspec.json.Decoder(_TokenizeBody)
_detokenize = msgspec.json.Decoder(_DetokenizeBody)


async def handle_tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body, ignored = decode_body(_tokenize, await request.read())
    note_ignored(request, ignored)
    check_model(body.model, st.model_name, st.model_aliases)
    check_neutral({"chat_template": (body.chat_template is None, "null (the model's own template)")})
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Send exactly one of 'prompt' and 'messages'.", "prompt")
    param = "prompt" if body.prompt is not None else "messages"
    text: str | tuple[str, ...]
    if body.prompt is not None:
        text, special = body.prompt, body.add_special_tokens is not False
    else:
        text, special = _render(st, body), bool(body.add_special_tokens)
    # Capped like a completion prompt: text too long for the context is refused by its length
    # before tokenizing (a 4 MB prompt costs a length check), and so are the ids after it.
    limit = st.config.context_limit
    whole = text if isinstance(text, str) else "".join(text)
    check_fits(min_prompt_tokens(st.codec, whole), 0, limit, at_least=True, param=param)
    ids = await tokenize(
        st.codec, text, executor=st.executor, inline_chars=st.tokenize_inline_chars, add_special_tokens=special
    )
    check_fits(len(ids), 0, limit, param=param)
    out = {"count": len(ids), "max_model_len": st.config.context_limit, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [st.codec.tokenizer.id_to_token(i) for i in ids]
    return _json(request, out)


async def handle_detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body, ignored = decode_body(_detokenize, await request.read())
    note_ignored(request, ignored)
    check_model(body.model, st.model_name, st.model_aliases)
    if body.tokens is None:
        raise bad_request("tokens is required: a list of token ids.", "tokens", code="missing_tokens")
    ids = token_ids(body.tokens, "tokens") if body.tokens else ()
    if ids and max(ids) >= st.codec.vocab_size:
        raise bad_request(f"tokens holds a token id outside the vocabulary (size {st.codec.vocab_size}).", "tokens")
    return _json(request, {"prompt": st.codec.decode(list(ids), skip_special_tokens=False)})


def _render(st, body: _TokenizeBody) -> tuple[str, ...]:
    if st.chat_template is None:
        raise bad_request(
            f"The model {st.model_name!r} has no chat template, so it cannot format messages; send a prompt.",
            "messages",
            code="no_chat_template",
        )
    tools = parse_tools(body.tools, None, None)
    if tools is not None and not st.chat_template.renders_tools:
        raise bad_request(
            f"The chat template of {st.model_name!r} does not render tools.", "tools", code="unsupported_value"
        )
    add_generation = body.add_generation_prompt is not False
    if body.continue_final_message and add_generation:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true.", "continue_final_message"
        )
    try:
        return st.chat_template.render_pieces(
            parse_messages(body.messages),
            add_generation,
            extra=body.chat_template_kwargs or None,
            continue_final_message=bool(body.continue_final_message),
            tools=tools.tools if tools is not None else None,
        )
    except ChatTemplateError as exc:
        raise bad_request(
            f"The model's chat template refused the messages: {exc}", "messages", code="chat_template_error"
        ) from None


def _json(request: web.Request, obj: dict) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json", headers=ignored_header(request))
