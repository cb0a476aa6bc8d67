"""deploy/kubernetes/ validated offline: the core kinds against Kubernetes' own schemas
(kubernetes-validate), the InferencePool and HTTPRoute against schemas written from their
published APIs, and every port, probe, flag and metric name checked against what the server
really parses and serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ringserve.api.app import init_app
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.gpu_client import GpuClient
from ringserve.api.state import STATE
from ringserve.api.tokenizer import TextCodec
from ringserve.config import Config
from ringserve.serve_cli import parser as _parser
from ringserve.shm.instance import ShmSizes
from ringserve.supervisor import STOP_GRACE_S

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"  # the oldest release the manifests promise (preStop's sleep action is GA there)
# What the Gateway API Inference Extension's endpoint picker reads from a vLLM-type model server
# (docs/proposals/003-model-server-protocol): name -> Prometheus type.
PROTOCOL_METRICS = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _schema(name: str) -> dict:
    return json.loads((DEPLOY / "schemas" / name).read_text())


@pytest.fixture(scope="module")
def m() -> dict:
    """Every manifest by kind, plus the llm-d values under "values"."""
    docs = {}
    for name in ("deployment.yaml", "service.yaml", "inferencepool.yaml", "httproute.yaml", "epp-config.yaml"):
        doc = _load(name)
        docs[doc["kind"]] = doc
    docs["values"] = _load("llm-d-router-values.yaml")
    return docs


def _container(m: dict) -> dict:
    (container,) = m["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _serve_config(m: dict) -> Config:
    """The Config `ringserve serve` builds from the container's arguments (the real parser)."""
    container = _container(m)
    assert container["command"] == ["ringserve", "serve"]
    args = vars(_parser().parse_args(container["args"]))
    if args["lora_modules"] is not None:  # as serve_cli.config_from_args joins vLLM's shape
        args["lora_modules"] = " ".join(args["lora_modules"])
    return Config.from_env({}, **{k: v for k, v in args.items() if k not in ("shm_dir", "model")})


def test_kustomization_lists_every_manifest():
    assert sorted(_load("kustomization.yaml")["resources"]) == sorted(
        ["deployment.yaml", "service.yaml", "inferencepool.yaml", "httproute.yaml", "epp-config.yaml"]
    )


@pytest.mark.parametrize("kind", ["Deployment", "Service", "ConfigMap"])
def test_core_kinds_validate_against_kubernetes_schemas(m, kind):
    kubernetes_validate.validate(m[kind], K8S_VERSION, strict=True)


def test_core_kind_validation_can_fail(m):
    """A typo'd field is an error under strict validation (the check is live)."""
    broken = json.loads(json.dumps(m["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("kind", "schema"), [("InferencePool", "inferencepool-v1.json"), ("HTTPRoute", "httproute-v1.json")]
)
def test_gateway_kinds_validate_against_their_published_api(m, kind, schema):
    jsonschema.Draft202012Validator(_schema(schema)).validate(m[kind])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["spec"].update(targetPorts=[]),
        lambda d: d["spec"]["endpointPickerRef"].pop("port"),  # a Service reference needs its port
        lambda d: d["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"),
        lambda d: d["spec"].update(targetPortNumber=8000),  # the pre-v1 field
    ],
)
def test_inference_pool_schema_rejects_what_the_api_rejects(m, mutate):
    broken = json.loads(json.dumps(m["InferencePool"]))
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(_schema("inferencepool-v1.json")).validate(broken)


def test_one_port_everywhere(m):
    """The port the server listens on (its --port) is the container's, the Service's target, the
    pool's, the router chart's and the scrape annotation's."""
    port = _serve_config(m).port
    container = _container(m)
    (cport,) = container["ports"]
    assert cport["containerPort"] == port
    assert m["Service"]["spec"]["ports"][0]["targetPort"] in (cport["name"], port)
    assert [p["number"] for p in m["InferencePool"]["spec"]["targetPorts"]] == [port]
    assert [p["number"] for p in m["values"]["router"]["modelServers"]["targetPorts"]] == [port]
    annotations = m["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in (cport["name"], port)


def test_every_selector_selects_the_pods(m):
    labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selectors = [
        m["Deployment"]["spec"]["selector"]["matchLabels"],
        m["Service"]["spec"]["selector"],
        m["InferencePool"]["spec"]["selector"]["matchLabels"],
        m["values"]["router"]["modelServers"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= labels.items()


def test_the_route_reaches_the_pool_and_outlasts_a_request(m):
    (rule,) = m["HTTPRoute"]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    pool = m["InferencePool"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        pool["apiVersion"].split("/")[0],
        pool["kind"],
        pool["metadata"]["name"],
    )
    timeout = re.fullmatch(r"(\d+)s", rule["timeouts"]["request"])
    assert timeout and int(timeout.group(1)) >= _serve_config(m).request_timeout_s


def test_grace_period_covers_pre_stop_and_the_drain(m):
    """SIGKILL must not come before the preStop sleep, the drain and the supervisor's own stop."""
    spec = m["Deployment"]["spec"]["template"]["spec"]
    pre_stop = _container(m)["lifecycle"]["preStop"]["sleep"]["seconds"]
    config = _serve_config(m)
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + config.drain_timeout_s + 2 * STOP_GRACE_S
    # Readiness must see a draining replica before the drain ends.
    probe = _container(m)["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] < config.drain_timeout_s


def test_dev_shm_holds_the_rings(m):
    """The memory-backed /dev/shm fits every segment of the instance the args configure."""
    config = _serve_config(m)
    volumes = {v["name"]: v for v in m["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    mounts = {v["mountPath"]: v["name"] for v in _container(m)["volumeMounts"]}
    dshm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert dshm["medium"] == "Memory"
    limit = re.fullmatch(r"(\d+)Mi", dshm["sizeLimit"])
    assert limit
    assert int(limit.group(1)) * 2**20 >= ShmSizes(config.ring_bytes, config.workers).total_bytes
    assert _container(m)["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.fixture
def app_client(aiohttp_client, tiny_model_dir):
    """`await app_client()` -> (client, ready, app): the real app on the fake GPU, readiness
    switchable through `ready["value"]`."""

    async def start():
        ready = {"value": False}
        fake = FakeGpu()
        app = init_app(
            Config(),
            GpuClient(fake, ready=lambda: ready["value"]),
            TextCodec.from_dir(tiny_model_dir),
            FakeStatus(fake, lambda: ready["value"]),
            model_name="tiny",
        )
        return await aiohttp_client(app), ready, app

    return start


@pytest.mark.asyncio
async def test_probes_answer_as_the_manifest_expects(m, app_client):
    """Startup and readiness probes fail until the GPU process is ready and again while draining;
    liveness answers throughout."""
    client, ready, app = await app_client()
    container = _container(m)
    paths = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}

    async def status(path: str) -> int:
        return (await client.get(path)).status

    assert [await status(paths["startupProbe"]), await status(paths["readinessProbe"])] == [503, 503]
    assert await status(paths["livenessProbe"]) == 200
    ready["value"] = True
    assert [await status(p) for p in paths.values()] == [200, 200, 200]
    app[STATE].draining = True
    assert await status(paths["readinessProbe"]) == 503
    assert await status(paths["livenessProbe"]) == 200


@pytest.mark.asyncio
async def test_the_scraped_path_serves_the_protocol_metrics(m, app_client):
    """The path the picker and Prometheus scrape serves every metric of the model-server protocol,
    with the protocol's type."""
    client, _, _ = await app_client()
    path = m["values"]["router"]["epp"]["metricsDataSource"]["path"]
    assert m["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] == path
    resp = await client.get(path)
    assert resp.status == 200
    families = {f.name: f.type for f in text_string_to_metric_families(await resp.text())}
    assert {name: families.get(name) for name in PROTOCOL_METRICS} == PROTOCOL_METRICS
    assert m["values"]["router"]["modelServers"]["type"] == "vllm"  # the picker reads vLLM's names


def test_adapters_are_mounted_where_the_flags_read_them_and_the_picker_scores_affinity(m):
    """The LoRA flags parse (the real parser and Config), every adapter path and the admin keys
    lie on read-only mounts, and the endpoint picker's profile uses the LoRA-affinity scorer
    with every plugin it names defined."""
    config = _serve_config(m)
    mounts = {v["mountPath"]: v for v in _container(m)["volumeMounts"]}

    def mounted(path: str) -> bool:
        return any(path.startswith(p.rstrip("/") + "/") and v.get("readOnly") for p, v in mounts.items())

    assert config.loras and all(mounted(p) for p in config.loras.values())
    assert config.lora_dir in mounts and mounts[config.lora_dir]["readOnly"]
    assert config.admin_keys_file and mounted(config.admin_keys_file)
    picker = yaml.safe_load(m["ConfigMap"]["data"]["epp-config.yaml"])
    defined = {p.get("name", p["type"]) for p in picker["plugins"]}
    (profile,) = picker["schedulingProfiles"]
    used = {p["pluginRef"] for p in profile["plugins"]}
    assert "lora-affinity-scorer" in used and used <= defined
