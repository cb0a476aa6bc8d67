"""Adapters loaded at runtime through `ringserve fleet` reach every replica (real Envoy, two
tiny-model replicas, PEFT adapters): each replica, asked directly, then serves the adapter with
PEFT's greedy answer; a replica killed whole comes back serving it; an unload through the fleet
takes it from both; a tenant's key gets the replicas' own 401; a load that one replica already
had converges to 200."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
import requests

from ringserve.tools.fleet.probe import FleetProcess, free_port_run
from ringserve.tools.fleet.replicas import FleetError, envoy_binary
from tests.helpers.lora_adapters import make_adapters, peft_greedy, served_greedy

try:
    envoy_binary()
except FleetError as exc:  # pragma: no cover - the fleet extra is part of `make install`
    pytest.skip(f"no Envoy binary: {exc}", allow_module_level=True)

pytestmark = pytest.mark.timeout(240)

ADMIN, TENANT = "sk-admin-1", "sk-tenant-1"
PROMPT = [1, 17, 29, 41, 5, 9]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-lora")
    adapters = make_adapters(tiny_model_dir, root / "adapters", ("attn-r4", "all-r8"))
    (root / "admin-keys").write_text(ADMIN + "\n")
    (root / "keys").write_text(TENANT + "\n")
    base = free_port_run(4)
    serve = ["--shm-dir", str(root / "shm"), "--max-rows", "8", "--dtype", "float32"]
    serve += ["--lora-modules", f"attn-r4={adapters['attn-r4']}", "--lora-dir", str(root / "adapters")]
    serve += ["--admin-keys-file", str(root / "admin-keys"), "--api-keys-file", str(root / "keys")]
    (root / "shm").mkdir()
    with FleetProcess(
        root / "run", replicas=2, model=str(tiny_model_dir), ports=(base, base + 2, base + 1), serve_args=serve
    ) as proc:
        yield proc, adapters


def _admin(url: str, route: str, body: dict, key: str = ADMIN) -> requests.Response:
    return requests.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=TENANT, max_retries=0)


def _models(url: str) -> set[str]:
    return {m.id for m in _client(url).models.list().data}


def _wait_models(url: str, timeout_s: float = 90.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url + "/ready", timeout=2).status_code == 200:
                return _models(url)
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not come back")
        time.sleep(0.2)


def test_a_load_through_the_fleet_reaches_every_replica_and_a_restart(fleet, tiny_model_dir):
    proc, adapters = fleet
    replicas = proc.replica_urls()
    want = peft_greedy(tiny_model_dir, adapters["all-r8"], [PROMPT], NEW_TOKENS)[0]
    r = _admin(proc.url, "load_lora_adapter", {"lora_name": "all-r8", "lora_path": "all-r8"}, key=TENANT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    r = _admin(proc.url, "load_lora_adapter", {"lora_name": "all-r8", "lora_path": "all-r8"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all-r8' added successfully.", r.text
    for url in replicas:  # each replica, asked directly, has it
        assert "all-r8" in _models(url)
        assert served_greedy(_client(url), "all-r8", PROMPT, NEW_TOKENS) == want
    r = _admin(proc.url, "load_lora_adapter", {"lora_name": "all-r8", "lora_path": "all-r8"})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]

    pid = proc.state()["replicas"][1]["pid"]
    os.killpg(pid, signal.SIGKILL)  # the whole replica: supervisor, GPU process, workers
    deadline = time.monotonic() + 30
    while proc.state()["replicas"][1]["pid"] in (pid, 0):
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.2)
    assert {"attn-r4", "all-r8"} <= _wait_models(replicas[1])
    assert served_greedy(_client(replicas[1]), "all-r8", PROMPT, NEW_TOKENS) == want

    r = _admin(proc.url, "unload_lora_adapter", {"lora_name": "all-r8"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all-r8' removed successfully.", r.text
    for url in replicas:
        assert "all-r8" not in _models(url)
        with pytest.raises(openai.NotFoundError):
            _client(url).completions.create(model="all-r8", prompt="hi", max_tokens=1)


def test_a_load_one_replica_already_had_converges(fleet):
    proc, _ = fleet
    first = proc.replica_urls()[0]
    r = _admin(first, "load_lora_adapter", {"lora_name": "again", "lora_path": "attn-r4"})  # one replica only
    assert r.status_code == 200
    r = _admin(proc.url, "load_lora_adapter", {"lora_name": "again", "lora_path": "attn-r4"})
    assert r.status_code == 200, r.text
    assert all("again" in _models(url) for url in proc.replica_urls())
    assert _admin(proc.url, "unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    assert not any("again" in _models(url) for url in proc.replica_urls())
