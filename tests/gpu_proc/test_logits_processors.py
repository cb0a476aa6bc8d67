"""The logits controls (`gpu_proc/logits_processors.py`) against a reference written in numpy from
vLLM's definitions, on fixed logits; raw logprobs; the per-sequence state; batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.gpu_proc import logits_processors as lp
from ringserve.gpu_proc.executor import sample_rows
from ringserve.gpu_proc.logits_processors import ControlsState
from ringserve.gpu_proc.sampler import sample
from ringserve.gpu_proc.step import RowControls, RowSampling, SeqStep
from ringserve.shm.messages import SamplingParams

VOCAB = 64
EOS = 2


def reference(
    logits: np.ndarray, st: SamplingParams, prompt: list[int], output: list[int], temperature: float
) -> np.ndarray:
    """vLLM's order: allowed ids, bad words, min_tokens, logit_bias, repetition / frequency /
    presence penalties, then min_p on the temperature-scaled distribution."""
    z = logits.astype(np.float64).copy()
    if st.allowed_token_ids:
        keep = np.zeros(VOCAB, bool)
        keep[list(st.allowed_token_ids)] = True
        z[~keep] = -np.inf
    for words in st.bad_words:
        prefix = list(words[:-1])
        if not prefix or output[-len(prefix) :] == prefix:
            z[words[-1]] = -np.inf
    if len(output) < st.min_tokens:
        z[list(st.stop_token_ids) + [EOS]] = -np.inf
    for tok, bias in st.logit_bias:
        z[tok] += bias
    counts = np.bincount(np.array(output, dtype=int), minlength=VOCAB)[:VOCAB] if output else np.zeros(VOCAB)
    seen = counts > 0
    seen[prompt] = True
    rep = st.repetition_penalty
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
    z = z - st.frequency_penalty * counts - st.presence_penalty * (counts > 0)
    if st.min_p and temperature >= 1e-5:
        with np.errstate(invalid="ignore"):
            p = np.exp((z - z.max()) / temperature)
        p /= p.sum()
        z[p < st.min_p * p.max()] = -np.inf
    return z


def _row(seq_id: int, st: SamplingParams | None, prompt, output, temperature=1.0, seed=0, logprobs=None) -> SeqStep:
    controls = None if st is None else RowControls(st, list(prompt), list(output))
    tok = output[-1] if output else prompt[-1]
    sampling = RowSampling(temperature=temperature, seed=seed, logprobs=logprobs, controls=controls)
    return SeqStep(seq_id, [tok], len(prompt) + len(output) - 1, [0], sampling)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(0, 3, (rows, VOCAB)).astype(np.float32))


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition<1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=1.3),
    "presence": SamplingParams(presence_penalty=-0.8),
    "all penalties": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.7),
    "logit_bias": SamplingParams(logit_bias=((3, 9.5), (40, -100.0))),
    "min_p": SamplingParams(min_p=0.07),
    "min_tokens": SamplingParams(min_tokens=9, stop_token_ids=(5, 6)),
    "allowed": SamplingParams(allowed_token_ids=(1, 4, 9, 33)),
    "bad_words": SamplingParams(bad_words=((7,), (12, 13), (20, 21, 22), (30, 31))),
    "everything": SamplingParams(
        repetition_penalty=1.4,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        min_p=0.02,
        logit_bias=((9, 2.0),),
        bad_words=((12, 13),),
        min_tokens=3,
        stop_token_ids=(4,),
    ),
}
PROMPT = [1, 3, 3, 9, 40, 12]
OUTPUT = [3, 20, 21, 9, 9, 12]  # ends with the prefix of the bad word (12, 13), not of (20, 21, 22)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_each_control_matches_the_numpy_reference(name, temperature):
    """Processed logits equal the reference; a row without controls is left as it was."""
    st = CASES[name]
    logits = _logits(3)
    raw = logits.clone()
    rows = [
        _row(1, st, PROMPT, OUTPUT, temperature),
        _row(2, None, PROMPT, OUTPUT),
        _row(3, st, PROMPT, OUTPUT[:2], temperature),
    ]
    plan = ControlsState(VOCAB, {EOS}, torch.device("cpu")).plan(rows)
    with torch.inference_mode():
        plan.apply(logits)
    for i, out in ((0, OUTPUT), (2, OUTPUT[:2])):
        want = reference(raw[i].numpy(), st, PROMPT, out, temperature)
        got = logits[i].double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), name
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[1], raw[1])


def test_rows_with_different_controls_in_one_step():
    """Each controlled row gets exactly its own controls (penalties, min_p, bias and masks mixed
    in one step), and the raw logits kept for the logprobs are left as they were."""
    settings = [CASES["all penalties"], CASES["min_p"], CASES["logit_bias"], CASES["repetition"], CASES["bad_words"]]
    logits = _logits(len(settings) + 1, seed=7)
    raw_in = logits.clone()
    rows = [_row(i, st, PROMPT, OUTPUT, 0.9) for i, st in enumerate(settings)] + [_row(9, None, PROMPT, OUTPUT)]
    # all of them; and only rows that need no copy of the raw logits (penalties, min_p)
    for kept in ([0, 1, 2, 3, 4, 5], [0, 1, 3, 5]):
        logits = raw_in[kept].clone()
        plan = ControlsState(VOCAB, {EOS}, torch.device("cpu")).plan([rows[i] for i in kept])
        with torch.inference_mode():
            raw = plan.apply(logits)
        controlled = [j for j, i in enumerate(kept) if i < len(settings)]
        torch.testing.assert_close(raw, raw_in[[kept[j] for j in controlled]])
        for j in controlled:
            want = reference(raw_in[kept[j]].numpy(), settings[kept[j]], PROMPT, OUTPUT, 0.9)
            got = logits[j].double().numpy()
            assert np.array_equal(np.isneginf(got), np.isneginf(want))
            np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
        assert torch.equal(logits[-1], raw_in[-1])


def test_no_controls_no_plan():
    """A step whose rows ask for no control does no work here (no plan, no state)."""
    state = ControlsState(VOCAB, {EOS}, torch.device("cpu"))
    assert state.plan([_row(1, None, PROMPT, OUTPUT), _row(2, None, PROMPT, [])]) is None
    assert state.seqs == {} and state.counts.shape[0] == 0


def test_logprobs_are_the_raw_distributions():
    """A greedy row's token follows the processed logits, its logprobs the raw ones (vLLM's default)."""
    st = SamplingParams(logit_bias=((11, 100.0),))
    logits = _logits(1, seed=3)
    raw = torch.log_softmax(logits[0].clone(), -1)
    row = _row(1, st, PROMPT, OUTPUT, temperature=0.0, logprobs=2)
    out = sample_rows(ControlsState(VOCAB, {EOS}, torch.device("cpu")), logits, [row])
    assert out.token_ids == [11]
    assert out.logprobs[0] == pytest.approx(raw[11].item(), abs=1e-5)
    top = torch.topk(raw, 2)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_counts_follow_the_output_and_survive_eviction(monkeypatch):
    """The device counts grow by the token sampled since the last step; a sequence evicted after a
    long wait is rebuilt from its token lists, exactly."""
    monkeypatch.setattr(lp, "EVICT_AFTER_STEPS", 2)
    st = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)
    state = ControlsState(VOCAB, {EOS}, torch.device("cpu"))
    prompt, output = [5, 6], []
    rng = np.random.default_rng(1)
    for step in range(12):
        rows = [_row(7, st, prompt, output)]
        if step in (4, 5, 6):  # the row waits (preempted) while others sample: its slot is evicted
            rows = [_row(100 + step, st, prompt, [1])]
        logits = _logits(1, seed=step)
        raw = logits.clone()
        plan = state.plan(rows)
        with torch.inference_mode():
            plan.apply(logits)
        if rows[0].seq_id == 7:
            want = reference(raw[0].numpy(), st, prompt, output, 1.0)
            np.testing.assert_allclose(logits[0].double().numpy(), want, rtol=1e-5, atol=1e-5)
            output.append(int(rng.integers(VOCAB)))
    assert 7 in state.seqs and len(state.seqs) <= 3


def test_seeded_rows_with_controls_are_batch_invariant():
    """A seeded row with penalties samples the same token alone and among other rows with other
    controls (randomness is a function of seed, index and position only)."""
    st = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, min_p=0.05)
    other = SamplingParams(allowed_token_ids=(1, 2, 3))
    alone, together = [], []
    for seed in range(20):
        logits = _logits(3, seed=100 + seed)
        row = _row(1, st, PROMPT, OUTPUT, temperature=0.9, seed=seed)
        alone += sample_rows(ControlsState(VOCAB, {EOS}, torch.device("cpu")), logits[1:2].clone(), [row]).token_ids
        batch = [_row(2, other, PROMPT, [], 0.5, seed=7), row, _row(3, None, PROMPT, OUTPUT, 1.0, seed=9)]
        together.append(
            sample_rows(ControlsState(VOCAB, {EOS}, torch.device("cpu")), logits.clone(), batch).token_ids[1]
        )
    assert alone == together
    assert len(set(alone)) > 3  # really sampled, not one forced token


def test_controls_change_what_is_sampled():
    """The same seeded rows without controls sample other tokens (the controls are not a no-op)."""
    st = SamplingParams(logit_bias=((17, 30.0),))
    logits = _logits(4, seed=5)
    rows = [_row(i, st, PROMPT, OUTPUT, 1.0, seed=i) for i in range(4)]
    plain = sample(
        logits.clone(), [RowSampling(temperature=1.0, seed=i) for i in range(4)], [s.context_len for s in rows]
    ).token_ids
    biased = sample_rows(ControlsState(VOCAB, {EOS}, torch.device("cpu")), logits.clone(), rows).token_ids
    assert biased == [17] * 4 and plain != biased


def test_masks_that_leave_nothing_still_keep_the_allowed_set():
    """A row whose bad words and min_tokens ban its only allowed tokens (the API refuses such a
    request; this is the GPU process's last line) samples among its allowed tokens, never outside."""
    st = SamplingParams(allowed_token_ids=(EOS, 9), bad_words=((9,),), min_tokens=3)
    for seed in range(10):
        logits = _logits(1, seed=seed)
        logits[0, 9] = -50.0  # neither allowed token is likely: a raw fallback would pick another
        logits[0, EOS] = -50.0
        out = sample_rows(
            ControlsState(VOCAB, {EOS}, torch.device("cpu")), logits, [_row(1, st, PROMPT, [], 1.0, seed=seed)]
        )
        assert out.token_ids[0] in (EOS, 9)


@pytest.mark.parametrize("name", ["all penalties", "bad_words", "min_tokens reached in the draft", "everything"])
def test_a_draft_rows_verified_positions_see_the_draft_as_output(name):
    """Speculative decoding: at each position a draft row verifies, the controls count the draft
    tokens before it as output already produced (penalties, bad words, min_tokens), exactly as
    plain decoding would once those tokens were sampled."""
    st = SamplingParams(min_tokens=6, stop_token_ids=(5, 6)) if name.startswith("min_tokens") else CASES[name]
    out, draft = OUTPUT[:4], [9, 12, 3]  # the draft completes the bad word prefix (12,) and repeats 9
    controls = RowControls(st, list(PROMPT), list(out))
    sampling = RowSampling(temperature=0.8, controls=controls)
    row = SeqStep(1, [out[-1], *draft], len(PROMPT) + len(out) - 1, [0], sampling, draft=3)
    rows = row.verified_rows()
    assert [r.context_len for r in rows] == [len(PROMPT) + len(out) + j for j in range(4)]
    logits = _logits(4, seed=3)
    raw = logits.clone()
    state = ControlsState(VOCAB, {EOS}, torch.device("cpu"))
    with torch.inference_mode():
        state.plan(rows).apply(logits)
    for j in range(4):
        want = reference(raw[j].numpy(), st, PROMPT, out + draft[:j], 0.8)
        got = logits[j].double().numpy()
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), (name, j)
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
