"""deploy/grafana/ringserve.json: what `ringserve grafana-dashboard` builds, a dashboard Grafana's
schema model (grafana-foundation-sdk, generated from Grafana's own schema) reads back whole, and
nothing it queries that /metrics does not serve."""

from __future__ import annotations

import json
import re
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families

from ringserve.api import metrics
from ringserve.tools.commands.grafana_dashboard import _no_nulls, build

FILE = Path(__file__).parents[3] / "deploy" / "grafana" / "ringserve.json"
SERIES = re.compile(r"\b(vllm:[a-z0-9_]+|ringserve_[a-z0-9_]+)")


def _exprs(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


def test_the_file_is_what_the_builder_makes():
    assert json.loads(FILE.read_text()) == build(), "run: ringserve grafana-dashboard > deploy/grafana/ringserve.json"


def test_grafanas_dashboard_model_reads_every_field_back():
    """A field the schema does not know is dropped by `from_json`: the round trip would differ."""
    board = json.loads(FILE.read_text())
    again = _no_nulls(json.loads(JSONEncoder(sort_keys=True).encode(Dashboard.from_json(board))))
    assert again == board
    assert board["title"] == "ringserve" and len(board["panels"]) >= 12


def test_every_series_it_charts_is_served():
    text = metrics.render(metrics.StatsSnapshot(gpu={}, workers=[{}]), "m", tenants=["k-0"]).decode()
    served = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    charted = {name for expr in _exprs(json.loads(FILE.read_text())) for name in SERIES.findall(expr)}
    assert charted and charted <= served, sorted(charted - served)
    for expr in _exprs(json.loads(FILE.read_text())):  # every vllm: selector names the model
        assert all('{model_name="$model_name"}' in part for part in re.findall(r"vllm:[a-z0-9_]+\{[^}]*\}", expr)), expr
        assert not re.search(r"vllm:[a-z0-9_]+(?!\{|[a-z0-9_])", expr), expr
