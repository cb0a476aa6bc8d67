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


def test_serve_holds_the_context_limit_to_the_model_positions(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """`ringserve serve`: a --context-limit past the checkpoint's max_position_embeddings is refused
    at start-up (a prompt past the positions would crash every step it is in), and the default
    limit is lowered to a shorter model's positions."""
    import json
    import shutil

    from ringserve import serve_cli

    started = []

    class Started:
        def __init__(self, config, model_dir, shm_dir):
            started.append(config)

        def run(self):
            return 0

    monkeypatch.setattr(serve_cli, "Supervisor", Started)
    assert serve_cli.main(["--model", str(tiny_model_dir), "--context-limit", "32768"]) == 2
    assert "exceeds what" in caplog.text and "max_position_embeddings 8192" in caplog.text and not started
    short = tmp_path / "short"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    assert serve_cli.main(["--model", str(short)]) == 0
    assert started[-1].context_limit == 2048
    assert serve_cli.main(["--model", str(tiny_model_dir), "--context-limit", "4096"]) == 0
    assert started[-1].context_limit == 4096
