"""`ringserve bench controls`: runs on tiny sizes and reports every case it claims."""

import json

from ringserve.cli import main as cli_main


def test_json_output_has_every_case(capsys):
    """--json prints every case with its median, its baseline's and the ratio of the two."""
    assert (
        cli_main(["bench", "controls", "--json", "--rows", "4", "--vocab", "512", "--iters", "3", "--prompt", "32"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert list(out["sampler"]) == [
        "through the controls, none asked for",
        "1 of 4 rows penalized",
        "4 of 4 rows penalized",
        "4 of 4 rows, every control",
    ]
    assert all(r["median_ms"] > 0 and r["sampler_alone_ms"] > 0 and r["ratio"] > 0 for r in out["sampler"].values())
    assert list(out["scoring"]) == ["prefill 32 tokens", "prefill 32 tokens, scoring the prompt"]
    assert out["scoring"]["prefill 32 tokens"]["ratio"] == 1.0
