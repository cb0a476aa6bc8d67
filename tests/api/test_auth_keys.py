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


def test_a_key_may_be_restricted_to_adapters(tmp_path):
    """`adapters=a,b` after a key scopes it (by tenant hash: the key itself is not kept); a key
    without it runs every adapter; an unknown field is an error naming the line."""
    from ringserve.api.auth import Authenticator, load_key_scopes, tenant_of

    path = tmp_path / "keys"
    path.write_text("sk-one adapters=support,legal  note\nsk-two\n")
    scopes = load_key_scopes(path)
    assert scopes == {"sk-one": frozenset({"support", "legal"}), "sk-two": None}
    auth = Authenticator(scopes)
    assert auth.adapters_of(tenant_of("sk-one")) == {"support", "legal"}
    assert auth.adapters_of(tenant_of("sk-two")) is None
    assert "sk-one" not in repr(vars(auth))
    path.write_text("sk-one\nsk-two models=x\n")
    with pytest.raises(ValueError, match="line 2"):
        load_key_scopes(path)
