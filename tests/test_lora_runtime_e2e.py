"""LoRA adapters loaded and unloaded at runtime (`/v1/load_lora_adapter`, vLLM's shapes) through
the real server, two workers, the openai client, and keys scoped to adapters.

While streams of another adapter and of the base model run without a pause, an admin loads an
adapter (through one worker), requests name it (through either: the table is in shared memory)
and get transformers + PEFT's greedy answer, it is unloaded and becomes a 404 — and none of the
other streams fails. The routes need an admin key, not a tenant's; a path outside `--lora-dir`
is refused before the GPU process sees it; a key scoped to some adapters gets the 404 of a name
nobody serves for the others. A GPU process killed after a runtime load comes back serving it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest
import requests

from ringserve.tools.harness.drill import attach_control, find_instance
from tests.helpers.lora_adapters import make_adapters, peft_greedy, served_greedy
from tests.helpers.server import ServerProcess

NEW_TOKENS = 8
ADMIN, TENANT, SCOPED = "sk-admin-1", "sk-tenant-1", "sk-scoped-1"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-runtime")
    lora_dir = root / "adapters"
    adapters = make_adapters(tiny_model_dir, lora_dir, ("attn-r4", "all-r8", "mlp-r16"))
    (root / "admin-keys").write_text(ADMIN + "\n")
    (root / "keys").write_text(f"{TENANT}\n{SCOPED} adapters=attn-r4\n")
    with ServerProcess(
        tiny_model_dir,
        root / "shm",
        workers=2,
        dtype="float32",
        lora_modules=f"attn-r4={adapters['attn-r4']}",
        lora_dir=lora_dir,
        admin_keys_file=root / "admin-keys",
        api_keys_file=root / "keys",
        max_loras=2,
    ) as srv:
        yield srv, adapters, root


def _client(srv, key=TENANT) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def _ids(client, model, prompt) -> list[int]:
    return served_greedy(client, model, prompt, NEW_TOKENS)


def _admin(srv, route: str, body: dict, key: str = ADMIN) -> requests.Response:
    return requests.post(f"{srv.url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_load_and_unload_under_load_fail_no_other_request(served, tiny_model_dir):
    srv, adapters, _ = served
    client = _client(srv)
    base = client.models.list().data[0].id
    prompt = [1, 17, 29, 41, 5, 9]
    want = peft_greedy(tiny_model_dir, adapters["all-r8"], [prompt], NEW_TOKENS)[0]
    stop, failures, done = threading.Event(), [], [0]

    def stream(client, model: str) -> tuple[str, str | None]:
        text, finish = "", None
        for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            if c.choices:
                text, finish = text + c.choices[0].text, c.choices[0].finish_reason or finish
        return text, finish

    # Greedy, so a stream's answer is known before any load: one served from a slot a load
    # overwrote, or cut short, reads as a changed answer (random sampling may legitimately be empty).
    alone = {m: stream(client, m) for m in (base, "attn-r4")}
    assert all(finish == "length" for _, finish in alone.values()), alone

    def load(model: str) -> None:  # streams of the base model and a --lora-modules adapter, back to back
        mine = _client(srv)
        while not stop.is_set():
            try:
                got = stream(mine, model)
                assert got == alone[model], (got, alone[model])
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                failures.append(f"{model}: {exc!r}")

    threads = [threading.Thread(target=load, args=(m,)) for m in (base, "attn-r4", base, "attn-r4")]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="all-r8", prompt="hi", max_tokens=1)
        r = _admin(srv, "load_lora_adapter", {"lora_name": "all-r8", "lora_path": "all-r8"})
        assert r.status_code == 200, r.text
        assert r.text == "Success: LoRA adapter 'all-r8' added successfully."
        for _ in range(4):  # each worker in turn (SO_REUSEPORT spreads the connections)
            assert _ids(_client(srv), "all-r8", prompt) == want
        assert "all-r8" in {m.id for m in client.models.list().data}
        r = _admin(srv, "unload_lora_adapter", {"lora_name": "all-r8"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'all-r8' removed successfully."
        for _ in range(4):
            with pytest.raises(openai.NotFoundError):
                _client(srv).completions.create(model="all-r8", prompt="hi", max_tokens=1)
        # loaded again (a new id: blocks cached under the first load never serve the second)
        assert _admin(srv, "load_lora_adapter", {"lora_name": "all-r8", "lora_path": "all-r8"}).status_code == 200
        assert _ids(client, "all-r8", prompt) == want
        assert _admin(srv, "unload_lora_adapter", {"lora_name": "all-r8"}).status_code == 200
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    assert done[0] >= 8


def test_the_routes_need_an_admin_key_and_a_path_inside_the_adapter_directory(served, tmp_path):
    srv, adapters, root = served
    body = {"lora_name": "x1", "lora_path": "mlp-r16"}
    for key in (TENANT, "sk-nobody"):  # a tenant's key never opens them
        r = _admin(srv, "load_lora_adapter", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "adapters" / "link-out").symlink_to(outside)
    for path in ("../keys", str(outside), "link-out", "mlp-r16/../../adapters/../keys"):
        r = _admin(srv, "load_lora_adapter", {"lora_name": "x1", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (path, r.text)
    r = _admin(srv, "load_lora_adapter", {"lora_name": "x1", "lora_path": "no-such-adapter"})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]  # the GPU process's check
    for name in ("attn-r4", "a b", ""):
        r = _admin(srv, "load_lora_adapter", {"lora_name": name, "lora_path": "mlp-r16"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", name
    r = _admin(srv, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404
    assert "x1" not in {m.id for m in _client(srv).models.list().data}


def test_a_scoped_key_sees_its_adapters_only(served):
    srv, _, _ = served
    assert _admin(srv, "load_lora_adapter", {"lora_name": "mlp-r16", "lora_path": "mlp-r16"}).status_code == 200
    try:
        scoped, other = _client(srv, SCOPED), _client(srv)
        assert {m.id for m in scoped.models.list().data} - {scoped.models.list().data[0].id} == {"attn-r4"}
        assert {"attn-r4", "mlp-r16"} <= {m.id for m in other.models.list().data}
        assert _ids(scoped, "attn-r4", [3, 4, 5])
        refusals = []
        for model in ("mlp-r16", "no-such-model"):  # another tenant's adapter reads as one nobody serves
            with pytest.raises(openai.NotFoundError) as refused:
                scoped.completions.create(model=model, prompt="hi", max_tokens=1)
            refusals.append(refused.value.body["message"].replace(model, "NAME"))
        assert refusals[0] == refusals[1]
        with pytest.raises(openai.NotFoundError):
            scoped.models.retrieve("mlp-r16")
    finally:
        _admin(srv, "unload_lora_adapter", {"lora_name": "mlp-r16"})


def test_a_restarted_gpu_process_serves_the_runtime_adapters_again(served, tiny_model_dir):
    srv, adapters, _ = served
    assert _admin(srv, "load_lora_adapter", {"lora_name": "mlp-r16", "lora_path": "mlp-r16"}).status_code == 200
    prompt = [2, 3, 5, 7, 11]
    want = peft_greedy(tiny_model_dir, adapters["mlp-r16"], [prompt], NEW_TOKENS)[0]
    seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
    try:
        generation = control.gpu_generation
        os.kill(control.gpu_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (
            control.gpu_generation == generation or control.gpu_state.name != "READY"
        ):
            time.sleep(0.2)
        assert control.gpu_generation != generation
        entry = next(e for e in control.loras() if e.name == "mlp-r16")
        assert entry.runtime
    finally:
        seg.close()
    client = _client(srv)
    for _ in range(100):  # /ready follows the GPU state within a poll
        if requests.get(srv.url + "/ready", timeout=5).status_code == 200:
            break
        time.sleep(0.1)
    assert _ids(client, "mlp-r16", prompt) == want
    assert _admin(srv, "unload_lora_adapter", {"lora_name": "mlp-r16"}).status_code == 200
