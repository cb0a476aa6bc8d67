"""Steady closed-loop load through a fleet's Envoy, and a watcher of what Envoy routes to, for the
fleet drills (tests/test_fleet_drills.py).

Every request ends one way (`Outcome.kind`):

    completed     every token, its finish event and [DONE]
    error_event   an SSE error object (e.g. gpu_process_restart), then [DONE]
    refused       a 429/503 with the OpenAI error object and a Retry-After
    refused_bare  a non-200 without Retry-After or without the error object   (a violation)
    dropped       the connection broke under a stream that had started (its replica was killed
                  whole: nobody was left to send an error event); the client sees an error at once
    lost          a hang past the timeout, or a stream that ended without [DONE] (a violation)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

from ringserve.tools.fleet.envoy_config import REPLICA_HEADER
from ringserve.tools.fleet.replicas import envoy_healthy
from ringserve.tools.harness.sse_stream import DONE, iter_sse

VIOLATIONS = ("refused_bare", "lost")


@dataclass(slots=True)
class Outcome:
    kind: str = "lost"
    status: int = 0
    tokens: int = 0
    code: str | None = None
    start: float = 0.0
    end: float = 0.0
    replica: str = ""  # host:port, from the proxy's x-ringserve-replica header


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float, headers=None) -> Outcome:
    out = Outcome(start=time.monotonic())
    started = False
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                out.status = resp.status
                out.replica = resp.headers.get(REPLICA_HEADER, "")
                if resp.status != 200:
                    payload = await resp.json(content_type=None)
                    error = (payload or {}).get("error") if isinstance(payload, dict) else None
                    has_retry = resp.headers.get("Retry-After", "").isdigit()
                    out.kind = "refused" if error and has_retry and resp.status in (429, 503) else "refused_bare"
                    out.code = error.get("code") if error else None
                    if error and error.get("envoy_response_flags"):
                        out.code = f"{out.code}:{error['envoy_response_flags']}"
                    return out
                started = True
                async for ev in iter_sse(resp):
                    if ev == DONE:
                        if out.kind == "lost":  # no error event came
                            out.kind = "completed" if out.tokens == body["max_tokens"] else "lost"
                        return out
                    if "error" in ev:
                        out.kind, out.code = "error_event", ev["error"].get("code")
                    elif ev.get("choices") and ev["choices"][0].get("finish_reason") is None:
                        out.tokens += 1
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        out.kind = "dropped" if started else "refused_bare"
    except TimeoutError:
        out.kind = "lost"
    finally:
        out.end = time.monotonic()
    return out


class ClosedLoop:
    """`clients` loops, each sending the next request as soon as its last one ended."""

    def __init__(self, url: str, *, clients: int, max_tokens: int, timeout_s: float = 60.0) -> None:
        self.url = url
        self.clients = clients
        self.body = {"prompt": "fleet drill", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ClosedLoop:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(self.clients)]
        return self

    async def _loop(self) -> None:
        while not self._stop.is_set():
            out = await one_request(self._session, self.url, self.body, self.timeout_s)
            self.outcomes.append(out)
            if out.kind.startswith("refused"):
                await asyncio.sleep(0.05)  # a client that was told to come back does not spin

    async def __aexit__(self, *exc) -> None:
        self._stop.set()  # every loop finishes its request in flight: nothing is cut by the test
        await asyncio.gather(*self._tasks)
        await self._session.close()

    def counts(self, since: float = 0.0) -> Counter:
        return Counter(o.kind for o in self.outcomes if o.start >= since)


class RouteWatch:
    """Polls Envoy's view of one replica every `period_s`: when it stopped and started routing."""

    def __init__(self, admin_url: str, host: str, period_s: float = 0.05) -> None:
        self.admin_url, self.host, self.period_s = admin_url, host, period_s
        self.history: list[tuple[float, bool]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> RouteWatch:
        self._task = asyncio.create_task(self._poll())
        return self

    async def _poll(self) -> None:
        while True:
            health = await asyncio.to_thread(envoy_healthy, self.admin_url)
            if health is not None and self.host in health:
                self.history.append((time.monotonic(), health[self.host]))
            await asyncio.sleep(self.period_s)

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def first(self, routable: bool, after: float) -> float | None:
        return next((t for t, ok in self.history if t >= after and ok == routable), None)

    async def wait(self, routable: bool, after: float, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while (t := self.first(routable, after)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"Envoy did not mark {self.host} {'routable' if routable else 'out'} in {timeout_s} s"
                )
            await asyncio.sleep(self.period_s)
        return t


async def wait_ready(url: str, after: float, timeout_s: float) -> float:
    """The first time after `after` that a replica's own /ready answers 200."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200 and time.monotonic() > after:
                        return time.monotonic()
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url}/ready did not answer 200 within {timeout_s} s")
