"""Grammar-constrained decoding on the real engine under the real scheduler (tiny model): every
constrained answer stays inside its grammar and ends at EOS, seeded constrained output repeats
exactly alone, batched and across preemption, and unconstrained rows are untouched."""

from __future__ import annotations

import re

import llguidance
import pytest
import torch
from tokenizers import Tokenizer

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.grammar import unpack_bitmask
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import FinishReason, SamplingParams

PATTERN = r"(cat|dog) [0-9]{2,4}!"
REGEX = llguidance.LLMatcher.grammar_from_regex(PATTERN)
SCHEMA = llguidance.LLMatcher.grammar_from_json_schema(
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    },
    defaults={"whitespace_flexible": False},
)


def _serve(
    model_dir, rows: list[tuple[int, SamplingParams]], num_blocks: int = 256, max_tokens: int = 40, drop_every: int = 0
):
    """Serve one request per (prompt length, sampling) row (the prompt is a function of its
    length); (tokens per request, finish reasons, preemptions, the engine). `drop_every`: forget
    every matcher each that many steps, as an eviction does."""
    config = Config(num_blocks=num_blocks, max_rows=8, prefill_budget=16, context_limit=512)
    engine = build_executor(config, model_dir)
    sched = Scheduler(
        config, BlockManager(num_blocks, config.block_size), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0
    )
    for i, (prompt_len, sp) in enumerate(rows):
        req = Request(
            key=(0, i),
            request_id=str(i),
            tenant="t",
            prompt_ids=[(7 * prompt_len + k) % 200 + 3 for k in range(prompt_len)],
            max_tokens=max_tokens,
            sampling=sp,
            arrival_ts=0.0,
            deadline_ts=1e9,
        )
        assert sched.admit(req).accepted
        if sp.grammar is not None:
            engine.grammar.compiler.wait(sp.grammar)
    out: dict[tuple[int, int], list[int]] = {}
    reasons: dict[int, FinishReason] = {}
    for step in range(4000):
        if not sched.has_work:
            break
        if drop_every and step % drop_every == drop_every - 1:
            engine.grammar.seqs.clear()
        batch = sched.schedule()
        samples = engine.step(batch) if batch.seqs else None
        for _, ev in sched.update(samples):
            if hasattr(ev, "token_id"):
                out.setdefault((ev.rid, ev.index), []).append(ev.token_id)
            elif hasattr(ev, "reason"):
                reasons[ev.rid] = ev.reason
        sched.check_integrity()
    assert not sched.has_work
    assert sched.kv.bm.num_free == num_blocks
    return {i: out.get((i, 0), []) for i in range(len(rows))}, reasons, sched.preemptions, engine


def _text(model_dir, ids: list[int], eos: frozenset[int]) -> str:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.decode([t for t in ids if t not in eos])


def test_constrained_rows_match_their_grammar_and_stop_at_eos(tiny_model_dir):
    """A random model under a regex and a JSON schema: every answer matches, ends with EOS (stop)."""
    import json

    rows = [(4, SamplingParams(temperature=1.0, seed=s, grammar=g)) for s in range(3) for g in (REGEX, SCHEMA)]
    tokens, reasons, _, engine = _serve(tiny_model_dir, rows)
    for i, (_, sp) in enumerate(rows):
        assert reasons[i] is FinishReason.STOP
        assert tokens[i][-1] in engine.eos_token_ids
        text = _text(tiny_model_dir, tokens[i], engine.eos_token_ids)
        if sp.grammar is REGEX:
            assert re.fullmatch(PATTERN, text), text
        else:
            value = json.loads(text)
            assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert engine.grammar.seqs == {} or all(k in (r + 1 for r in range(len(rows))) for k in engine.grammar.seqs)


def test_seeded_constrained_output_repeats_alone_batched_and_preempted(tiny_model_dir):
    """The same seeded constrained request gives the same tokens alone, beside other rows
    (constrained and not), and in a pool so small that it is preempted and recomputed (it joins
    last, so it is the newest row: the one preemption takes)."""
    words = llguidance.LLMatcher.grammar_from_regex(r"[a-z]+( [a-z]+){12,20}\.")
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=77, grammar=words)
    alone, _, _, _ = _serve(tiny_model_dir, [(22, target)])
    others = [
        (25, SamplingParams(temperature=1.0, seed=3, ignore_eos=True)),
        (21, SamplingParams(temperature=0.8, seed=4, grammar=SCHEMA)),
        (28, SamplingParams(temperature=1.0, seed=5, ignore_eos=True, top_k=20)),
    ]
    batched, _, roomy_preemptions, _ = _serve(tiny_model_dir, others + [(22, target)])
    tight, _, tight_preemptions, _ = _serve(tiny_model_dir, others + [(22, target)], num_blocks=12)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert len(alone[0]) > 12
    assert batched[3] == alone[0] and tight[3] == alone[0]
    assert tight == batched


def test_a_forgotten_matcher_replays_its_output(tiny_model_dir):
    """Matchers dropped mid-answer (eviction, a restart) are rebuilt from the sequence's output: the
    tokens are the same as when they were kept."""
    rows = [(12, SamplingParams(temperature=1.0, seed=s, grammar=g)) for s in (1, 2) for g in (REGEX, SCHEMA)]
    kept, _, _, _ = _serve(tiny_model_dir, rows)
    dropped, _, _, _ = _serve(tiny_model_dir, rows, drop_every=3)
    assert dropped == kept and all(len(t) > 3 for t in kept.values())


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(tiny_model_dir):
    """Rows without a grammar sample the same tokens whether or not constrained rows share the batch."""
    plain = [(20, SamplingParams(temperature=1.0, seed=9, ignore_eos=True)), (26, SamplingParams(temperature=0.0))]
    without, _, _, _ = _serve(tiny_model_dir, plain, max_tokens=24)
    mixed = plain + [(22, SamplingParams(temperature=1.0, seed=1, grammar=REGEX))]
    with_grammar, _, _, _ = _serve(tiny_model_dir, mixed, max_tokens=24)
    assert with_grammar[0] == without[0] and with_grammar[1] == without[1]


def test_max_tokens_cuts_the_structure_with_length(tiny_model_dir):
    """A constrained answer cut by max_tokens ends with `length` (the structure is incomplete)."""
    long_schema = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "array", "items": {"type": "integer"}, "minItems": 50}, defaults={"whitespace_flexible": False}
    )
    tokens, reasons, _, _ = _serve(tiny_model_dir, [(5, SamplingParams(seed=1, grammar=long_schema))], max_tokens=8)
    assert reasons[0] is FinishReason.LENGTH and len(tokens[0]) == 8


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_unpack_bitmask_matches_the_bits(vocab):
    """Bit t % 32 of word t // 32 is token t, for vocabularies that do and do not fill the last word."""
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    allowed = unpack_bitmask(bits, vocab)
    assert allowed.shape == (3, vocab)
    for r in range(3):
        for t in range(vocab):
            assert bool(allowed[r, t]) == bool((int(bits[r, t // 32]) >> (t % 32)) & 1)
