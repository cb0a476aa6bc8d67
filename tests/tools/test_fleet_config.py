"""`ringserve fleet --print-config`: the Envoy config validates with the real binary, for both
balancers and for replicas elsewhere, and holds the fleet's rules."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from ringserve.tools.envoy_config import FleetSpec, envoy_config
from ringserve.tools.fleet import FleetError, envoy_binary, main

try:
    ENVOY = envoy_binary()
except FleetError as exc:  # pragma: no cover - the fleet extra is part of `make install`
    pytest.skip(f"no Envoy binary: {exc}", allow_module_level=True)


def _print_config(capsys, *args: str) -> str:
    assert main(["--print-config", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("lb", ["least_request", "orca"])
def test_printed_config_validates_with_envoy(capsys, tmp_path, lb):
    path = tmp_path / "envoy.yaml"
    path.write_text(_print_config(capsys, "--replicas", "3", "--lb", lb))
    out = subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(path), "--disable-hot-restart"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_endpoints_elsewhere(capsys):
    config = yaml.safe_load(_print_config(capsys, "--endpoint", "gpu1:8000", "--endpoint", "[::1]:9000"))
    (cluster,) = config["static_resources"]["clusters"]
    addresses = [
        e["endpoint"]["address"]["socket_address"] for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert addresses == [{"address": "gpu1", "port_value": 8000}, {"address": "::1", "port_value": 9000}]


def test_the_fleet_rules_are_in_the_config():
    """Retries only before a response (connect failure, reset, 503/429) under a budget; no panic
    routing to dead replicas; /ready health checks; Envoy's own 5xx carry Retry-After."""
    config = envoy_config(FleetSpec(endpoints=(("127.0.0.1", 8100),)))
    (cluster,) = config["static_resources"]["clusters"]
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    retry = route["retry_policy"]
    assert set(retry["retry_on"].split(",")) == {"connect-failure", "reset", "refused-stream", "retriable-status-codes"}
    assert retry["retriable_status_codes"] == [503, 429]
    assert cluster["circuit_breakers"]["thresholds"][0]["retry_budget"]["budget_percent"]["value"] == 10.0
    assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/ready"
    assert float(route["timeout"].rstrip("s")) > 600  # the replica's request deadline
    (mapper,) = hcm["local_reply_config"]["mappers"]
    assert mapper["headers_to_add"][0]["header"]["key"] == "Retry-After"
    assert not [f for f in hcm["http_filters"] if "buffer" in f["name"]]  # SSE is never buffered
