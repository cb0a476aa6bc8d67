"""Request record: states ordered, derived properties, validation."""

import pytest

from ringserve.gpu_proc.request import Request, RequestState
from ringserve.shm.messages import SamplingParams


def _req(**kw):
    base = dict(
        key=(0, 1),
        request_id="r",
        tenant="k",
        prompt_ids=[1, 2, 3],
        max_tokens=4,
        sampling=SamplingParams(),
        arrival_ts=0.0,
        deadline_ts=10.0,
    )
    base.update(kw)
    return Request(**base)


def test_states_are_ordered_waiting_running_finished():
    """Waiting, running and finished are each one comparison on the state."""
    r = _req()
    assert r.is_waiting and not r.is_running and not r.is_finished
    for state, flags in [
        (RequestState.PREEMPTED, (True, False, False)),
        (RequestState.PREFILL, (False, True, False)),
        (RequestState.DECODE, (False, True, False)),
        (RequestState.DONE, (False, False, True)),
        (RequestState.CANCELLED, (False, False, True)),
    ]:
        r.state = state
        assert (r.is_waiting, r.is_running, r.is_finished) == flags


def test_sibling_is_the_same_submit_with_its_own_index_and_no_state():
    """An n > 1 Submit's sample i: same key, prompt and settings, its own index, fresh state."""
    r = _req(n=3, cache_salt="s")
    r.generated.append(9)
    r.block_ids.append(4)
    s = r.sibling(2)
    assert (s.key, s.prompt_ids, s.sampling, s.n, s.index, s.cache_salt) == (r.key, r.prompt_ids, r.sampling, 3, 2, "s")
    assert (s.generated, s.block_ids, s.state) == ([], [], RequestState.QUEUED)
    assert s != r  # samples are distinct records even when their fields agree


def test_tokens_span_prompt_and_generated():
    """A request's token range reads across the prompt/generated boundary without copying all."""
    r = _req(generated=[7, 8])
    assert r.tokens(0, 5) == [1, 2, 3, 7, 8]
    assert r.tokens(1, 2) == [2]
    assert r.tokens(2, 4) == [3, 7]
    assert r.tokens(4, 5) == [8]
    assert r.num_tokens == 5


def test_invalid_requests_raise():
    """Empty prompt, max_tokens < 1, n < 1 and a sample index outside n raise ValueError (bad
    sampling is `rules.sampling_violation`'s, tested in tests/test_rules.py)."""
    with pytest.raises(ValueError):
        _req(prompt_ids=[])
    with pytest.raises(ValueError):
        _req(max_tokens=0)
    with pytest.raises(ValueError):
        _req(n=0)
    with pytest.raises(ValueError):
        _req(n=2, index=2)


def test_from_submit_maps_every_field():
    """A worker's Submit becomes a Request keyed (worker, rid) with the same settings."""
    from ringserve.shm.messages import SamplingParams, Submit

    msg = Submit(
        rid=7,
        request_id="cmpl-1",
        tenant="key",
        prompt_ids=[4, 5],
        max_tokens=9,
        sampling=SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=(2,), ignore_eos=True),
        arrival_ts=1.0,
        deadline_ts=2.0,
        n=2,
        logprobs=1,
        cache_salt="tenant-salt",
    )
    r = Request.from_submit(3, msg, cache_per_tenant=False)
    assert r.cache_salt == "tenant-salt"
    assert (r.key, r.request_id, r.tenant, r.prompt_ids, r.max_tokens, r.n, r.logprobs) == (
        (3, 7),
        "cmpl-1",
        "key",
        [4, 5],
        9,
        2,
        1,
    )
    assert r.sampling is msg.sampling and r.stop_ids == frozenset({2})
    assert (r.arrival_ts, r.deadline_ts, r.state) == (1.0, 2.0, RequestState.QUEUED)


def test_from_submit_salts_the_prefix_cache_per_tenant_by_default():
    """Two tenants sending the same prompt (and the same cache_salt, or none) get different salts,
    so neither reuses the other's blocks; one tenant keeps one salt per cache_salt."""
    from ringserve.shm.messages import SamplingParams, Submit

    def salt(tenant: str, cache_salt: str | None) -> str | None:
        msg = Submit(
            rid=1,
            request_id="r",
            tenant=tenant,
            prompt_ids=[4, 5],
            max_tokens=1,
            sampling=SamplingParams(),
            arrival_ts=0.0,
            deadline_ts=1.0,
            cache_salt=cache_salt,
        )
        return Request.from_submit(0, msg).cache_salt

    assert salt("k-a", None) != salt("k-b", None)
    assert salt("k-a", "s") != salt("k-b", "s")
    assert salt("k-a", None) == salt("k-a", None) != salt("k-a", "s")
