"""Admission through the whole server with default flags (`docs/design.md#admission`): a request
that can join at the next pass is not waiting work, so an idle server refuses nothing, while a
burst far above capacity still gets 429s with a Retry-After from the queue ahead.

The real-size scenario runs over the model directories in `REAL_SIZE_MODELS` (fixture names): a
mid-size random model and the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest

from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(600)

REAL_SIZE_MODELS = ["mid_model_dir", "smollm2_dir"]

# Test only: every CostModel the server's processes build first goes through a long uptime's
# observations (`tests/helpers/cost_sequences.py`), as if the GPU process had run for hours.
DRIVE_COST_MODEL = """
from ringserve.gpu_proc import cost_model
from tests.helpers import cost_sequences

_init = cost_model.CostModel.__init__


def _driven(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    for obs in cost_sequences.long_uptime():
        self.observe(*obs)


cost_model.CostModel.__init__ = _driven
"""


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """Default admission flags (2 s queue limit, 32 rows); one worker."""
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("shm"), workers=1) as srv:
        yield srv
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def mid_server(mid_model_dir, tmp_path_factory):
    with ServerProcess(mid_model_dir, tmp_path_factory.mktemp("shm"), workers=1) as srv:
        yield srv
        assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def long_uptime_server(tiny_model_dir, tmp_path_factory):
    """A server whose cost model has been through issue 21's sequence and the garbage."""
    with ServerProcess(
        tiny_model_dir, tmp_path_factory.mktemp("shm"), workers=1, sitecustomize=DRIVE_COST_MODEL
    ) as srv:
        yield srv
        assert srv.stop() == 0, srv.log()


def _wait_idle(srv: ServerProcess) -> None:
    srv.wait_metric("ringserve_running_rows", lambda v: v == 0)
    srv.wait_metric("ringserve_queue_depth", lambda v: v == 0)


async def _open_all(
    url: str, bodies: list[dict], *, read: bool, while_open: Callable[[], object] | None = None, key: str | None = None
) -> list[tuple[int, str | None]]:
    """Send every body at once (streaming); (status, Retry-After) of each. With `read`, each stream
    is read to its end; otherwise every connection is closed once all statuses are known (and
    `while_open()`, if given, has run while they are still open)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        headers = {"authorization": f"Bearer {key}"} if key else None
        resps = await asyncio.gather(
            *(s.post(url + "/v1/completions", json=b | {"stream": True}, headers=headers) for b in bodies)
        )
        try:
            if read:
                await asyncio.gather(*(r.read() for r in resps if r.status == 200))
            elif while_open is not None:
                await asyncio.to_thread(while_open)
            return [(r.status, r.headers.get("Retry-After")) for r in resps]
        finally:
            for r in resps:
                r.close()


def _statuses(results) -> dict[int, int]:
    out: dict[int, int] = {}
    for status, _ in results:
        out[status] = out.get(status, 0) + 1
    return out


def test_idle_server_admits_16_long_requests(tiny_server):
    """16 concurrent `max_tokens: 1000, ignore_eos` requests on an idle server: none refused (32
    rows and the whole pool are free, so none of them is waiting work)."""
    _wait_idle(tiny_server)
    body = {"prompt": "Tell me a long story about a river.", "max_tokens": 1000, "ignore_eos": True}
    results = asyncio.run(_open_all(tiny_server.url, [body] * 16, read=False))
    assert _statuses(results) == {200: 16}


def test_burst_far_above_capacity_still_gets_429(tiny_server):
    """300 concurrent long requests: 32 start, a queue up to the 2 s limit waits, the rest get 429
    with a Retry-After from the queue ahead (whole seconds)."""
    _wait_idle(tiny_server)
    body = {"prompt": "Tell me a long story about a river.", "max_tokens": 1000, "ignore_eos": True}
    seen: dict[str, float] = {}

    def queue_seen() -> None:
        # The gauge is the GPU process's, published after its step: the 200s can come first.
        deadline = time.monotonic() + 10.0
        while not seen.get("ringserve_queued_gpu_seconds") and time.monotonic() < deadline:
            seen.update(tiny_server.metrics())
            time.sleep(0.05)

    results = asyncio.run(_open_all(tiny_server.url, [body] * 300, read=False, while_open=queue_seen))
    counts = _statuses(results)
    assert set(counts) == {200, 429}, counts
    waiting = counts[200] - 32
    assert waiting >= 1, counts
    # The waiting work is what the limit bounds: at most 2 s, and within one request's price of it
    # (the next one was refused). How many requests that is depends on this CPU's measured speed.
    queued, price = seen["ringserve_queued_gpu_seconds"], seen["ringserve_queued_gpu_seconds"] / waiting
    assert queued <= 2.0 + 1e-6 and queued + 1.5 * price > 2.0, (queued, waiting, counts)
    # Refused only past the limit, so the queue ahead holds at least 2 s - one request's price
    # (under 0.4 s): the projected drain is at least 2 s.
    retry = {float(ra) for status, ra in results if status == 429}
    assert min(retry) >= 2.0, retry


def test_a_key_past_its_limit_is_refused_before_its_body_is_read(tiny_server):
    """While key A's flood holds its queue past the limit, the worker answers A's next request
    with a 429 and Retry-After before reading the body (a malformed body gets the 429, not the
    400), from the GPU process's published table (`api/refusals.py`); key B, with nothing waiting,
    is decided as always (its malformed body is a 400). Retry storms then cost a header lookup."""
    _wait_idle(tiny_server)
    body = {"prompt": "Tell me a long story about a river.", "max_tokens": 1000, "ignore_eos": True}
    answers: dict[str, tuple[int, str | None]] = {}

    def while_flooded() -> None:
        import urllib.error
        import urllib.request

        def malformed(key: str) -> tuple[int, str | None]:
            req = urllib.request.Request(
                tiny_server.url + "/v1/completions",
                data=b'{"prompt": ',  # not JSON
                headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            )
            try:
                urllib.request.urlopen(req, timeout=10)
            except urllib.error.HTTPError as err:
                return err.code, err.headers.get("Retry-After")
            raise AssertionError("a malformed body was accepted")

        # NOTE: the table is published after the step that follows the flood's decisions, so the
        # flood's statuses can arrive a step before it (it failed the fresh-clone CI once): ask
        # again until A is refused at once, bounded (a step here is well under a second).
        deadline = time.monotonic() + 5
        while (got := malformed("key-a"))[0] != 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        answers["key-a"] = got
        answers["key-b"] = malformed("key-b")

    results = asyncio.run(_open_all(tiny_server.url, [body] * 300, read=False, while_open=while_flooded, key="key-a"))
    assert _statuses(results).get(429, 0) > 0
    assert answers["key-a"][0] == 429 and 1 <= int(answers["key-a"][1]) <= 60, answers
    assert answers["key-b"][0] == 400, answers
    assert tiny_server.metrics()["ringserve_requests_refused_at_once_total"] >= 1


def test_a_long_running_server_still_refuses_an_overload_burst(long_uptime_server):
    """Issue 21: after ~10^4 steps the old fit's constants were NaN and a long-running server
    admitted everything. Driven through 440,000 observations before its first request, the cost
    model is finite and priced at the last law it saw (3 ms + 0.3 ms/row: 0.39 ms an output token),
    and the issue's burst (120 x max_tokens 2000, ignore_eos) still gets 429s with Retry-After."""
    srv = long_uptime_server
    _wait_idle(srv)
    m = srv.metrics()
    # finite, and fitted to the last law it saw (the old fit ends at its clamp, 0.0125, or NaN)
    assert 0.3 < m["ringserve_cost_decode_ms"] < 0.5, m["ringserve_cost_decode_ms"]
    assert m["ringserve_cost_model_resets_total"] == 0
    body = {"prompt": "Tell me a long story about a river.", "max_tokens": 2000, "ignore_eos": True}
    results = asyncio.run(_open_all(srv.url, [body] * 120, read=False))
    counts = _statuses(results)
    assert set(counts) == {200, 429} and counts[429] >= 30, counts
    retry = [ra for status, ra in results if status == 429]
    assert all(ra is not None and 1 <= int(ra) <= 60 for ra in retry), retry


@pytest.mark.parametrize("model_fixture", REAL_SIZE_MODELS)
def test_idle_server_admits_32_short_requests(request, model_fixture, tmp_path_factory):
    """32 concurrent 12-token requests with a ~12-token prompt on a fresh server with a real-size
    model, twice: none refused, neither before nor after the cost model has seen this CPU's
    steps (their prefill, under a second here, all starts in the next steps). NOTE: twice the
    prompt (~24 tokens x 32) sits near the 2 s limit on this CPU: a run with the box loaded by
    other work refused 3, rightly (the last would have waited past the limit there)."""
    model_dir = request.getfixturevalue(model_fixture)
    with ServerProcess(model_dir, tmp_path_factory.mktemp("shm"), workers=1) as srv:
        body = {"prompt": "Write one sentence about the sea and the ships on it.", "max_tokens": 12}
        for _ in range(2):
            results = asyncio.run(_open_all(srv.url, [body] * 32, read=True))
            assert _statuses(results) == {200: 32}
            _wait_idle(srv)
        assert srv.stop() == 0, srv.log()


def test_long_prompts_that_would_wait_past_the_limit_are_refused(smollm2_dir, tmp_path_factory):
    """Issue 32: 16 distinct ~1,000-token prompts at once. Rows are free for all of them, but
    their chunks run one after another, so the later ones would wait many seconds of prefill
    (the old admission let all in: TTFT p95 41 s under closed-loop load). The calibrated cost
    model prices each at about a second here: a few are admitted and the rest get 429 with a
    Retry-After, before any of them streams."""
    with ServerProcess(smollm2_dir, tmp_path_factory.mktemp("shm"), workers=1) as srv:
        bodies = [
            {
                "prompt": f"Report {i}: " + " ".join(f"entry{(i * 17 + k) % 997}" for k in range(330)) + "\nSummary:",
                "max_tokens": 8,
            }
            for i in range(16)
        ]
        results = asyncio.run(_open_all(srv.url, bodies, read=True))
        counts = _statuses(results)
        assert set(counts) == {200, 429} and 1 <= counts[200] <= 8, counts
        assert all(ra is not None and 1 <= int(ra) <= 60 for status, ra in results if status == 429), results
        m = srv.metrics()
        assert 0.3 < m["ringserve_cost_prefill_ms"] < 10.0, m["ringserve_cost_prefill_ms"]  # a CPU's, not 0.1
        assert srv.stop() == 0, srv.log()


def test_closed_loop_32_streams_are_never_refused(mid_server):
    """32 closed-loop streams on the mid-size model, each sending its next request when the last
    ends, three each: every request is admitted, as vLLM, transformers and llama.cpp queue them."""
    _wait_idle(mid_server)

    async def stream(s: aiohttp.ClientSession, i: int, statuses: list[int]) -> None:
        for k in range(3):
            body = {
                "prompt": f"Stream {i} request {k}: say something.",
                "max_tokens": 48 + (7 * i + k) % 48,
                "ignore_eos": True,
            }
            async with s.post(mid_server.url + "/v1/completions", json=body) as resp:
                await resp.read()
                statuses.append(resp.status)

    async def run() -> list[int]:
        statuses: list[int] = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(stream(s, i, statuses) for i in range(32)))
        return statuses

    statuses = asyncio.run(run())
    assert _statuses([(st, None) for st in statuses]) == {200: 96}


async def _refuse_a_batch(url: str) -> int:
    """One request running, one queued behind it, then a batch of three prompts with the queued
    work ahead of each: the batch's answer status."""
    long = {"prompt": "a long one", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        streams = [await session.post(url + "/v1/completions", json=long) for _ in range(2)]
        try:
            async with session.post(
                url + "/v1/completions", json={"prompt": ["x", "y", "z"], "max_tokens": 50}
            ) as resp:
                return resp.status
        finally:
            for s in streams:
                s.close()


def test_one_429_counter_counts_what_clients_were_answered(tiny_model_dir, tmp_path):
    """A batch of three prompts refused for the queue is one 429 answer, and every 429 series on
    /metrics says 1: the one counter is `ringserve_requests_rejected_total{status="429"}` (issue 32:
    a second series, the GPU process's count of refused prompts, read 3 here, and disagreed under
    load on one server)."""
    with ServerProcess(tiny_model_dir, tmp_path / "shm", workers=1, max_rows=1, queue_limit_s=0.01) as srv:
        assert asyncio.run(_refuse_a_batch(srv.url)) == 429
        srv.wait_metric('ringserve_requests_rejected_total{status="429"}', lambda v: v >= 1)
        series = {k: v for k, v in srv.metrics().items() if "429" in k}
        assert series == {'ringserve_requests_rejected_total{status="429"}': 1.0}, series
        assert srv.stop() == 0
