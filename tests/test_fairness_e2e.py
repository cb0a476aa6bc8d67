"""The design's fairness experiment on the real model with default flags (`docs/design.md#fairness`,
`#admission`; issue 22, item 5): key A floods, key B sends one short request a second. B is never
refused (admission charges A's queue to A) and B starts fast (fair preemption starts each B
request within `fair_preempt_steps + 1` passes).

The design's experiment (A sends 100 at once) asserts its figure, B's p95 TTFT under 1 s. With A
keeping 48 in flight (issue 22), A's requests start and end in waves: when a wave of ~27 rows ends
together, the next step holds the prompts of all their successors (the prefill budget rises to 6x
with 5 rows decoding) and on two CPU cores that one step takes ~1.7 s; a B request arriving then
waits it out (B's TTFT max 3.4 s, p95 1.4–1.6 s in such runs; with `--prefill-budget 64` the
longest step was 0.57 s and B's max 1.3 s). That is a property of the step budget on a slow device,
not of admission or fair queueing, so this case asserts B is never refused (9 of 15 were before
the per-tenant ledger), its median TTFT is under 1 s and its worst under 5 s, and prints them all.
`ringserve bench fairness` runs the same clients and floods and reports the figures.
"""

from __future__ import annotations

import asyncio

import pytest

from ringserve.tools.bench_fairness import BAnswer, burst, in_flight, wait_idle, warm_up
from ringserve.tools.sched_sim import percentile
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    """SmolLM2 with every admission and fairness flag at its default, warmed up (`warm_up`)."""
    with ServerProcess(smollm2_dir, tmp_path_factory.mktemp("shm"), workers=1, ready_timeout_s=300) as srv:
        asyncio.run(warm_up(srv.url))
        yield srv
        assert srv.stop() == 0, srv.log()


def _report(name: str, b: list[BAnswer], a_statuses: list[int]) -> list[float]:
    ttft = [x.ttft_s for x in b if x.status == 200 and x.ttft_s is not None]
    a_refused = sum(s == 429 for s in a_statuses)
    print(
        f"{name}: B {sum(x.status == 200 for x in b)}/{len(b)} admitted, TTFT median "
        f"{percentile(ttft, 50) * 1000:.0f} ms, p95 {percentile(ttft, 95) * 1000:.0f} ms, max "
        f"{max(ttft) * 1000:.0f} ms (all: {sorted(round(t * 1000) for t in ttft)}; server queue ms: "
        f"{[round(x.queue_ms) for x in b if x.queue_ms is not None]}); A {len(a_statuses)} answered in the "
        f"window, {a_refused} of them 429"
    )
    assert [x.status for x in b] == [200] * len(b), b
    assert len(ttft) == len(b)
    return ttft


def test_b_is_never_refused_and_starts_fast_while_a_keeps_48_in_flight(server):
    """A: 48 requests of 200 tokens in flight, each refilled as it ends (after the Retry-After
    when refused); B: one a second."""
    wait_idle(server.url)
    b, a_statuses = asyncio.run(asyncio.wait_for(in_flight(server.url, 48), 300))
    ttft = _report("48 in flight", b, a_statuses)
    assert percentile(ttft, 50) < 1.0 and max(ttft) < 5.0, ttft


def test_b_is_never_refused_and_starts_fast_after_a_sends_100_at_once(server):
    """A: 100 long requests at once (32 run, some queue, the rest are refused); B: one a second."""
    wait_idle(server.url)
    b, a_statuses = asyncio.run(asyncio.wait_for(burst(server.url), 300))
    ttft = _report("100 at once", b, a_statuses)
    assert percentile(ttft, 95) < 1.0, ttft
