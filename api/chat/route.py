"""`POST /v1/chat/completions`: validate, render the messages with the model's chat template,
tokenize, then submit and stream SSE or answer one JSON body (`request_flow.run`), exactly as
/v1/completions does from there on (admission, fairness, cancel, slow reader, stop strings,
restart errors, metrics).

The answer ends at the template's end-of-turn token (added to the request's stop token ids unless
`ignore_eos` asks for a fixed length). Without `max_tokens` the answer may run to the context limit
(capped by the server's `--max-tokens-limit` when one is set).

With `tools` the template renders them, a forced `tool_choice` constrains the answer with a
grammar (`tool_calls.py`), and the answer goes out through the tool-call parser
(`tool_output.py`); structured output (`response_format`, ...) is a grammar as on /v1/completions.
"""

from __future__ import annotations

from functools import partial

import msgspec
from aiohttp import web

from ringserve.api.chat.output import ChatEventEncoder, ChatLogprobs, chat_body
from ringserve.api.chat.protocol import ChatRequest, parse_chat_body
from ringserve.api.chat.reasoning import template_variables
from ringserve.api.chat.reasoning_parsers import ReasoningThenTools
from ringserve.api.chat.template import ChatTemplate, ChatTemplateError
from ringserve.api.chat.tool_calls import ToolRequest
from ringserve.api.chat.tool_output import ParserFactory, ToolChatEncoder, tool_chat_body
from ringserve.api.chat.tool_parsers import make_parser
from ringserve.api.errors import bad_request
from ringserve.api.prompt_limits import check_fits, encode_prompt, resolve_max_tokens
from ringserve.api.protocol import check_min_tokens
from ringserve.api.request_flow import Job, Output, check_available, read_request, run, tokenizing
from ringserve.api.sampling_tokens import constrain, finish_sampling
from ringserve.api.state import ApiState, note_ignored

OUTPUTS = {
    as_ids: Output(encoder=ChatEventEncoder, body=chat_body, logprob_format=ChatLogprobs(as_ids))
    for as_ids in (False, True)
}


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    st, req = await read_request(request, parse_chat_body)
    job = await chat_job(st, req)
    note_unapplied_reasoning(request, st, req, "reasoning_effort")
    output = OUTPUTS[req.common.output.tokens_as_ids]
    parser = answer_parser(st, req)
    if parser is not None:
        output = parsed_output(parser, output.logprob_format)
    return await run(request, st, job, output)


async def chat_job(st: ApiState, req: ChatRequest, param: str = "messages") -> Job:
    """A validated chat request as the job `request_flow.run` submits: rendered, tokenized,
    constrained by its tools or structured output, ending at the template's end of turn. Every
    route that speaks in messages (/v1/chat/completions, /v1/responses) goes through here;
    `param` names the messages in its errors (the route's field: messages, input)."""
    template = chat_template(st)
    if req.tools is not None and not template.renders_tools:
        raise bad_request(
            f"The chat template of {st.model_name!r} does not render tools, so the model cannot be told "
            "about them; serve it with --chat-template FILE naming a template that does.",
            "tools",
            code="unsupported_value",
        )
    common = req.common
    sampling = finish_sampling(common, st.codec)
    spec = req.tools.forced if req.tools is not None else None
    spec = spec or common.structured
    if spec is not None:
        sampling = await constrain(st, spec, sampling)
    check_available(st)
    ids = await tokenizing(st, prompt_ids(st, template, req, param))
    wanted = req.max_tokens
    # A cap (or no max_tokens) only needs room for one token; a fixed max_tokens needs all of it.
    check_fits(len(ids), None if req.max_tokens_is_cap else wanted, st.config.context_limit, param=param)
    if wanted is not None and req.max_tokens_is_cap:
        wanted = min(wanted, st.config.context_limit - len(ids))
    max_tokens = resolve_max_tokens(len(ids), wanted, st.config.context_limit, st.config.max_tokens_limit)
    check_min_tokens(common, max_tokens)
    if not sampling.ignore_eos:
        stops = tuple(dict.fromkeys(sampling.stop_token_ids + template.end_of_turn_ids))
        sampling = msgspec.structs.replace(sampling, stop_token_ids=stops)
    return Job.of(
        common,
        [ids],
        [max_tokens],
        sampling,
        req.logprobs,
        prompt_logprobs=common.prompt_logprobs,
        show_prompt_logprobs=common.prompt_logprobs,
    )


def note_unapplied_reasoning(request: web.Request, st: ApiState, req: ChatRequest, field: str) -> None:
    """A reasoning effort the model's template does not read is named as ignored (`reasoning.py`)."""
    if req.reasoning_effort is not None and not template_variables(chat_template(st), req.reasoning_effort):
        note_ignored(request, (field,))


def chat_template(st: ApiState) -> ChatTemplate:
    if st.chat_template is None:
        raise bad_request(
            f"The model {st.model_name!r} has no chat template (none in its "
            "tokenizer_config.json or chat_template.jinja), so it cannot format chat "
            "messages; use /v1/completions with a prompt, or serve a chat model.",
            "messages",
            code="no_chat_template",
        )
    return st.chat_template


async def prompt_ids(st: ApiState, template: ChatTemplate, req: ChatRequest, param: str) -> list[int]:
    """Render, then tokenize as a prompt is (refused by its byte length before tokenizing when it
    cannot fit; a long one off the event loop)."""
    messages = req.messages
    if not template.has_developer_role:  # OpenAI's developer role is the system role of older templates
        messages = tuple({**m, "role": "system"} if m["role"] == "developer" else m for m in messages)
    try:
        text = template.render_pieces(
            messages,
            req.add_generation_prompt,
            extra={**template_variables(template, req.reasoning_effort), **(req.template_kwargs or {})} or None,
            continue_final_message=req.continue_final_message,
            tools=req.tools.tools if req.tools is not None else None,
        )
    except ChatTemplateError as exc:
        raise bad_request(
            f"The model's chat template refused the messages: {exc}", param, code="chat_template_error"
        ) from None
    # The rendered text holds the template's special tokens (BOS, turn markers) already; the
    # client's text is plain text, whatever it spells (chat_template.render_pieces).
    ids = await encode_prompt(
        st.codec,
        text,
        max_tokens=None if req.max_tokens_is_cap else req.max_tokens,
        context_limit=st.config.context_limit,
        executor=st.executor,
        inline_chars=st.tokenize_inline_chars,
        add_special_tokens=req.add_special_tokens,
        param=param,
        truncate=req.common.truncate,
    )
    if not ids:
        raise bad_request("The chat template rendered these messages as an empty prompt.", param)
    return ids


def tool_parser(tools: ToolRequest, parser: str) -> ParserFactory:
    """How each answer of a request with `tools` is read: the forced choice's parser, else the
    server's (`--tool-call-parser`)."""
    kind = "required" if tools.choice == "required" else parser
    return partial(make_parser, kind, named=tools.name if tools.choice == "named" else None)


def answer_parser(st: ApiState, req: ChatRequest) -> ParserFactory | None:
    """How each answer is read, None when as plain content: its thinking first with the server's
    `--reasoning-parser` (not for an answer a grammar forces: it has no thinking), then its tool
    calls when it has tools."""
    tools = tool_parser(req.tools, st.tool_call_parser) if req.tools is not None else None
    forced = req.common.structured is not None or (req.tools is not None and req.tools.choice in ("named", "required"))
    if not st.reasoning_parser or forced:
        return tools
    return partial(_reasoning_then, st.reasoning_parser, tools)


def _reasoning_then(kind: str, tools: ParserFactory | None) -> ReasoningThenTools:
    return ReasoningThenTools(kind, tools() if tools is not None else None)


def parsed_output(parser: ParserFactory, logprob_format) -> Output:
    """The response shapes of a request whose answers are parsed (reasoning, tool calls)."""
    return Output(
        encoder=partial(ToolChatEncoder, parser=parser),
        body=partial(tool_chat_body, parser),
        logprob_format=logprob_format,
    )
