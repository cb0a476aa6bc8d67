"""The message schema's limits: the largest legal Submit fits the bound the supervisor checks."""

from __future__ import annotations

from ringserve.shm import messages as M


def test_largest_legal_submit_fits_max_submit_bytes():
    """A Submit at the context limit, with the largest ids, every stop id, the longest request id
    and cache salt (4-byte characters) encodes within max_submit_bytes."""
    limit = 8192
    submit = M.Submit(
        rid=2**62, request_id="r" * M.MAX_REQUEST_ID_CHARS, tenant="k-" + "f" * 16,
        prompt_ids=[2**31 - 1] * (limit - 1), max_tokens=1,
        sampling=M.SamplingParams(temperature=1.5, top_k=2**31 - 1, top_p=0.5, seed=-(2**63),
                                  stop_token_ids=tuple(range(2**31 - M.MAX_STOP_TOKEN_IDS, 2**31)),
                                  ignore_eos=True),
        arrival_ts=1.7e9, deadline_ts=1.7e9 + 600.0, n=16, logprobs=20,
        cache_salt="\U0001f600" * M.MAX_CACHE_SALT_CHARS)
    assert len(M.encode(submit)) <= M.max_submit_bytes(limit)
