"""`ringserve grafana-dashboard`: the Grafana dashboard of `deploy/grafana/ringserve.json`, built
with Grafana's own schema-generated builders (`grafana-foundation-sdk`, the test extra), so that a
field Grafana's dashboard schema does not have cannot be written.

    ringserve grafana-dashboard > deploy/grafana/ringserve.json

It charts vLLM's series as vLLM's dashboards do (every `vllm:` query filtered on `model_name`, a
variable), plus ringserve's own: per-tenant tokens and rows, queued GPU seconds. The test
(`tests/tools/commands/test_grafana_dashboard.py`) checks the file is this output, that it loads back
through the SDK's dashboard model, and that every series it queries is on /metrics.
"""

from __future__ import annotations

import json
import sys

RATE = "[$__rate_interval]"
MODEL = '{model_name="$model_name"}'


def _quantiles(metric: str, quantiles=(0.5, 0.95, 0.99)) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{MODEL}{RATE})))", f"p{int(q * 100)}")
        for q in quantiles
    ]


# (title, unit, [(expr, legend)]), in rows of two panels
PANELS: tuple[tuple[str, str, list[tuple[str, str]]], ...] = (
    ("Time to first token", "s", _quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", _quantiles("vllm:inter_token_latency_seconds")),
    ("End-to-end request latency", "s", _quantiles("vllm:e2e_request_latency_seconds")),
    (
        "Where a request's time goes (p95)",
        "s",
        [
            (e, name)
            for name, metric in (
                ("queue", "vllm:request_queue_time_seconds"),
                ("prefill", "vllm:request_prefill_time_seconds"),
                ("decode", "vllm:request_decode_time_seconds"),
            )
            for e, _ in _quantiles(metric, (0.95,))
        ],
    ),
    (
        "Token throughput",
        "tps",
        [
            (f"rate(vllm:prompt_tokens_total{MODEL}{RATE})", "prompt"),
            (f"rate(vllm:generation_tokens_total{MODEL}{RATE})", "generation"),
        ],
    ),
    (
        "Scheduler state",
        "short",
        [
            (f"vllm:num_requests_running{MODEL}", "running"),
            (f"vllm:num_requests_waiting{MODEL}", "waiting"),
        ],
    ),
    ("KV cache usage", "percentunit", [(f"vllm:kv_cache_usage_perc{MODEL}", "used")]),
    (
        "Prefix cache hit rate",
        "percentunit",
        [
            (
                f"rate(vllm:prefix_cache_hits_total{MODEL}{RATE}) / rate(vllm:prefix_cache_queries_total{MODEL}{RATE})",
                "hits",
            )
        ],
    ),
    (
        "Finished requests by reason",
        "reqps",
        [(f"sum by (finished_reason) (rate(vllm:request_success_total{MODEL}{RATE}))", "{{finished_reason}}")],
    ),
    ("Preemptions", "ops", [(f"rate(vllm:num_preemptions_total{MODEL}{RATE})", "preemptions")]),
    (
        "Request lengths (p50)",
        "short",
        [
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:request_prompt_tokens_bucket{MODEL}{RATE})))", "prompt"),
            (
                f"histogram_quantile(0.5, sum by (le) (rate(vllm:request_generation_tokens_bucket{MODEL}{RATE})))",
                "generation",
            ),
        ],
    ),
    ("Queued GPU work (admission)", "s", [("ringserve_queued_gpu_seconds", "queued")]),
    (
        "Generated tokens by tenant",
        "tps",
        [(f"sum by (tenant) (rate(ringserve_tenant_generation_tokens_total{RATE}))", "{{tenant}}")],
    ),
    (
        "Rows and waiting requests by tenant",
        "short",
        [
            ("sum by (tenant) (ringserve_tenant_running_rows)", "{{tenant}} running"),
            ("sum by (tenant) (ringserve_tenant_waiting_requests)", "{{tenant}} waiting"),
        ],
    ),
)


def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, GridPos, VariableRefresh

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        dashboard.Dashboard("ringserve")
        .uid("ringserve")
        .tags(["ringserve", "vllm", "llm-serving"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model_name")
            .label("Model")
            .datasource(source)
            .query("label_values(vllm:num_requests_running, model_name)")
            .refresh(VariableRefresh.ON_DASHBOARD_LOAD)
        )
    )
    for i, (title, unit, queries) in enumerate(PANELS):
        panel = (
            timeseries.Panel()
            .id(i + 1)
            .title(title)
            .unit(unit)
            .datasource(source)
            .grid_pos(GridPos(h=8, w=12, x=12 * (i % 2), y=8 * (i // 2)))
        )
        for j, (expr, legend) in enumerate(queries):
            panel = panel.with_target(
                prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + j)).datasource(source)
            )
        board = board.with_panel(panel)
    return _no_nulls(json.loads(JSONEncoder(sort_keys=True).encode(board.build())))


def _no_nulls(value):
    """Without the builders' unset fields (`"options": null`): Grafana fills in its defaults."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    json.dump(build(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
