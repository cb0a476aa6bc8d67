"""Constants and small helpers of the API tests that run an app on the in-process fake GPU
(fixtures in tests/api/conftest.py)."""

from __future__ import annotations

from ringserve.api.tokenizer import TextCodec

MODEL = "tiny-test"  # the model name the test apps serve


def prompt_text_of(codec: TextCodec, text: str) -> list[int]:
    """The ids the fake GPU echoes for `text` (the tokenizer adds BOS, which decodes to "")."""
    return codec.encode(text)
