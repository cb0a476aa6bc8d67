"""The fleet's adapter fan-out without replicas: how answers combine, the set a restarted replica
starts with, and the Envoy routes that send the two paths to it (validated by the real binary)."""

from __future__ import annotations

import json
import subprocess

import pytest

from ringserve.tools.fleet.envoy_config import LORA_CLUSTER, LORA_PATHS, FleetSpec, envoy_config, to_yaml
from ringserve.tools.fleet.lora_fanout import AdapterSet, Answer, combine
from ringserve.tools.fleet.replicas import FleetError, envoy_binary

OK = Answer(200, b"Success: LoRA adapter 'a' added successfully.")
LOADED = Answer(400, json.dumps({"error": {"message": "The lora adapter 'a' has already been loaded."}}).encode())
GONE = Answer(404, json.dumps({"error": {"message": "cannot be found", "code": "model_not_found"}}).encode())
DENIED = Answer(401, json.dumps({"error": {"code": "invalid_admin_key"}}).encode())
DOWN = Answer(502, json.dumps({"error": {"code": "fleet_replica_unreachable"}}).encode())


@pytest.mark.parametrize(
    "kind, answers, status, changed",
    [
        ("load", [OK, OK], 200, True),
        ("load", [DENIED, DENIED], 401, False),  # the same answer everywhere: passed on as it is
        ("load", [LOADED, LOADED], 400, False),
        ("load", [LOADED, OK], 200, True),  # a retry after a partial load converges
        ("load", [OK, DOWN], 502, True),  # a replica missed it: the client is told, the set has it
        ("load", [OK, DENIED], 502, True),
        ("unload", [GONE, OK], 200, True),
        ("unload", [LOADED, OK], 502, True),  # "already loaded" is no unload's success
        ("load", [], 503, False),
    ],
)
def test_answers_combine(kind, answers, status, changed):
    answer, did = combine(kind, list(enumerate(answers)))
    assert (answer.status, did) == (status, changed)
    if status == 502:
        assert json.loads(answer.body)["error"]["code"] == "fleet_partial"
        assert "replica 1: " in json.loads(answer.body)["error"]["message"]


def test_the_set_a_restarted_replica_starts_with(tmp_path):
    adapters = AdapterSet(["--max-loras", "2", "--lora-modules", "a=/m/a", "b=/m/b", "--lora-dir", str(tmp_path)])
    assert adapters.serve_args() == []  # unchanged: the serve args say it already
    adapters.apply("load", json.dumps({"lora_name": "c", "lora_path": "c"}).encode())
    adapters.apply("unload", json.dumps({"lora_name": "a"}).encode())
    adapters.apply("load", b"not json")
    assert adapters.serve_args() == [f"--lora-modules=b=/m/b c={tmp_path / 'c'}"]
    for name in ("b", "c"):
        adapters.apply("unload", json.dumps({"lora_name": name}).encode())
    assert adapters.serve_args() == ["--lora-modules="]  # none left: the startup ones are not back


def test_envoy_routes_the_adapter_paths_to_the_fanout(tmp_path):
    try:
        envoy = envoy_binary()
    except FleetError as exc:  # pragma: no cover - the fleet extra is part of `make install`
        pytest.skip(str(exc))
    spec = FleetSpec(endpoints=(("127.0.0.1", 8100), ("127.0.0.1", 8101)), lora_fanout=("127.0.0.1", 8199))
    config = envoy_config(spec)
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = routes["route_config"]["virtual_hosts"][0]["routes"]
    to_fanout = [r["match"].get("path") for r in routes if r["route"]["cluster"] == LORA_CLUSTER]
    assert to_fanout == list(LORA_PATHS) and "retry_policy" not in routes[1]["route"]
    assert routes[-1]["match"] == {"prefix": "/"}  # after them: every other path to the replicas
    path = tmp_path / "envoy.yaml"
    path.write_text(to_yaml(config))
    out = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--disable-hot-restart"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    no_fanout = envoy_config(FleetSpec(endpoints=spec.endpoints))
    assert [c["name"] for c in no_fanout["static_resources"]["clusters"]] == ["ringserve"]
