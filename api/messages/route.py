"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, translated
onto the chat route (`protocol.py`) and answered in Anthropic's shapes (`output.py`), so Claude
Code and anthropic-SDK applications run unchanged against the served model. Admission, fairness,
cancel, stop strings and restart errors are the chat route's; errors on these paths are
Anthropic-shaped (`app.py`'s error middleware, `output.error_body`), and `x-api-key` is read as
the bearer key is (`auth.py`)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from ringserve.api.chat.route import answer_parser, chat_job, chat_template, prompt_ids
from ringserve.api.messages.output import MessageShell, MessagesOutput
from ringserve.api.messages.protocol import MessagesRequest, parse_messages_body
from ringserve.api.request_flow import read_request, run, tokenizing
from ringserve.api.state import note_ignored, served_model

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


async def handle_messages(request: web.Request) -> web.StreamResponse:
    st, req = await read_request(request, parse_messages_body)
    job = await chat_job(st, req.chat, param="messages")
    _note_unapplied_thinking(request, req, st)
    shell = MessageShell(served_model(request, st), len(job.prompts[0]))
    return await run(request, st, job, MessagesOutput(shell, answer_parser(st, req.chat)).output())


async def handle_count_tokens(request: web.Request) -> web.Response:
    """`{"input_tokens": n}`: the prompt the same body would be, rendered and tokenized."""

    def parse(raw: bytes, **kw) -> MessagesRequest:
        return parse_messages_body(raw, **kw, count_only=True)

    st, req = await read_request(request, parse)
    ids = await tokenizing(st, prompt_ids(st, chat_template(st), req.chat, "messages"))
    return web.Response(body=msgspec.json.encode({"input_tokens": len(ids)}), content_type="application/json")


def _note_unapplied_thinking(request: web.Request, req: MessagesRequest, st) -> None:
    if req.thinking is not None and not chat_template(st).reads("enable_thinking"):
        note_ignored(request, ("thinking",))
