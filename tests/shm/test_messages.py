"""The message schema's limits: the largest legal Submit and step output fit the bounds the
supervisor checks against the ring record limit."""

from __future__ import annotations

from ringserve.rules import PROMPT_LOGPROB_TOKENS_PER_STEP
from ringserve.shm import messages as M

BIG_ID = 2**31 - 1


def test_largest_legal_submit_fits_max_submit_bytes():
    """A Submit at the context limit, with the largest ids, every stop id, every control at its
    limit, the longest request id and cache salt (4-byte characters) encodes within max_submit_bytes."""
    limit = 8192
    submit = M.Submit(
        rid=2**62,
        request_id="r" * M.MAX_REQUEST_ID_CHARS,
        tenant="k-" + "f" * 16,
        prompt_ids=[BIG_ID] * (limit - 1),
        max_tokens=1,
        sampling=M.SamplingParams(
            temperature=1.5,
            top_k=BIG_ID,
            top_p=0.5,
            seed=-(2**63),
            stop_token_ids=tuple(range(2**31 - M.MAX_STOP_TOKEN_IDS, 2**31)),
            ignore_eos=True,
            presence_penalty=-1.7,
            frequency_penalty=1.3,
            repetition_penalty=1.1e-3,
            min_p=0.123456789,
            min_tokens=BIG_ID,
            logit_bias=tuple((BIG_ID - i, -99.123456789) for i in range(M.MAX_LOGIT_BIAS)),
            allowed_token_ids=tuple(range(BIG_ID - M.MAX_ALLOWED_TOKEN_IDS, BIG_ID)),
            bad_words=tuple((BIG_ID,) * M.MAX_BAD_WORD_TOKENS for _ in range(M.MAX_BAD_WORDS)),
        ),
        arrival_ts=1.7e9,
        deadline_ts=1.7e9 + 600.0,
        n=16,
        logprobs=20,
        prompt_logprobs=20,
        cache_salt="\U0001f600" * M.MAX_CACHE_SALT_CHARS,
    )
    assert len(M.encode(submit)) <= M.max_submit_bytes(limit)


def test_largest_step_output_fits_max_step_output_bytes():
    """A step's output for every row (a token with the most alternatives and a finish each) and
    the most prompt tokens one step scores, each with the most alternatives, within the bound."""
    rows = 256
    top = [(BIG_ID, -123.456789)] * M.MAX_TOP_LOGPROBS
    out = M.StepOutput(
        step=2**62,
        tokens=[M.Token(2**62, 15, BIG_ID, -1e-30, top) for _ in range(rows)],
        finishes=[M.Finish(2**62, 15, "cancelled", 8191, 8191, 1e12, 1e12) for _ in range(rows)],
        prompt_logprobs=[
            M.PromptLogprobs(2**62, 8000, [-1e-30] * 8, [BIG_ID] * 8, [top] * 8)
            for _ in range(PROMPT_LOGPROB_TOKENS_PER_STEP // 8)
        ],
    )
    assert len(M.encode(out)) <= M.max_step_output_bytes(rows, PROMPT_LOGPROB_TOKENS_PER_STEP)
