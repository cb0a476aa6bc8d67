"""`ringserve fleet --print-config`: the Envoy config validates with the real binary, for both
balancers and for replicas elsewhere, and holds the fleet's rules."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import yaml

from ringserve.tools.fleet.envoy_config import FleetSpec, envoy_config
from ringserve.tools.fleet.replicas import FleetError, envoy_binary, main
from ringserve.tools.harness.ports import free_port
from tests.helpers.envoy import EnvoyProcess

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
    assert retry["retry_back_off"]["base_interval"] == "0.1s"  # what makes the budget bite (the drill)
    assert cluster["circuit_breakers"]["thresholds"][0]["retry_budget"]["budget_percent"]["value"] == 10.0
    assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/ready"
    assert float(route["timeout"].rstrip("s")) > 600  # the replica's request deadline
    server_errors = hcm["local_reply_config"]["mappers"][-1]  # after the 4xx and 504 ones
    assert server_errors["filter"]["and_filter"]["filters"][0]["status_code_filter"]["comparison"]["op"] == "GE"
    assert server_errors["headers_to_add"][0]["header"]["key"] == "Retry-After"
    assert not [f for f in hcm["http_filters"] if "buffer" in f["name"]]  # SSE is never buffered


def _exchange(port: int, raw: bytes) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one raw HTTP/1.1 exchange with a proxy that closes after."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(raw)
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


@pytest.fixture
def lone_envoy(tmp_path):
    """Envoy on the fleet's config with one replica that is not there: its own answers only."""
    spec = FleetSpec(endpoints=(("127.0.0.1", free_port()),), listen_port=free_port(), admin_port=free_port())
    with EnvoyProcess(spec, tmp_path) as port:
        yield port


def test_envoys_own_answers_say_what_happened(lone_envoy):
    """A request Envoy cannot read is a 400 invalid_http_request naming why (not "could not reach a
    ready replica", and no Retry-After: it is the client's to fix); no ready replica is still 503
    fleet_unavailable with a Retry-After."""
    for raw, why in (
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header: v\r\nContent-Length: 2\r\n\r\n{}", "codec_error"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
            "content_length_and_chunked",
        ),
    ):
        status, headers, body = _exchange(lone_envoy, raw)
        err = body["error"]
        assert status == 400 and err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error", body
        assert why in err["message"] and "ready replica" not in err["message"] and "retry-after" not in headers
    status, headers, body = _exchange(
        lone_envoy, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    assert status == 503 and body["error"]["code"] == "fleet_unavailable" and headers["retry-after"] == "1", body
