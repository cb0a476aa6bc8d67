"""What the API handlers share in one worker, stored on the app under one typed key."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from ringserve.api.auth import Authenticator
from ringserve.api.connections import ConnectionGuard
from ringserve.api.gpu_client import GpuClient
from ringserve.api.gpu_status import GpuStatus
from ringserve.api.metrics import StatsSnapshot
from ringserve.api.registry import Registry
from ringserve.api.structured_output import GrammarChecker
from ringserve.api.tokenizer import TextCodec
from ringserve.api.worker_stats import WorkerStats
from ringserve.config import Config

if TYPE_CHECKING:
    # NOTE: the state carries what the worker built for two routes (the model's chat template, the
    # store of /v1/responses) and uses neither: the core imports no route at run time (pyproject's
    # import contracts).
    from ringserve.api.chat.template import ChatTemplate
    from ringserve.api.responses.store import ResponseStore

# Prompts longer than this (characters) are tokenized in a thread, so a long prompt's tokenization
# never holds up the event loop that is streaming everyone else's tokens.
TOKENIZE_INLINE_CHARS = 2048


@dataclass(slots=True)
class ApiState:
    config: Config
    client: GpuClient
    codec: TextCodec
    model_name: str
    status: GpuStatus  # readiness, the server-wide stats, restarts, EOS ids: the control block or the fake
    auth: Authenticator
    registry: Registry
    connections: ConnectionGuard
    stats: WorkerStats = field(default_factory=WorkerStats)
    executor: ThreadPoolExecutor | None = None
    draining: bool = False  # set on SIGTERM: new requests get 503, open streams finish
    leaving: bool = False  # set on SIGTERM, unready_lead_s before draining: /ready fails, requests run
    tokenize_inline_chars: int = TOKENIZE_INLINE_CHARS
    # When every sample ended early (stop string, DELETE), how long to wait for the GPU process's
    # Finish records, which carry the timing, before answering without them.
    finish_grace_s: float = 1.0
    # For a DELETE naming a request this worker does not hold (another worker's, under
    # SO_REUSEPORT): (request_id, tenant) -> True if the owning worker cancelled it.
    # None: such ids are 404.
    remote_cancel: Callable[[str, str], Awaitable[bool]] | None = None
    # The model's chat template (None: the model has none, /v1/chat/completions answers 400).
    chat_template: ChatTemplate | None = None
    # How tool calls are read from a chat answer (`chat/tool_parsers.py`; `--tool-call-parser`).
    tool_call_parser: str = "hermes"
    # How a reasoning model's thinking is read from its answer (`chat/reasoning_parsers.py`;
    # `--reasoning-parser`); "" when the served model's answers are all content.
    reasoning_parser: str = ""
    # Structured output's grammar check against the model's vocabulary (built from `codec`).
    grammar: GrammarChecker | None = None
    # Other names a request's `model` may use: the path the model was served from (vLLM's id).
    model_aliases: frozenset[str] = frozenset()
    # The width of the served model's hidden states: /v1/embeddings' dimensions (None: unknown).
    embedding_dims: int | None = None
    # Stored responses of /v1/responses, shared by the instance's workers (`responses/store.py`).
    response_store: ResponseStore | None = None

    def snapshot(self) -> StatsSnapshot:
        """The server-wide stats /metrics renders."""
        return self.status.snapshot(self.stats)

    def adapters(self, tenant: str) -> tuple[str, ...]:
        """The LoRA adapters `tenant` may name as its `model`: those the GPU process serves now
        (`--lora-modules` and runtime-loaded), within the tenant's key's scope."""
        served = tuple(e.name for e in self.status.loras())
        scope = self.auth.adapters_of(tenant)
        return served if scope is None else tuple(n for n in served if n in scope)


STATE: web.AppKey[ApiState] = web.AppKey("ringserve_api_state", ApiState)
TENANT: web.RequestKey[str] = web.RequestKey("ringserve_tenant", str)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("ringserve_request_id", str)
IGNORED: web.RequestKey[tuple] = web.RequestKey("ringserve_ignored_fields", tuple)
LORA: web.RequestKey[str] = web.RequestKey("ringserve_lora", str)  # the adapter a request's `model` names


def span_labels(request: web.Request) -> dict[str, str]:
    """A request's trace attributes from what its handler left on it: the tenant (a hash of the
    key, never the key), the response id and the LoRA adapter."""
    labels = {}
    if request.get(TENANT):
        labels["ringserve.tenant"] = request[TENANT]
    if request.get(REQUEST_ID):
        labels["gen_ai.response.id"] = labels["ringserve.request_id"] = request[REQUEST_ID]
    if request.get(LORA):
        labels["ringserve.lora_adapter"] = request[LORA]
    return labels


def served_model(request: web.Request, st: ApiState) -> str:
    """The `model` a response names: the LoRA adapter the request runs, else the base model."""
    return request.get(LORA) or st.model_name


IGNORED_HEADER = "x-ringserve-ignored-fields"

log = logging.getLogger("ringserve.api")


def note_ignored(request: web.Request, ignored: tuple[str, ...]) -> None:
    """Fields of the request body ringserve does not know: ignored (as vLLM does), named on the
    response (every response to the request, errors too) and in a debug log line."""
    if ignored:
        request[IGNORED] = (*request.get(IGNORED, ()), *ignored)
        log.debug("%s %s: ignored unknown fields %s", request.method, request.path, ", ".join(ignored))


_HEADER_NAMES = 32  # a body may hold thousands of unknown keys; the header names the first ones


def ignored_header(request: web.Request) -> dict[str, str]:
    """`x-ringserve-ignored-fields: a, b.c` (names escaped to printable ASCII: a key of a JSON body
    can hold any character, a header value cannot)."""
    ignored = request.get(IGNORED)
    if not ignored:
        return {}
    names = [name.encode("unicode_escape").decode("ascii")[:128] for name in ignored[:_HEADER_NAMES]]
    if len(ignored) > _HEADER_NAMES:
        names.append(f"... {len(ignored) - _HEADER_NAMES} more")
    return {IGNORED_HEADER: ", ".join(names)}
