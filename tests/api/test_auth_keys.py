"""The API keys file and constant-time key checks, without a server."""

from __future__ import annotations

import pytest

from ringserve.api.auth import load_keys


def test_load_keys_skips_comments_and_refuses_empty(tmp_path):
    """Keys files: one key per line, comments ignored; an empty file is an error."""
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-one\n\n  sk-two  trailing-note\n")
    assert load_keys(path) == frozenset({"sk-one", "sk-two"})
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no keys"):
        load_keys(path)
