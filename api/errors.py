"""OpenAI-shaped API errors: one exception type, one JSON body, the HTTP status and Retry-After.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`, the shape the
`openai` client parses into its exception classes. Handlers raise `ApiError`; the app's error
middleware turns it (and aiohttp's own HTTP exceptions, e.g. 413 for a body over the limit) into a
response.
"""

from __future__ import annotations

import math

import msgspec
from aiohttp import web

# OpenAI's `type` strings, by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    408: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    417: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


# Failures a client should tell apart from a generic server error get their own `type` (and the
# same `code`): the GPU process or the API worker restarted under the request, the server is
# shutting down, or the request is quarantined (it was in the step at two GPU-process failures).
_OWN_TYPES = frozenset({"gpu_process_restart", "server_shutdown", "worker_restart", "request_quarantined"})
# What a failure from the GPU side answers before any SSE: 503 (retry it, elsewhere or later),
# except a quarantined request, which no proxy or client should retry (422).
_STATUS_OF_CODE = {"request_quarantined": 422}


def error_type(code: str | None, default: str = "server_error") -> str:
    """The OpenAI `type` for an error raised by the GPU side with `code`."""
    return code if code in _OWN_TYPES else default


def error_status(code: str | None) -> int:
    """The HTTP status for an error raised by the GPU side with `code` (before any SSE)."""
    return _STATUS_OF_CODE.get(code or "", 503)


def error_object(
    message: str, code: str | None, *, type_: str, param: str | None = None, extra: dict | None = None
) -> dict:
    """`{"error": {...}}` — the one error shape, on responses and in SSE error events."""
    err = {"message": message, "type": type_, "param": param, "code": code}
    if extra:
        err.update(extra)
    return {"error": err}


class ApiError(Exception):
    """An error answered to the client with `status` and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        type_: str | None = None,
        extra: dict | None = None,
        close_connection: bool = False,
    ) -> None:
        """`type_` overrides the type derived from `status`; `extra` adds fields to the error
        object (e.g. `tokens_streamed`); `close_connection` ends the connection after the answer
        (the request was not read to its end)."""
        super().__init__(message)
        self._type = type_
        self.extra = extra
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.close_connection = close_connection

    @property
    def type(self) -> str:
        if self._type is not None:
            return self._type
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_object(self.message, self.code, type_=self.type, param=self.param, extra=self.extra)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After is whole seconds (RFC 9110); never 0, which invites an immediate retry storm.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self, extra_headers: dict[str, str] | None = None, body: dict | None = None) -> web.Response:
        """The answer: the OpenAI error object, or `body` (another API's shape of this error)."""
        headers = self.headers()
        if extra_headers:
            headers.update(extra_headers)
        kind = _ClosingResponse if self.close_connection else web.Response
        return kind(
            status=self.status,
            body=msgspec.json.encode(body if body is not None else self.body()),
            content_type="application/json",
            headers=headers,
        )


class _ClosingResponse(web.Response):
    """An answer after which the connection closes at once: the rest of the request body is never
    read (aiohttp would read and inflate it for its lingering close, and quote its errors)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.force_close()

    async def write_eof(self, data: bytes = b"") -> None:
        request = self._req  # (write_eof forgets it)
        await super().write_eof(data)
        if request is not None and request.protocol is not None:
            request.protocol.force_close()  # the transport sends what is written, then closes


QUOTE_CHARS = 64  # how much of a client's value an error message quotes


def quoted(value: str) -> str:
    """A client's value as an error message quotes it: its repr, cut to QUOTE_CHARS characters (a
    1 MB `model` or `role` is not echoed back whole)."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}... ({len(value):,} characters)"


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's own errors (413 body too large, 405, 404 route) in the OpenAI shape."""
    if exc.status == 413:
        return ApiError(
            413,
            f"Request body too large: {exc.text or 'over the limit'}. Send a shorter prompt.",
            code="request_too_large",
        )
    if exc.status == 404:
        return ApiError(
            404,
            "Unknown path; see /v1/completions, /v1/chat/completions, /v1/responses and /v1/models.",
            code="not_found",
        )
    if exc.status == 405:
        return ApiError(405, f"Method not allowed: {exc.text}", code="method_not_allowed")
    return ApiError(exc.status, exc.reason or "HTTP error", code="http_error")
