"""The shared request rules: when a sequence finishes (EOS, stop_token_ids, ignore_eos, max_tokens,
the context limit), whether a request fits the context, whether its ids are in the vocabulary."""

from ringserve.rules import context_error, finish_reason, vocabulary_error

EOS = frozenset({2})


def _reason(token, generated=1, context=10, **kw):
    kw.setdefault("max_tokens", 5)
    kw.setdefault("context_limit", 100)
    return finish_reason(token, generated, context, eos_token_ids=EOS, **kw)


def test_eos_stops_unless_ignored():
    """EOS gives `stop`; with ignore_eos the sequence goes on."""
    assert _reason(2) == "stop"
    assert _reason(2, ignore_eos=True) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    """A caller's stop token always stops."""
    assert _reason(7, stop_token_ids=frozenset({7}), ignore_eos=True) == "stop"


def test_request_holds_stop_token_ids_as_a_set():
    """However the ids arrive, a request holds them as a frozenset: the per-token check costs one
    lookup, not a scan of every id (issue 15, break 4)."""
    from tests.helpers.scheduler_fakes import make_request

    req = make_request(1, 4, stop_token_ids=(9, 7, 9))
    assert req.stop_ids == frozenset({7, 9}) and isinstance(req.stop_ids, frozenset)


def test_length_limits():
    """max_tokens and the context limit give `length`; a stop token wins over both."""
    assert _reason(5, generated=5) == "length"
    assert _reason(5, context=100) == "length"
    assert _reason(5, generated=4, context=99) is None
    assert _reason(2, generated=5) == "stop"


def test_context_error_names_the_counts_and_the_limit():
    """Fitting exactly is fine; one over names both counts and the limit, and a byte-length lower
    bound says so."""
    assert context_error(90, 10, 100) is None
    msg = context_error(91, 10, 100)
    assert "91 tokens" in msg and "max_tokens (10)" in msg and "100" in msg
    assert "at least 200 tokens" in context_error(200, 1, 100, at_least=True)
    # no fixed max_tokens (or only a cap): room for one token is enough, and max_tokens is not named
    assert context_error(99, None, 100) is None
    assert "max_tokens" not in context_error(100, None, 100) and "no room for an answer" in context_error(
        100, None, 100
    )
    assert context_error(100, 0, 100) is None and "max_tokens" not in context_error(101, 0, 100)


def test_vocabulary_error_names_the_first_bad_id():
    assert vocabulary_error([0, 5, 9], 10) is None
    assert "id 10" in vocabulary_error([3, 10, -1], 10) and "0..9" in vocabulary_error([10], 10)
    assert vocabulary_error([-1], 10).startswith("prompt holds token id -1")


def test_constraints_error_refuses_controls_that_could_mask_every_token():
    """Allowed ids that are all stop tokens under min_tokens, or all the last tokens of bad words,
    are refused; one token that escapes every mask is enough; without allowed ids, only a ban of
    the whole vocabulary is refused."""
    from ringserve.rules import constraints_error

    def err(allowed=(), stops=(), min_tokens=0, bad=(), vocab=100):
        return constraints_error(
            allowed_token_ids=allowed,
            stop_token_ids=stops,
            eos_token_ids={1},
            min_tokens=min_tokens,
            bad_words=bad,
            vocab_size=vocab,
        )

    assert err(allowed=(1,), min_tokens=5) is not None  # the only allowed token is EOS
    assert err(allowed=(1,)) is None  # no min_tokens: EOS may end the answer
    assert err(allowed=(7,), bad=((7,),)) is not None
    assert err(allowed=(7,), bad=((3, 7),)) is not None  # after a 3, nothing would be left
    assert err(allowed=(7, 8), bad=((7,),), stops=(8,), min_tokens=2) is not None
    assert err(allowed=(7, 8), bad=((7,),)) is None
    assert err(stops=tuple(range(100)), min_tokens=1) is not None
    assert err(stops=tuple(range(99)), min_tokens=1) is None
