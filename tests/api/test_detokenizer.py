"""Incremental detokenization equals a full decode and never emits half a character."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.api.detokenizer import Detokenizer
from ringserve.api.tokenizer import TextCodec

_TEXTS = st.text(alphabet=st.sampled_from(list("ab 世界こんにちは🎉🧑‍🚀ñé\n")), min_size=1, max_size=40)


def _stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


@settings(max_examples=60, deadline=None)
@given(text=_TEXTS)
def test_streamed_text_equals_the_text(codec, text):
    """Pieces joined give back the text, and no piece holds a replacement character."""
    pieces = _stream(Detokenizer(codec), codec.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=1804), min_size=1, max_size=30))
def test_arbitrary_ids_match_full_decode(codec, ids):
    """Any id sequence, valid UTF-8 or not, streams to what a full decode gives."""
    assert "".join(_stream(Detokenizer(codec), ids)) == codec.decode(ids)


@settings(max_examples=30, deadline=None)
@given(text=_TEXTS)
def test_window_fallback_matches(tiny_model_dir, text):
    """Without a byte table (a non-byte-level tokenizer) the window decoder gives the same text."""
    codec = TextCodec.from_dir(tiny_model_dir)
    codec.byte_table = None
    pieces = _stream(Detokenizer(codec), codec.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_emoji_bytes_held_until_complete(codec):
    """A four-byte emoji fed one byte token at a time appears whole with its last byte."""
    byte_ids = [codec.byte_table.index(bytes([b])) for b in "🎉".encode()]
    detok = Detokenizer(codec)
    assert [detok.push(i) for i in byte_ids] == ["", "", "", "🎉"]


def test_special_tokens_are_silent(codec):
    """BOS/EOS decode to nothing in the stream."""
    detok = Detokenizer(codec)
    assert [detok.push(i) for i in sorted(codec.special_ids)] == [""] * len(codec.special_ids)
