"""The hostile-client checker's command line (its cases run real servers: see docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from ringserve.tools.harness import hostile_check


def test_unknown_case_is_a_usage_error(capsys):
    """A case name it does not know is refused before any server starts."""
    with pytest.raises(SystemExit) as info:
        hostile_check.main(["no-such-case"])
    assert info.value.code == 2 and "choose from prompt" in capsys.readouterr().err


def test_a_missed_or_raising_case_fails_the_run(monkeypatch, capsys, tmp_path):
    """A planted case whose expected outcome misses, and one that raises, make the run exit 1 and
    name both; cases that hold exit 0."""

    def holds():
        hostile_check.expect("planted", "a check that holds", 1, True, "1")

    def misses():
        hostile_check.expect("planted", "a check that misses", 2, False, "1")

    def raises():
        raise RuntimeError("planted failure")

    monkeypatch.setitem(hostile_check.CASES, "holds", holds)
    monkeypatch.setitem(hostile_check.CASES, "misses", misses)
    monkeypatch.setitem(hostile_check.CASES, "raises", raises)
    model = ["--model", str(tmp_path)]  # no case here starts a server
    assert hostile_check.main([*model, "holds"]) == 0
    assert hostile_check.main([*model, "holds", "misses", "raises"]) == 1
    printed = capsys.readouterr().out
    assert "2 expected outcome(s) missed" in printed
    assert "a check that misses: got 2, expected 1" in printed and "planted failure" in printed
