"""The HTTP side of `ringserve drill`: streaming completions that record how each one ended,
and the small probes (`/ready`, a request during the drain).

A stream ends one of five ways, which is what the drill's table counts: `completed` ([DONE]
after its last token), `error_event` (an SSE error object, then [DONE]), `dropped` (the
connection closed under it), `rejected` (a 4xx/5xx with the error object before any token), or
`lost` (it hung past its timeout, or closed without [DONE]: the server never told the client).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from ringserve.tools.harness.sse_stream import DONE, iter_sse


@dataclass(slots=True)
class StreamResult:
    """What one client saw."""

    worker: int | None = None  # from the request id (cmpl-<worker>-...)
    tokens: int = 0
    outcome: str = "open"  # completed | error_event | dropped | rejected | lost
    error_code: str | None = None
    tokens_at_error: int | None = None
    error_t: float | None = None  # monotonic time of the error event
    end_t: float | None = None  # monotonic time the stream ended, however it ended


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict, res: StreamResult, started: asyncio.Event, timeout_s: float
) -> None:
    """POST one streaming completion, recording into `res`; `started` is set at the first token
    (or at a refusal). Never raises for anything the server does."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as resp:
                rid = resp.headers.get("x-request-id", "")
                parts = rid.split("-")
                res.worker = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None
                if resp.status != 200:
                    res.outcome = "rejected"
                    res.error_code = (await resp.json(content_type=None) or {}).get("error", {}).get("code")
                    started.set()
                    return
                async for ev in iter_sse(resp):
                    if ev == DONE:
                        if res.outcome == "open":
                            res.outcome = "completed"
                        return
                    if "error" in ev:
                        res.outcome, res.error_t = "error_event", time.monotonic()
                        res.error_code, res.tokens_at_error = ev["error"].get("code"), res.tokens
                    elif ev.get("choices") and ev["choices"][0].get("finish_reason") is None:
                        res.tokens += 1
                        started.set()
                # EOF without [DONE]: the server closed the stream without telling the client.
                res.outcome = "lost" if res.outcome == "open" else res.outcome
    except TimeoutError:
        res.outcome = "lost" if res.outcome == "open" else res.outcome
    except (aiohttp.ClientError, ConnectionError):
        if res.outcome == "open":
            res.outcome = "dropped"
    except ValueError:  # a body or event that is not JSON: the client was not told anything usable
        res.outcome = "lost"
    finally:
        res.end_t = time.monotonic()


async def http_status(session: aiohttp.ClientSession, url: str, path: str, body: dict | None = None) -> int | None:
    """The status of a GET (or, with `body`, a POST) to `path`; None when no answer came."""
    try:
        async with session.request(
            "POST" if body else "GET", url + path, json=body, timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError, ConnectionError):
        return None


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """True once `/ready` answers 200; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await http_status(session, url, "/ready") == 200:
            return True
        await asyncio.sleep(0.05)
    return False


async def probe_drain(session: aiohttp.ClientSession, url: str) -> int | None:
    """The answer to a new request once the drain has begun (503 expected; None: server gone).

    The supervisor passes SIGTERM on to the workers within a supervision pass, so requests sent
    before that are served normally (200) and the probe tries again.
    """
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        status = await http_status(session, url, "/v1/completions", {"prompt": "late", "max_tokens": 1})
        if status != 200:
            return status
        await asyncio.sleep(0.02)
    return 200
