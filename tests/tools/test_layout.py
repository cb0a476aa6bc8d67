"""tests/tools/ mirrors tools/: a folder per tools/ folder, and no test of a tool at the top."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tests_of_tools_sit_in_the_folders_of_tools():
    tools = {p.parent.name for p in (ROOT / "tools").glob("*/__init__.py")}
    tests = {p.parent.name for p in (ROOT / "tests" / "tools").glob("*/__init__.py")}
    assert tests <= tools, tests - tools
    loose = [p.name for p in (ROOT / "tests" / "tools").glob("test_*.py") if p.name != "test_layout.py"]
    assert not loose, f"move {loose} into the tests/tools/ folder of the tool it tests"
