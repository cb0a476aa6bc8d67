"""Engine stop rules: EOS, stop_token_ids, ignore_eos, max_tokens, the context limit."""

from ringserve.gpu_proc.stops import stop_reason

EOS = frozenset({2})


def _reason(token, generated=1, context=10, **kw):
    kw.setdefault("max_tokens", 5)
    kw.setdefault("context_limit", 100)
    return stop_reason(token, generated, context, eos_token_ids=EOS, **kw)


def test_eos_stops_unless_ignored():
    """EOS gives `stop`; with ignore_eos the sequence goes on."""
    assert _reason(2) == "stop"
    assert _reason(2, ignore_eos=True) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    """A caller's stop token always stops."""
    assert _reason(7, stop_token_ids=frozenset({7}), ignore_eos=True) == "stop"


def test_request_holds_stop_token_ids_as_a_set():
    """However the ids arrive, a request's sampling holds them as a frozenset: the per-token
    check costs one lookup, not a scan of every id (issue 15, break 4)."""
    from ringserve.gpu_proc.request import SamplingSpec

    spec = SamplingSpec(stop_token_ids=(9, 7, 9))
    assert spec.stop_token_ids == frozenset({7, 9}) and isinstance(spec.stop_token_ids, frozenset)


def test_length_limits():
    """max_tokens and the context limit give `length`; a stop token wins over both."""
    assert _reason(5, generated=5) == "length"
    assert _reason(5, context=100) == "length"
    assert _reason(5, generated=4, context=99) is None
    assert _reason(2, generated=5) == "stop"
