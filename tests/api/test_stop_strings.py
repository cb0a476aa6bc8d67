"""Stop strings over arbitrary splits of the text into token pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.api.stop_strings import StopMatcher


def _run(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return out, True
    out.append(m.flush())
    return out, False


def _expected(stops: tuple[str, ...], text: str) -> tuple[str, bool]:
    """Character by character: the first stop string to complete, cut where it starts."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - len(max(done, key=len))], True
    return text, False


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc世", max_size=30),
    stops=st.lists(st.text(alphabet="abc世", min_size=1, max_size=4), min_size=1, max_size=3),
    data=st.data(),
)
def test_any_split_gives_the_text_cut_at_the_first_stop(text, stops, data):
    """However the text is split into pieces, the output is cut before the first stop to complete."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out, hit = _run(tuple(stops), pieces)
    assert ("".join(out), hit) == _expected(tuple(stops), text)


def test_prefix_is_held_until_it_cannot_match():
    """'ab' could start 'abc': it waits; 'abd' cannot, so it is released with the 'd'."""
    m = StopMatcher(("abc",))
    assert m.feed("xab") == ("x", False)
    assert m.feed("d") == ("abd", False)


def test_stop_across_three_pieces():
    """'END' split as 'E','N','D' is caught and nothing of it is emitted."""
    assert _run(("END",), ["abc E", "N", "D more"]) == (["abc ", "", ""], True)


def test_empty_stop_refused():
    """An empty stop string would match everywhere; it is a ValueError."""
    with pytest.raises(ValueError):
        StopMatcher(("",))
