"""`ringserve bench controls`: runs on tiny sizes and reports every case it claims."""

import json

from ringserve.cli import main as cli_main


def test_json_output_has_every_case(capsys):
    """--json prints every table, each case with a median and a ratio to the table's first case."""
    assert cli_main(["bench", "controls", "--json", "--rows", "4", "--vocab", "512", "--iters", "3",
                     "--prompt", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["no_controls"]) == ["sampler alone", "through the controls, none asked for"]
    assert list(out["controls"]) == ["sampler alone", "1 of 4 rows penalized", "4 of 4 rows penalized",
                                     "4 of 4 rows, every control"]
    assert list(out["scoring"]) == ["prefill 32 tokens", "prefill 32 tokens, scoring the prompt"]
    for table in out.values():
        first = next(iter(table.values()))
        assert first["ratio"] == 1.0 and all(r["median_ms"] > 0 for r in table.values())
