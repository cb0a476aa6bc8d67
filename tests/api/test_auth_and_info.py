"""Bearer keys and tenants; /health, /ready, /v1/models; /metrics parsed with prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringserve.api.auth import SHARED_TENANT, tenant_of
from tests.helpers.fake_api import MODEL

pytestmark = pytest.mark.asyncio

_KEYS = frozenset({"sk-alpha", "sk-beta"})
_BODY = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("header", [None, "Bearer sk-wrong", "Basic sk-alpha", "Bearer "])
async def test_missing_or_wrong_key_is_401(serve, header):
    """With keys configured, a request without a valid Bearer key is refused."""
    served = await serve(keys=_KEYS)
    headers = {"Authorization": header} if header else {}
    resp = await served.client.post("/v1/completions", json=_BODY, headers=headers)
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    assert served.fake.submits == []


async def test_valid_key_is_the_tenant(serve):
    """A valid key is accepted and becomes the request's tenant (as a hash, never the key)."""
    served = await serve(keys=_KEYS)
    resp = await served.client.post("/v1/completions", json=_BODY, headers={"Authorization": "Bearer sk-beta"})
    assert resp.status == 200
    assert served.fake.submits[0].tenant == tenant_of("sk-beta") != "sk-beta"


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics"])
async def test_allowlisted_paths_need_no_key(serve, path):
    """/health, /ready and /metrics are open even with keys configured."""
    served = await serve(keys=_KEYS)
    assert (await served.client.get(path)).status == 200


async def test_models_needs_a_key_when_configured(serve):
    """Deny by default: every other path, /v1/models included, needs a key."""
    served = await serve(keys=_KEYS)
    assert (await served.client.get("/v1/models")).status == 401
    ok = await served.client.get("/v1/models", headers={"Authorization": "Bearer sk-alpha"})
    assert (await ok.json())["data"][0]["id"] == MODEL


async def test_without_keys_tenant_is_token_or_shared(serve):
    """No keys file: the bearer token (if any) is the tenant, else one shared tenant."""
    served = await serve()
    await served.client.post("/v1/completions", json=_BODY)
    await served.client.post("/v1/completions", json=_BODY, headers={"Authorization": "Bearer t1"})
    assert [s.tenant for s in served.fake.submits] == [SHARED_TENANT, tenant_of("t1")]


async def test_health_ready_models(serve):
    """/health is alive, /ready follows the GPU state, /v1/models lists the model."""
    state = {"ready": True}
    served = await serve(ready=lambda: state["ready"])
    assert (await served.client.get("/health")).status == 200
    assert (await served.client.get("/ready")).status == 200
    state["ready"] = False
    assert (await served.client.get("/ready")).status == 503
    assert (await served.client.get("/health")).status == 200
    body = await (await served.client.get("/v1/models")).json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL


async def test_metrics_scrape_parses(serve):
    """/metrics parses with prometheus_client and carries the server and gateway names."""
    served = await serve()
    await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    resp = await served.client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(await resp.text()):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("ringserve_kv_blocks_free", ())] == 100.0
    assert samples[("vllm:num_requests_running", (("model_name", MODEL),))] == 0.0
    assert samples[("vllm:num_requests_waiting", (("model_name", MODEL),))] == 0.0
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", MODEL),))] == pytest.approx(1 - 100 / 128)
    assert (
        samples[("vllm:cache_config_info", (("block_size", "16"), ("model_name", MODEL), ("num_gpu_blocks", "128")))]
        == 1.0
    )
    assert samples[("ringserve_requests_finished_total", (("reason", "length"),))] == 1.0
    assert samples[("ringserve_requests_total", ())] == 1.0
    assert samples[("ringserve_completion_tokens_total", ())] == 3.0
    assert samples[("ringserve_ttft_seconds_count", ())] == 1.0
    assert samples[("ringserve_tpot_seconds_count", ())] == 1.0
    assert samples[("ringserve_ttft_seconds_bucket", (("le", "+Inf"),))] == 1.0


async def test_metrics_have_vllms_request_histograms_labelled_with_the_model(serve):
    """The series vLLM's dashboards chart, each with `model_name`: one request of 3 tokens is one
    observation in every request histogram, its latencies ordered as they nest (queue and prefill
    within TTFT within e2e), and counted in the token and finish-reason counters."""
    served = await serve()
    await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
    text = await (await served.client.get("/metrics")).text()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    m = (("model_name", MODEL),)
    names = ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time")
    names += ("request_decode_time", "request_inference_time", "time_per_output_token")
    for name in names:
        assert samples[(f"vllm:{name}_seconds_count", m)] == 1.0, name
        assert samples[(f"vllm:{name}_seconds_bucket", (("le", "+Inf"), *m))] == 1.0, name
    assert samples[("vllm:inter_token_latency_seconds_count", m)] >= 1.0
    assert samples[("vllm:request_generation_tokens_sum", m)] == 3.0
    assert samples[("vllm:request_prompt_tokens_count", m)] == 1.0
    assert samples[("vllm:generation_tokens_total", m)] == 3.0
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), *m))] == 1.0
    sums = {n: samples[(f"vllm:{n}_seconds_sum", m)] for n in names}
    assert sums["request_queue_time"] <= sums["time_to_first_token"] <= sums["e2e_request_latency"]
    assert sums["request_inference_time"] == pytest.approx(sums["request_prefill_time"] + sums["request_decode_time"])


async def test_worker_stats_are_published_periodically(serve):
    """The status's publish hook receives this worker's stats (for its control-block region)."""
    import asyncio

    from ringserve.api.fake_gpu import FakeStatus

    seen = []

    class Publishing(FakeStatus):
        def publish(self, own) -> None:
            seen.append(own.as_dict())

    served = await serve(status=Publishing, app_kw={"publish_every_s": 0.01})
    await served.client.post("/v1/completions", json=_BODY)
    async with asyncio.timeout(5):
        while not seen or seen[-1]["requests_total"] != 1.0:
            await asyncio.sleep(0.01)
    assert seen[-1]["completion_tokens_total"] == 1.0


async def test_cache_salt_reaches_the_gpu_process(serve):
    """A request's cache_salt travels in its Submit (prefix-cache isolation); absent, it is None."""
    served = await serve()
    for body in ({**_BODY, "cache_salt": "tenant-secret"}, _BODY):
        resp = await served.client.post("/v1/completions", json=body)
        assert resp.status == 200
    assert [s.cache_salt for s in served.fake.submits] == ["tenant-secret", None]
