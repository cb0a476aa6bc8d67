"""The hostile-client checker's command line (its cases run real servers: see docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from ringserve.tools import hostile_check


def test_unknown_case_is_a_usage_error(capsys):
    """A case name it does not know is refused before any server starts."""
    with pytest.raises(SystemExit) as info:
        hostile_check.main(["no-such-case"])
    assert info.value.code == 2 and "choose from prompt" in capsys.readouterr().err
