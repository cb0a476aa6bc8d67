"""`init_app`: the aiohttp application of one API worker.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET / DELETE
/v1/responses/{response_id}), POST /v1/messages and /v1/messages/count_tokens (Anthropic's, with
errors in its shape), DELETE /v1/requests/{request_id},
GET /v1/models, /v1/models/{id}, /version, /health, /ready, /metrics; vLLM's POST /tokenize and
/detokenize, and /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys only). Four middlewares, in order: errors in the OpenAI shape (with x-request-id when one
was assigned); the connection guard (the connection is busy); authentication (deny by default;
/health and /ready are open, /metrics too unless metrics keys are set); then the body, read within
body_timeout_s, so no body is read or inflated before its key is checked. Generation responses
carry the replica's ORCA load report header (`orca_report.py`). Background work — the GPU client's
transport, the tokenizer thread pool, the
slow-reader watchdog, the connection guard's sweep and the response store's thread — is owned by
`cleanup_ctx`, so it starts and stops with the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from ringserve import __version__
from ringserve.api.auth import ADMIN_PATHS, METRICS_PATH, PUBLIC_PATHS, Authenticator
from ringserve.api.availability import gpu_not_ready
from ringserve.api.chat.route import handle_chat_completions
from ringserve.api.chat.template import ChatTemplate
from ringserve.api.completions.route import handle_completions
from ringserve.api.connections import ConnectionGuard
from ringserve.api.embeddings.route import handle_embeddings
from ringserve.api.errors import ApiError, from_http_exception, quoted
from ringserve.api.gpu_client import GpuClient
from ringserve.api.gpu_status import GpuStatus
from ringserve.api.lora_admin.route import handle_load_lora_adapter, handle_unload_lora_adapter
from ringserve.api.messages.output import error_body as anthropic_error_body
from ringserve.api.messages.route import MESSAGES_PATHS, handle_count_tokens, handle_messages
from ringserve.api.metrics import CONTENT_TYPE, render
from ringserve.api.orca_report import HEADER as LOAD_REPORT_HEADER
from ringserve.api.orca_report import LoadReport
from ringserve.api.peer_cancel import PeerCancel
from ringserve.api.registry import Registry
from ringserve.api.request_trace import Tracing
from ringserve.api.responses.route import handle_delete_response, handle_get_response, handle_responses
from ringserve.api.responses.store import ResponseStore
from ringserve.api.state import REQUEST_ID, STATE, TENANT, ApiState, ignored_header, span_labels
from ringserve.api.structured_output import GrammarChecker
from ringserve.api.tokenize.route import handle_detokenize, handle_tokenize
from ringserve.api.tokenizer import TextCodec
from ringserve.api.worker_stats import WorkerStats
from ringserve.config import Config
from ringserve.rules import GrammarLimits
from ringserve.shm.messages import CancelReason

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})


def init_app(
    config: Config,
    client: GpuClient,
    codec: TextCodec,
    status: GpuStatus,
    *,
    model_name: str,
    auth: Authenticator | None = None,
    worker: int = 0,
    peers: PeerCancel | None = None,
    publish_every_s: float = 0.25,
    chat_template: ChatTemplate | None = None,
    model_aliases: frozenset[str] = frozenset(),
    response_store: ResponseStore | None = None,
    embedding_dims: int | None = None,
) -> web.Application:
    """Build a worker's app. `status` is what the worker knows of the GPU process besides its
    rings (`api/gpu_status.py`: readiness, the server-wide stats for /metrics, the restart status,
    the EOS ids, /health's detail), and where it publishes its own stats every `publish_every_s`;
    `peers`, if given, lets a DELETE reach the request's worker whichever worker receives it;
    `chat_template` formats /v1/chat/completions messages (None: that route answers 400);
    `model_aliases` are other names a request may give the model (the path it was served from);
    `response_store` keeps /v1/responses' stored responses (None: one in memory, this worker's
    alone); `embedding_dims` is the width of the model's hidden states (/v1/embeddings)."""
    guard = ConnectionGuard(config)
    stats = WorkerStats()
    tracing = Tracing(config, model_name, worker, labels=span_labels, stats=stats)
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[tracing.middleware, _error_middleware, guard.middleware, _auth_middleware, guard.read_body],
    )
    state = ApiState(
        config=config,
        client=client,
        codec=codec,
        model_name=model_name,
        status=status,
        auth=auth or Authenticator(),
        registry=Registry(worker),
        stats=stats,
        connections=guard,
        remote_cancel=peers.cancel if peers is not None else None,
        chat_template=chat_template,
        model_aliases=frozenset(model_aliases) - {model_name},
        grammar=GrammarChecker(codec, GrammarLimits.of(config), config.grammar_procs),
        response_store=response_store or ResponseStore.for_config(config, None),
        embedding_dims=embedding_dims,
    )
    state.reasoning_parser = config.reasoning_parser
    if chat_template is not None:
        state.tool_call_parser = (
            chat_template.tool_call_parser if config.tool_call_parser == "auto" else config.tool_call_parser
        )
    app[STATE] = state
    report = LoadReport(state.snapshot, max_rows=config.max_rows, queue_limit_s=config.queue_limit_s)
    app.on_response_prepare.append(_load_report_hook(report))
    for method, path, handler in (
        ("POST", "/v1/completions", handle_completions),
        ("POST", "/v1/chat/completions", handle_chat_completions),
        ("POST", "/v1/responses", handle_responses),
        ("POST", "/v1/messages", handle_messages),
        ("POST", "/v1/messages/count_tokens", handle_count_tokens),
        ("POST", "/v1/embeddings", handle_embeddings),
        ("GET", "/v1/responses/{response_id}", handle_get_response),
        ("DELETE", "/v1/responses/{response_id}", handle_delete_response),
        ("DELETE", "/v1/requests/{request_id}", _handle_delete),
        ("GET", "/v1/models", _handle_models),
        ("GET", "/v1/models/{model_id:.+}", _handle_model),
        ("POST", "/v1/load_lora_adapter", handle_load_lora_adapter),
        ("POST", "/v1/unload_lora_adapter", handle_unload_lora_adapter),
        ("POST", "/tokenize", handle_tokenize),
        ("POST", "/detokenize", handle_detokenize),
        ("GET", "/version", _handle_version),
        ("GET", "/health", _handle_health),
        ("GET", "/ready", _handle_ready),
        ("GET", "/metrics", _handle_metrics),
    ):
        app.router.add_route(method, path, handler, expect_handler=_expect_handler)
    app.cleanup_ctx.append(_gpu_client_ctx)
    app.cleanup_ctx.append(_executor_ctx)
    app.cleanup_ctx.append(_grammar_ctx)
    app.cleanup_ctx.append(_slow_reader_ctx)
    app.cleanup_ctx.append(_connection_sweep_ctx)
    app.cleanup_ctx.append(_publisher(status.publish, publish_every_s))
    app.cleanup_ctx.append(_response_store_ctx)
    app.on_cleanup.append(lambda _app: tracing.close())
    if peers is not None:
        app.cleanup_ctx.append(_peers_ctx(peers))
    return app


# middlewares ----------------------------------------------------------------------------------
@web.middleware
async def _error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        error = err
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = from_http_exception(exc)
    st = request.app[STATE]
    if request.path in GENERATION_PATHS:
        st.stats.count_rejection(error.status)
    rid = request.get(REQUEST_ID)
    headers = ignored_header(request)
    if rid:
        headers["x-request-id"] = rid
    if request.path in MESSAGES_PATHS:  # Anthropic's clients read Anthropic's error shape
        return error.response(headers or None, body=anthropic_error_body(error, rid))
    return error.response(headers or None)


@web.middleware
async def _auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    auth = request.app[STATE].auth
    if request.path == METRICS_PATH:
        auth.check_metrics(request)  # raises 401 when metrics keys are set
    elif request.path in ADMIN_PATHS:
        try:
            auth.check_admin(request)
        except ApiError as err:
            err.close_connection = request.body_exists
            raise
    elif request.path not in PUBLIC_PATHS:
        try:
            request[TENANT] = tenant = auth.tenant(request)
        except ApiError as err:
            err.close_connection = request.body_exists  # its body is never read, nor inflated
            raise
        if request.path in GENERATION_PATHS:
            await _refuse_at_once(request, tenant)
    return await handler(request)


DRAINED_BODY_BYTES = 64 * 1024  # a refused body this small is read and dropped, keeping the connection


async def _refuse_at_once(request: web.Request, tenant: str) -> None:
    """A 429 before the body is parsed when the GPU process would refuse this tenant's next
    request whatever it asks (`api/refusals.py`). A small body is read and dropped so that a
    client retrying on its keep-alive connection needs no new one; a larger one is not read."""
    st = request.app[STATE]
    retry = st.status.refused_retry_after(tenant)
    if retry is not None:
        st.stats.add("refused_at_once")
        length = request.content_length
        close = request.body_exists and not (length is not None and length <= DRAINED_BODY_BYTES)
        if request.body_exists and not close:
            try:
                async with asyncio.timeout(st.config.body_timeout_s):  # NOTE: no task, unlike wait_for
                    await request.content.readexactly(length or 0)
            except (TimeoutError, asyncio.IncompleteReadError):
                close = True
        raise ApiError(
            429,
            f"More than {st.config.queue_limit_s:g} s of GPU work is waiting ahead of this key's next request "
            f"(its queue and the others' up to as much); retry after {retry} s",
            code="overloaded",
            retry_after_s=float(retry),
            close_connection=close,
        )


async def _expect_handler(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: the client waits for our go before it sends the body, so the checks
    that need no body come first: its declared size, then its key. Any other expectation is a 417
    (RFC 9110) in the OpenAI shape. An answer here skips the middlewares and closes the connection
    (the body is never read)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        error = ApiError(
            417,
            f"Unsupported Expect header {quoted(expect)}: only '100-continue' is understood; leave it out.",
            code="expectation_failed",
        )
    else:
        st = request.app[STATE]
        try:
            _check_declared_size(request, st.config.max_body_bytes)
            if request.path == METRICS_PATH:
                st.auth.check_metrics(request)
            elif request.path in ADMIN_PATHS:
                st.auth.check_admin(request)
            elif request.path not in PUBLIC_PATHS:
                st.auth.tenant(request)
        except ApiError as err:
            error = err
        else:
            if request.version >= (1, 1):
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # the interim answer is not the response
            return None
    error.close_connection = True
    return error.response()


def _check_declared_size(request: web.Request, limit: int) -> None:
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(
            413,
            f"Request body too large: Content-Length {length:,} bytes is over the limit of {limit:,} "
            "bytes (--max-body-bytes). Send a shorter prompt.",
            code="request_too_large",
        )


def _load_report_hook(report: LoadReport):
    """Every generation response, refusals included, carries the replica's ORCA load report for
    a proxy's balancer (api/orca_report.py)."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if request.path in GENERATION_PATHS:
            try:
                response.headers[LOAD_REPORT_HEADER] = report.header()
            except Exception:  # a torn stats read must not fail the response; the next one reports
                pass

    return on_prepare


# handlers -------------------------------------------------------------------------------------
async def _handle_delete(request: web.Request) -> web.Response:
    """Cancel a request; only the tenant that submitted it may, others get 404 (not 403, which
    would confirm that someone else's request id exists). A client-chosen id names every open
    request of the tenant under it, on whichever worker holds it."""
    st = request.app[STATE]
    request_id = request.match_info["request_id"]
    tenant = request[TENANT]
    entry = st.registry.get(request_id, tenant)
    local = entry is not None and entry.end(CancelReason.DELETE)
    # NOTE: peers are asked even after a local hit: the tenant may have reused its own id on
    # another worker (a generated id names its worker, so then no peer is asked).
    remote = st.remote_cancel is not None and await st.remote_cancel(request_id, tenant)
    if local or remote:
        return _json({"id": request_id, "object": "request.cancelled", "cancelled": True})
    raise ApiError(
        404, f"No open request {quoted(request_id)} for this API key.", param="request_id", code="request_not_found"
    )


def _model_card(st: ApiState) -> dict:
    return {
        "id": st.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "ringserve",
        "root": st.model_name,  # (vLLM shows the path it serves from: not a client's business)
        "max_model_len": st.config.context_limit,
        # ringserve's: how the weights are served (null until the GPU process has loaded)
        "quantization": (st.status.health().get("weights") or {}).get("quantization"),
    }


def _adapter_card(st: ApiState, name: str) -> dict:
    """A LoRA adapter as vLLM lists one: its own id, the base model as `parent` (not its path)."""
    return {**_model_card(st), "id": name, "root": name, "parent": st.model_name}


async def _handle_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    adapters = st.adapters(request[TENANT])
    return _json({"object": "list", "data": [_model_card(st), *(_adapter_card(st, n) for n in adapters)]})


async def _handle_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: the model by its id or by the path it was served from, or an adapter."""
    st = request.app[STATE]
    model_id = request.match_info["model_id"]
    if model_id in st.adapters(request[TENANT]):
        return _json(_adapter_card(st, model_id))
    # NOTE: an absolute path as the id arrives as /v1/models//abs/path, or with one slash.
    if model_id != st.model_name and model_id not in st.model_aliases and "/" + model_id not in st.model_aliases:
        raise ApiError(
            404,
            f"The model {quoted(model_id)} does not exist; this server serves {st.model_name!r}.",
            param="model",
            code="model_not_found",
        )
    return _json(_model_card(st))


async def _handle_version(request: web.Request) -> web.Response:
    return _json({"version": __version__})


async def _handle_health(request: web.Request) -> web.Response:
    try:
        detail = request.app[STATE].status.health()
    except Exception:  # a torn control-block read must not turn "alive" into a 500
        detail = {}
    return _json({"status": "ok", **detail})


async def _handle_ready(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.draining or st.leaving:
        raise ApiError(503, "The server is draining.", code="server_draining", retry_after_s=5.0)
    if not st.status.ready():
        raise gpu_not_ready(st)
    return _json({"status": "ready"})


async def _handle_metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.status.publish(st.stats)  # this worker's own numbers as of now; the others' lag <= one period
    loras = {e.stat: e.name for e in st.status.loras()}
    body = render(st.snapshot(), st.model_name, loras, st.config.max_loras, st.status.tenants())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _json(obj: dict, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


# background work ------------------------------------------------------------------------------
async def _gpu_client_ctx(app: web.Application):
    st = app[STATE]
    st.client.start()
    yield
    st.client.close()


async def _executor_ctx(app: web.Application):
    st = app[STATE]
    st.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
    yield
    st.executor.shutdown(wait=False, cancel_futures=True)
    st.executor = None


async def _stop_task(task: asyncio.Task) -> None:
    """Cancel a background task and wait until it has ended."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def _grammar_ctx(app: web.Application):
    """The grammar processes (`grammar_pool.py`) start when first needed and stop with the app."""
    yield
    grammar = app[STATE].grammar
    if grammar is not None:
        await grammar.close()


async def _slow_reader_ctx(app: web.Application):
    task = asyncio.create_task(_slow_reader_watchdog(app[STATE]))
    yield
    await _stop_task(task)


async def _connection_sweep_ctx(app: web.Application):
    task = asyncio.create_task(app[STATE].connections.sweep_forever())
    yield
    await _stop_task(task)


async def _response_store_ctx(app: web.Application):
    yield
    store = app[STATE].response_store
    if store is not None:
        store.close()


def _peers_ctx(peers: PeerCancel):
    async def ctx(app: web.Application):
        await peers.start(app[STATE].registry)
        yield
        await peers.stop()

    return ctx


def _publisher(publish: Callable[[WorkerStats], None], every_s: float):
    async def ctx(app: web.Application):
        stats = app[STATE].stats

        async def loop() -> None:
            while True:
                publish(stats)
                await asyncio.sleep(every_s)

        task = asyncio.create_task(loop())
        yield
        await _stop_task(task)
        publish(stats)  # the last counts before exit

    return ctx


async def _slow_reader_watchdog(st: ApiState) -> None:
    """Close the connection of every stream whose write has been blocked (the client reads
    nothing while the socket buffers are full) for longer than `slow_reader_s`."""
    limit = st.config.slow_reader_s
    period = min(1.0, limit / 4)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period)
        now = loop.time()
        for entry in list(st.registry.values()):
            if entry.write_since and now - entry.write_since > limit:
                entry.end(CancelReason.SLOW_READER)
