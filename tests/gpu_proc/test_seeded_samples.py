"""Seeded n > 1 outputs on the real tiny model stay what they were before n > 1 became sibling
requests (issue 14): the same (seed, sample index) streams the same tokens, with the prefix cache on
or off and with preemption. `data/seeded_n_samples.json` was recorded from the code before the
change (`RINGSERVE_RECORD_SEEDED=1 pytest this file` rewrites it; only ever do that on purpose)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import SamplingParams
from tests.helpers.engine_loop import serve_until_idle

RECORDED = Path(__file__).parent / "data" / "seeded_n_samples.json"
# prompt lengths around the 16-token block: shorter than one block, one block exactly, just past
# it, and several blocks with a partial tail
PROMPT_LENS = (3, 16, 17, 40)
# the tight pools force preemption (of the code before and after the change alike)
CASES = {
    "cache-on": (True, 256),
    "cache-off": (False, 256),
    "cache-on-tight": (True, 12),
    "cache-off-tight": (False, 12),
}


def _serve(model_dir, prefix_caching: bool, num_blocks: int) -> tuple[dict[str, list[int]], int]:
    """Four n = 3 requests (and one n = 1) with seeds, served to completion: '<rid>/<index>' ->
    tokens, and the preemptions."""
    config = Config(
        num_blocks=num_blocks,
        max_rows=8,
        prefill_budget=24,
        context_limit=512,
        max_tokens_limit=64,
        prefix_caching=prefix_caching,
    )
    engine = build_executor(config, model_dir)
    sched = Scheduler(
        config, BlockManager(num_blocks, config.block_size), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0
    )
    for i, plen in enumerate(PROMPT_LENS + (21,)):
        req = Request(
            key=(0, i),
            request_id=str(i),
            tenant="t",
            prompt_ids=[(5 + 11 * k + i) % 200 + 3 for k in range(plen)],
            max_tokens=14,
            n=3 if i < len(PROMPT_LENS) else 1,
            arrival_ts=0.0,
            deadline_ts=1e9,
            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=4242 + i, ignore_eos=True),
        )
        assert sched.admit(req).accepted
    streams: dict[tuple[int, int], list[int]] = {}
    serve_until_idle(sched, engine, streams, max_steps=1000)
    return {f"{rid}/{index}": t for (rid, index), t in sorted(streams.items())}, sched.stats().preemptions


@pytest.fixture(scope="module")
def recorded(tiny_model_dir):
    if os.environ.get("RINGSERVE_RECORD_SEEDED") == "1":
        RECORDED.write_text(
            json.dumps({name: _serve(tiny_model_dir, *args)[0] for name, args in CASES.items()}, indent=1) + "\n"
        )
    return json.loads(RECORDED.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_samples_equal_the_recording(tiny_model_dir, recorded, case):
    """Each (seed, sample index) streams exactly the tokens recorded before the change."""
    got, preemptions = _serve(tiny_model_dir, *CASES[case])
    assert len(got) == 3 * len(PROMPT_LENS) + 1 and all(len(t) == 14 for t in got.values())
    assert (preemptions > 0) == case.endswith("tight")
    assert got == recorded[case]
