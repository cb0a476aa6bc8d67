"""Request record: states ordered, derived properties, validation."""

import pytest

from ringserve.gpu_proc.request import Request, RequestState, SampleRow, SamplingSpec
from ringserve.gpu_proc.step import RowSampling


def _req(**kw):
    base = dict(key=(0, 1), request_id="r", tenant="k", prompt_ids=[1, 2, 3], max_tokens=4,
                sampling=SamplingSpec(), arrival_ts=0.0, deadline_ts=10.0)
    base.update(kw)
    return Request(**base)


def test_states_are_ordered_waiting_running_finished():
    """Waiting, running and finished are each one comparison on the state."""
    r = _req()
    assert r.is_waiting and not r.is_running and not r.is_finished
    for state, flags in [(RequestState.PREEMPTED, (True, False, False)), (RequestState.PREFILL, (False, True, False)),
                         (RequestState.DECODE, (False, True, False)), (RequestState.DONE, (False, False, True)),
                         (RequestState.CANCELLED, (False, False, True))]:
        r.state = state
        assert (r.is_waiting, r.is_running, r.is_finished) == flags


def test_prefix_is_shared_only_for_n_above_one():
    """n > 1 shares prompt[:-1]; n == 1 has no prefix phase."""
    assert _req().prefix_len == 0
    assert _req(n=3).prefix_len == 2


def test_row_tokens_span_prompt_and_generated():
    """A row's token range reads across the prompt/generated boundary without copying all."""
    row = SampleRow(0, 1, RowSampling(), generated=[7, 8])
    prompt = [1, 2, 3]
    assert row.tokens(prompt, 0, 5) == [1, 2, 3, 7, 8]
    assert row.tokens(prompt, 1, 2) == [2]
    assert row.tokens(prompt, 2, 4) == [3, 7]
    assert row.tokens(prompt, 4, 5) == [8]
    assert row.num_tokens(len(prompt)) == 5


def test_invalid_requests_raise():
    """Empty prompt, max_tokens < 1, n < 1 and bad sampling raise ValueError."""
    with pytest.raises(ValueError):
        _req(prompt_ids=[])
    with pytest.raises(ValueError):
        _req(max_tokens=0)
    with pytest.raises(ValueError):
        _req(n=0)
    with pytest.raises(ValueError):
        SamplingSpec(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingSpec(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingSpec(top_k=-1)


def test_from_submit_maps_every_field():
    """A worker's Submit becomes a Request keyed (worker, rid) with the same settings."""
    from ringserve.shm.messages import SamplingParams, Submit

    msg = Submit(rid=7, request_id="cmpl-1", tenant="key", prompt_ids=[4, 5], max_tokens=9,
                 sampling=SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=(2,),
                                         ignore_eos=True),
                 arrival_ts=1.0, deadline_ts=2.0, n=2, logprobs=1, cache_salt="tenant-salt")
    r = Request.from_submit(3, msg)
    assert r.cache_salt == "tenant-salt"
    assert (r.key, r.request_id, r.tenant, r.prompt_ids, r.max_tokens, r.n, r.logprobs) == (
        (3, 7), "cmpl-1", "key", [4, 5], 9, 2, 1)
    assert r.sampling == SamplingSpec(0.5, 3, 0.9, 11, (2,), True)
    assert (r.arrival_ts, r.deadline_ts, r.state) == (1.0, 2.0, RequestState.QUEUED)
