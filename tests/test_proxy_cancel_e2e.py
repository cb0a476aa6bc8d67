"""A proxy that gives up on a request cancels it on the replica (`docs/design.md#fleet`): a real
Envoy (2 s without a byte ends a stream) in front of one real replica (tiny model, CPU).

* a request queued behind a long one past Envoy's timeout: the client gets 504 `fleet_timeout`,
  and the replica drops the request before running it;
* a request held across a GPU-process restart when Envoy gives up: it is not resubmitted to the
  restarted process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from ringserve.tools.fleet.envoy_config import FleetSpec
from ringserve.tools.fleet.replicas import FleetError, envoy_binary
from ringserve.tools.harness.drill import attach_control, find_instance
from ringserve.tools.harness.ports import free_port
from tests.helpers.envoy import EnvoyProcess
from tests.helpers.server import ServerProcess

try:
    envoy_binary()
except FleetError as exc:  # pragma: no cover - the fleet extra is part of `make install`
    pytest.skip(f"no Envoy binary: {exc}", allow_module_level=True)

pytestmark = pytest.mark.timeout(180)

IDLE_S = 2.0


def _post(url: str, body: dict, timeout_s: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def replica_behind_envoy(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy")
    with ServerProcess(
        tiny_model_dir, tmp / "shm", workers=1, max_rows=1, queue_limit_s=600, watchdog_timeout_s=3
    ) as srv:
        spec = FleetSpec(
            endpoints=(("127.0.0.1", srv.port),),
            listen_port=free_port(),
            admin_port=free_port(),
            stream_idle_timeout_s=IDLE_S,
        )
        with EnvoyProcess(spec, tmp) as port:
            time.sleep(1.5)  # one health check: the replica is routable
            yield srv, f"http://127.0.0.1:{port}"


def test_request_a_proxy_timed_out_is_dropped_before_it_runs(replica_behind_envoy):
    """Queued behind a long request past Envoy's idle timeout: 504 fleet_timeout, and the replica
    ends it cancelled without running it (its one row stays with the long request)."""
    srv, proxy = replica_behind_envoy
    blocker = threading.Thread(target=_post, args=(srv.url, {"prompt": "x", "max_tokens": 3000, "ignore_eos": True}))
    blocker.start()
    srv.wait_metric("ringserve_running_rows", lambda v: v == 1)
    cancelled = srv.metrics().get('ringserve_requests_finished_total{reason="cancelled"}', 0.0)
    t0 = time.monotonic()
    status, body = _post(proxy, {"prompt": "queued", "max_tokens": 4})
    assert status == 504 and body["error"]["code"] == "fleet_timeout", body
    # Envoy's timers tick in whole milliseconds: its 2 s can end a hair before ours (CI saw 1.9999998 s)
    assert IDLE_S - 0.01 <= time.monotonic() - t0 < IDLE_S + 2
    srv.wait_metric('ringserve_requests_finished_total{reason="cancelled"}', lambda v: v == cancelled + 1, timeout_s=5)
    srv.wait_metric("ringserve_queue_depth", lambda v: v == 0, timeout_s=2)  # gone at the next step
    assert srv.metrics()["ringserve_running_rows"] == 1  # the long one still has the one row: it never ran
    blocker.join(60)


def test_request_held_across_a_restart_is_not_resubmitted_after_the_proxy_gave_up(replica_behind_envoy):
    """The GPU process hangs under a queued request (SIGSTOP; the replica's watchdog is 3 s); Envoy
    gives up after 2 s; the restarted process never gets the request."""
    srv, proxy = replica_behind_envoy
    seg, control = attach_control(srv.shm_dir, find_instance(srv.shm_dir))
    try:
        generation = control.gpu_generation
        os.kill(control.gpu_pid, signal.SIGSTOP)
        status, body = _post(proxy, {"prompt": "held", "max_tokens": 4})
        assert status == 504 and body["error"]["code"] == "fleet_timeout", body
        deadline = time.monotonic() + 60
        while not (control.gpu_generation > generation and control.gpu_state.name == "READY"):
            assert time.monotonic() < deadline, "the GPU process was not restarted"
            time.sleep(0.05)
        time.sleep(0.5)  # a resubmission would go out at READY
        assert "resubmitted" not in srv.log()
        assert control.gpu_stats.read()["steps"] == 0  # the new process ran nothing
    finally:
        seg.close()
