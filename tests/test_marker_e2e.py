"""The design's marker test on the real model (`docs/design.md#experiments`): 200 concurrent
requests, each with its own code that SmolLM2 copies; every answer holds its own code and none
holds another's. A wrong block table, a stale prefix reuse or a crossed stream would leak.

The pool is small (40 blocks of 16 tokens for 200 requests of ~3 blocks each), so blocks are reused
all the time and decoding rows are preempted and recomputed: the test sees the block manager, the
prefix cache and preemption at work, not a pool so large that no block is ever handed out twice.
A planted fault (block tables swapped between decode rows of the same size) must fail it.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(600)

# Codes the model copies reliably: eight distinct characters (a 135M model drops a doubled or
# repeated letter now and then, which would fail the test for the wrong reason), drawn from a
# fixed seed, so every run sends the same 200 codes, each checked to be copied.
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
CODE_SEED = 12
MARKER_PROMPT = "The secret code is {code}. Remember it: {code}. I repeat, the secret code is"
POOL_BLOCKS = 40

# Test only: the broken block table the marker test exists to catch. Decode rows whose tables
# have the same length swap them, so each reads (and writes) another request's keys and values.
SWAPPED_TABLES = """
from ringserve.gpu_proc import scheduler

_schedule = scheduler.Scheduler.schedule


def _swapped(self, now=None):
    batch = _schedule(self, now)
    by_len = {}
    for s in batch.seqs:
        if len(s.token_ids) == 1:
            by_len.setdefault(len(s.block_table), []).append(s)
    for group in by_len.values():
        for a, b in zip(group[::2], group[1::2]):
            a.block_table, b.block_table = b.block_table, a.block_table
    return batch


scheduler.Scheduler.schedule = _swapped
"""


def marker_violations(codes: list[str], answers: list[str]) -> list[str]:
    """Every answer must contain its own code and no other request's code."""
    problems = []
    for i, (code, answer) in enumerate(zip(codes, answers)):
        if code not in answer:
            problems.append(f"request {i}: its code {code} is missing from {answer!r}")
        problems += [
            f"request {i}: holds {other}, another request's code"
            for other in codes
            if other != code and other in answer
        ]
    return problems


def _codes() -> list[str]:
    rng = random.Random(CODE_SEED)
    return list(dict.fromkeys("".join(rng.sample(CODE_ALPHABET, 8)) for _ in range(200)))


def _ask_all(url: str, codes: list[str], models: list[str | None] | None = None) -> list[str]:
    async def ask(session, code, model):
        body = {"prompt": MARKER_PROMPT.format(code=code), "max_tokens": 10, "temperature": 0}
        if model is not None:
            body["model"] = model
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["text"]

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*[ask(s, c, m) for c, m in zip(codes, models or [None] * len(codes))])

    return asyncio.run(main())


def _serve(smollm2_dir, shm_dir, **kw) -> ServerProcess:
    # queue_limit_s: 200 requests at once are far above 2 s of estimated CPU work; the test is
    # about what the rows read, not about admission.
    return ServerProcess(
        smollm2_dir, shm_dir, workers=1, num_blocks=POOL_BLOCKS, queue_limit_s=600, ready_timeout_s=300, **kw
    )


def test_marker_200_concurrent_requests_on_a_small_pool_each_copy_only_their_own_code(smollm2_dir, tmp_path):
    """200 concurrent requests through 40 blocks: blocks are reused and rows preempted, and every
    answer holds its own code and no other's."""
    codes = _codes()
    with _serve(smollm2_dir, tmp_path) as srv:
        answers = _ask_all(srv.url, codes)
        m = srv.metrics()
        assert srv.stop() == 0, srv.log()
    assert len(codes) == 200
    assert marker_violations(codes, answers) == []
    # Blocks were handed out again and again (200 x 3 blocks through 40), and rows were preempted.
    assert m["ringserve_preemptions_total"] > 0, m
    # The check bites: two answers swapped (a crossed stream) are two missing codes and two leaks.
    swapped = [answers[1], answers[0], *answers[2:]]
    assert len(marker_violations(codes, swapped)) == 4


def test_planted_swapped_block_tables_are_caught(smollm2_dir, tmp_path):
    """Planted: decode rows swap block tables. The marker check must find answers with missing or
    foreign codes (it found 108 such violations when issue 12 planted a broken table)."""
    codes = _codes()[:64]
    with _serve(smollm2_dir, tmp_path, sitecustomize=SWAPPED_TABLES) as srv:
        answers = _ask_all(srv.url, codes)
        srv.stop()
    problems = marker_violations(codes, answers)
    print(f"planted swapped tables: {len(problems)} violations in {len(codes)} answers")
    assert len(problems) >= len(codes) // 4, problems[:5]


def test_marker_with_four_adapters_and_the_base_model_mixed_in_its_steps(smollm2_dir, tmp_path):
    """The marker test with LoRA adapters: 100 requests spread over the base model and 4 random
    adapters (small enough that SmolLM2 still copies) with 2 resident slots, through the small
    pool: steps mix adapters, adapters drain and swap, rows are preempted, blocks are reused under
    adapter-salted hashes, and still every answer holds its own code and no other's."""
    import json

    from ringserve.gpu_proc.model.loader import model_args_from_config
    from ringserve.tools.bench.lora import write_adapter

    args = model_args_from_config(json.loads((smollm2_dir / "config.json").read_text()), smollm2_dir)
    names = [f"m{i}" for i in range(4)]
    modules = " ".join(f"{n}={write_adapter(tmp_path / n, args, 8, i, alpha=0.8)}" for i, n in enumerate(names))
    codes = _codes()[:100]
    models = [None, *names]
    with _serve(smollm2_dir, tmp_path / "shm", lora_modules=modules, max_loras=2, dtype="float32") as srv:
        answers = _ask_all(srv.url, codes, [models[i % len(models)] for i in range(len(codes))])
        m = srv.metrics()
        assert srv.stop() == 0, srv.log()
    assert marker_violations(codes, answers) == []
    assert m["ringserve_preemptions_total"] > 0, m
