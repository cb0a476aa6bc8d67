"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's
Responses API, translated onto the chat route (`docs/api.md#post-v1responses`).

A request is parsed (`protocol.py`), continued from its `previous_response_id`'s stored
conversation (the tenant's own: another key's id is 404, as one that never existed), turned into
the chat request it stands for, and from there it is a chat request: the same template, tools,
grammar, job and `request_flow.run` (admission, fairness, cancel on disconnect and by DELETE
/v1/requests/{id}, slow reader, restart errors, metrics). Only the shapes differ
(`output.py`). With `store` (the default) the finished response and its conversation
are kept (`store.py`) before the client gets the last event or the body.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import msgspec
from aiohttp import web

from ringserve.api.chat.route import answer_parser, chat_job, note_unapplied_reasoning
from ringserve.api.errors import ApiError, bad_request, quoted
from ringserve.api.request_flow import read_request, run
from ringserve.api.responses.items import InputItem, decode_items, encode_items
from ringserve.api.responses.output import ResponseOutput, ResponseShell, new_response_id
from ringserve.api.responses.protocol import parse_responses_body
from ringserve.api.responses.store import ResponseStore, StoreUnavailable
from ringserve.api.state import STATE, TENANT, ApiState, note_ignored, served_model

T = TypeVar("T")


async def handle_responses(request: web.Request) -> web.StreamResponse:
    st, req = await read_request(request, parse_responses_body)
    tenant = request[TENANT]
    store = _store(st)
    history: tuple[InputItem, ...] = ()
    if req.previous_response_id is not None:
        stored = await _reading(store.get(tenant, req.previous_response_id))
        if stored is None:
            raise _not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
        history = decode_items(stored.items)
    chat = req.chat(history)
    job = await chat_job(st, chat, param="input")
    note_unapplied_reasoning(request, st, chat, "reasoning.effort")
    if req.settings["reasoning"]["summary"] is not None:
        note_ignored(request, ("reasoning.summary",))  # no reasoning summary is produced
    keeps = req.store and store.enabled
    shell = ResponseShell(new_response_id(), served_model(request, st), {**req.settings, "store": keeps})
    conversation = (*history, *req.input)

    async def keep(response: dict, output: list[dict]) -> None:
        await store.put(tenant, shell.id, msgspec.json.encode(response), encode_items(conversation, output))

    output = ResponseOutput(shell, answer_parser(st, chat), keep if keeps else None)
    return await run(request, st, job, output.output())


async def handle_get_response(request: web.Request) -> web.Response:
    """A stored response, as its request answered it."""
    st = request.app[STATE]
    response_id = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request(
            "stream is not supported on GET /v1/responses/{id}: ringserve runs no background responses "
            "whose stream could be resumed.",
            "stream",
            code="unsupported_value",
        )
    stored = await _reading(_store(st).get(request[TENANT], response_id))
    if stored is None:
        raise _not_found(response_id, "response_id", "response_not_found")
    return web.Response(body=stored.response, content_type="application/json")


async def handle_delete_response(request: web.Request) -> web.Response:
    """Forget a stored response (an open request is cancelled by DELETE /v1/requests/{id})."""
    st = request.app[STATE]
    response_id = request.match_info["response_id"]
    if not await _reading(_store(st).delete(request[TENANT], response_id)):
        raise _not_found(response_id, "response_id", "response_not_found")
    body = {"id": response_id, "object": "response", "deleted": True}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def _reading(work: Awaitable[T]) -> T:
    """A read of the store; a database that cannot be read is a 503 (the answer goes on when a
    write fails: `ResponseStore.put` logs it)."""
    try:
        return await work
    except StoreUnavailable as exc:
        raise ApiError(
            503,
            f"The stored responses cannot be read right now ({exc}); retry.",
            code="response_store_unavailable",
            retry_after_s=1.0,
        ) from None


def _store(st: ApiState) -> ResponseStore:
    if st.response_store is None:
        raise RuntimeError("the app has its response store (init_app)")
    return st.response_store


def _not_found(response_id: str, param: str, code: str) -> ApiError:
    # NOTE: one message for "never existed", "expired", "deleted" and "another key's": a key
    # learns nothing of the others' ids.
    return ApiError(
        404,
        f"No stored response {quoted(response_id)} for this API key: it was not stored (store: false), has "
        "expired (--response-store-ttl-s) or been deleted, or belongs to another key.",
        param=param,
        code=code,
    )
