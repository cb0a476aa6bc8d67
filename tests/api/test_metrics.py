"""Metrics rendered from the control block's regions, parsed back with prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringserve.api import metrics
from ringserve.api.worker_stats import WorkerStats
from ringserve.shm import layout as L
from ringserve.shm.control import Control

M = (("model_name", "tiny"),)  # the label of every vllm: series (the served model)


def _samples(text: bytes) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def control():
    buf = bytearray(L.control_segment_size(2))
    Control.format(buf, 2)
    return Control(buf)


def test_control_block_snapshot_renders_server_wide(control):
    """GPU stats, both workers' counters and histograms (summed) and model facts all render."""
    control.gpu_stats.update(
        {
            "queue_depth": 3,
            "running_rows": 5,
            "kv_blocks_free": 30,
            "kv_blocks_total": 120,
            "preemptions": 2,
            "cancelled_tokens": 17,
            "queued_gpu_seconds": 1.5,
            "prefix_cache_queries": 200,
            "prefix_cache_hits": 150,
        }
    )
    control.gpu_stats.publish()
    control.set_model_facts({"block_size": 16, "name": "tiny"})
    for slot, ttft in ((0, 40.0), (1, 700.0)):
        stats = WorkerStats()
        stats.add("requests_total", 10)
        stats.count_finish("stop")
        stats.observe("ttft_ms", ttft)
        stats.publish(control.worker_stats(slot))
    s = _samples(metrics.render(metrics.from_control(control), "tiny"))
    assert s[("ringserve_queue_depth", ())] == 3 and s[("vllm:num_requests_waiting", M)] == 3
    assert s[("ringserve_running_rows", ())] == 5 and s[("vllm:num_requests_running", M)] == 5
    assert s[("vllm:kv_cache_usage_perc", M)] == pytest.approx(0.75)
    assert s[("vllm:cache_config_info", (("block_size", "16"), *M, ("num_gpu_blocks", "120")))] == 1
    assert s[("ringserve_preemptions_total", ())] == 2
    assert s[("ringserve_cancelled_tokens_total", ())] == 17
    assert s[("ringserve_prefix_cache_queries_total", ())] == 200 == s[("vllm:prefix_cache_queries_total", M)]
    assert s[("ringserve_prefix_cache_hits_total", ())] == 150 == s[("vllm:prefix_cache_hits_total", M)]
    assert s[("ringserve_queued_gpu_seconds", ())] == 1.5
    assert s[("ringserve_requests_total", ())] == 20
    assert s[("ringserve_requests_finished_total", (("reason", "stop"),))] == 2
    assert s[("ringserve_ttft_seconds_bucket", (("le", "0.05"),))] == 1
    assert s[("ringserve_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert s[("ringserve_ttft_seconds_sum", ())] == pytest.approx(0.74)


def test_same_snapshot_same_text(control):
    """Two workers reading the same shared memory serve byte-identical /metrics."""
    first = metrics.render(metrics.from_control(control))
    assert first == metrics.render(metrics.from_control(Control(control._buf)))
    assert b"ringserve_kv_blocks_free 0.0" in first  # the catalogue renders even at zero


def test_gateway_protocol_families_have_the_protocol_types_and_labels(control):
    """The model-server protocol of the Gateway API Inference Extension: the queue, running and KV
    gauges (both KV names), the cache config info and the LoRA info family, which is present with
    max_lora "0" and no adapters, valued at the server's start."""
    control.gpu_stats.update({"queue_depth": 2, "running_rows": 3, "kv_blocks_free": 25, "kv_blocks_total": 100})
    control.gpu_stats.publish()
    control.set_model_facts({"block_size": 16})
    text = metrics.render(metrics.from_control(control, started_at=1_700_000_000.0), "tiny").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expect = {
        "vllm:num_requests_waiting": 2,
        "vllm:num_requests_running": 3,
        "vllm:kv_cache_usage_perc": 0.75,
        "vllm:gpu_cache_usage_perc": 0.75,
    }
    for name, value in expect.items():
        assert families[name].type == "gauge"
        assert [(s.labels, s.value) for s in families[name].samples] == [({"model_name": "tiny"}, pytest.approx(value))]
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge" and [s.labels for s in info.samples] == [
        {"model_name": "tiny", "block_size": "16", "num_gpu_blocks": "100"}
    ]
    lora = families["vllm:lora_requests_info"]
    assert lora.type == "gauge"
    assert [(s.labels, s.value) for s in lora.samples] == [
        (
            {"model_name": "tiny", "max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""},
            1_700_000_000.0,
        )
    ]


def test_prompt_length_histograms_are_labelled():
    """Histograms named <base>_plen_<label> render as one family labelled by prompt length."""
    worker = {
        "ttft_ms_plen_0_512_bucket_3": 1.0,
        "ttft_ms_plen_0_512_count": 1.0,
        "ttft_ms_plen_0_512_sum": 20.0,
        "ttft_ms_plen_512_2048_bucket_6": 1.0,
        "ttft_ms_plen_512_2048_count": 1.0,
        "ttft_ms_plen_512_2048_sum": 900.0,
    }
    s = _samples(metrics.render(metrics.StatsSnapshot(workers=[worker])))
    assert s[("ringserve_ttft_by_prompt_len_seconds_bucket", (("le", "0.1"), ("prompt_len", "0_512")))] == 1
    assert s[("ringserve_ttft_by_prompt_len_seconds_bucket", (("le", "0.1"), ("prompt_len", "512_2048")))] == 0
    assert s[("ringserve_ttft_by_prompt_len_seconds_count", (("prompt_len", "512_2048"),))] == 1


def test_worker_observes_prompt_length_split():
    """WorkerStats counts a TTFT into the total and into its prompt-length bucket."""
    from ringserve.api import worker_stats

    stats = worker_stats.WorkerStats()
    stats.observe("ttft_ms", 50.0, prompt_tokens=1000)
    stats.observe("ttft_ms", 50.0, prompt_tokens=100)
    assert stats.get("ttft_ms_plen_512_2048_count") == 1 and stats.get("ttft_ms_plen_0_512_count") == 1
    assert stats.get("ttft_ms_count") == 2


def test_every_declared_gpu_stat_is_published_rendered_and_faked(control):
    """`shm/stats_schema.py` is the one list: the scheduler's stats plus the loop's counters are
    exactly the declared stats (so the GPU process publishes each), /metrics renders every one
    under its declared name and kind, and the fake GPU reports each."""
    from ringserve.api.fake_gpu import FakeGpu
    from ringserve.gpu_proc.scheduler_stats import SCHEDULER_STAT_NAMES
    from ringserve.shm.messages import MAX_LORA_ADAPTERS, MAX_METRICS_TENANTS
    from ringserve.shm.stats_schema import GPU_STAT_NAMES, GPU_STATS, LOOP_STATS

    scheduler_stats = set(SCHEDULER_STAT_NAMES)
    assert scheduler_stats | set(LOOP_STATS) == set(GPU_STAT_NAMES) and not scheduler_stats & set(LOOP_STATS)
    assert len(set(GPU_STAT_NAMES)) == len(GPU_STAT_NAMES)
    control.gpu_stats.update({name: float(i + 1) for i, name in enumerate(GPU_STAT_NAMES)})
    control.gpu_stats.publish()
    loras = [f"adapter-{i}" for i in range(MAX_LORA_ADAPTERS)]  # the LoRA stats render by adapter name
    tenants = [f"k-{i:016x}" for i in range(MAX_METRICS_TENANTS)] + ["other"]  # the last slot: "other"
    s = _samples(metrics.render(metrics.from_control(control), "tiny", loras, 4, tenants[:-1]))
    for i, stat in enumerate(GPU_STATS):
        name = stat.metric + ("_total" if stat.kind == "counter" else "")
        label = ("lora_name", loras[int(stat.label[1])]) if stat.name.startswith("lora_") and stat.label else stat.label
        if stat.name.startswith("tenant_"):
            label = ("tenant", tenants[int(stat.label[1])])
        assert s[(name, (label,) if label else ())] == i + 1, stat
    assert set(FakeGpu().stats()) == set(GPU_STAT_NAMES)


def test_tenants_beyond_their_slots_count_as_other(control):
    """The first --metrics-tenants tenants get a label each; a slot whose name is not published
    (yet, or unreadable) and the last slot add up in "other"; no other label value is rendered."""
    control.gpu_stats.update({"tenant_requests_0": 3.0, "tenant_requests_1": 2.0, "tenant_requests_32": 7.0})
    control.gpu_stats.publish()
    s = _samples(metrics.render(metrics.from_control(control), "tiny", tenants=["k-aaaa"]))
    got = {k[1]: v for k, v in s.items() if k[0] == "ringserve_tenant_requests_total"}
    assert got == {(("tenant", "k-aaaa"),): 3.0, (("tenant", "other"),): 9.0}


def test_attention_backend_and_check_failures_from_the_model_facts(control):
    """The backend serving each attention op and the failed kernel checks render from the facts,
    and the largest report the start-up check can publish fits the facts region."""
    from ringserve.gpu_proc.attention.self_check import ERROR_CHARS, OPS, CheckReport, OpCheck, served_by

    kernels = ("rs_paged_decode<RsBF16, 128, 4>", "rs_decode_merge<RsBF16, 128>")
    shape = "chunks [(0, 33), (20, 17), (47, 1), (5, 1), (64, 40)], heads 128/8, head_dim 128, bfloat16"
    checks = tuple(OpCheck(op, kernels, shape, False, float("nan"), "-", "E" * ERROR_CHARS) for op in OPS)
    report = CheckReport(checks, 0.5, served_by({}, "cupy"))
    facts = {"model": "m" * 200, "block_size": 16, "eos_token_ids": list(range(8)), "device": "cuda:0"}
    control.set_model_facts({**facts, "attention": {"backend": "reference", "checked": True, **report.facts()}})
    samples = _samples(metrics.render(metrics.from_control(control)))
    for op in OPS:
        assert samples[("ringserve_attention_backend_info", (("backend", "reference"), ("op", op)))] == 1.0
    assert samples[("ringserve_attention_check_failures", ())] == len(OPS)
