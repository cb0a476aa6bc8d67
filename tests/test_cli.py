"""The `ringserve` console script dispatches to its subcommands."""

import subprocess
import sys


def test_help_lists_every_command():
    """`ringserve --help` names each subcommand and bench."""
    from ringserve.cli import BENCHES, COMMANDS

    out = subprocess.run(
        [sys.executable, "-m", "ringserve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in COMMANDS:
        assert name in out
    for name in BENCHES:
        assert f"bench {name}" in out


def test_unknown_command_fails():
    """An unknown subcommand exits 2 with the usage on stderr."""
    proc = subprocess.run([sys.executable, "-m", "ringserve", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown command" in proc.stderr
