"""A running `ringserve fleet` seen from outside: start one, read its layout (`fleet.json`), and
read what Envoy's admin interface says per replica (routed requests, health) and per cluster
(retries, budget overflows). The fleet benchmark and the fleet drills use it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ringserve.tools.fleet.replicas import envoy_healthy

CLUSTER = "ringserve"


class FleetProcess:
    """`with FleetProcess(run_dir, replicas=3, model="tiny", serve_args=[...]) as fleet: fleet.url`

    Runs `ringserve fleet` on free loopback ports; `fleet.state()` is its fleet.json. Stops it
    with SIGTERM (drain), then kills whatever is left of its process groups."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        replicas: int,
        model: str,
        ports: tuple[int, int, int],  # Envoy, first replica, admin
        lb: str = "least_request",
        workers: int = 1,
        serve_args: list[str] | None = None,
        fleet_args: list[str] | None = None,
        ready_timeout_s: float = 120.0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.port, replica_port, self.admin_port = ports
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.ready_timeout_s = ready_timeout_s
        self.args = [
            sys.executable,
            "-m",
            "ringserve",
            "fleet",
            "--replicas",
            str(replicas),
            "--model",
            model,
            "--workers",
            str(workers),
            "--lb",
            lb,
            "--port",
            str(self.port),
            "--replica-port",
            str(replica_port),
            "--admin-port",
            str(self.admin_port),
            "--run-dir",
            str(self.run_dir),
            *(fleet_args or []),
        ]
        if serve_args:
            self.args += ["--", *serve_args]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> FleetProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.run_dir / "fleet.log", "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.ready_timeout_s
        while b"replicas ready behind Envoy" not in self._log_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the fleet did not start:\n{self.log()}")
            time.sleep(0.1)
        return self

    def _log_bytes(self) -> bytes:
        try:
            return (self.run_dir / "fleet.log").read_bytes()
        except FileNotFoundError:
            return b""

    def log(self, tail: int = 4000) -> str:
        parts = [self._log_bytes().decode(errors="replace")[-tail:]]
        for path in sorted(self.run_dir.glob("*.log")):
            if path.name != "fleet.log":
                parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-tail:])
        return "\n".join(parts)

    def state(self) -> dict:
        return json.loads((self.run_dir / "fleet.json").read_text())

    def replica_urls(self) -> list[str]:
        return [r["url"] for r in self.state()["replicas"]]

    def host_stats(self) -> dict[str, dict[str, float]]:
        return host_stats(self.admin_url)

    def cluster_stats(self) -> dict[str, float]:
        return cluster_stats(self.admin_url)

    def healthy(self) -> dict[str, bool] | None:
        return envoy_healthy(self.admin_url)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        pgids = {self.proc.pid}
        try:
            pgids |= {r["pid"] for r in self.state()["replicas"] if r["pid"]} | {self.state()["envoy_pid"]}
        except (OSError, ValueError, KeyError):
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        for pgid in pgids:  # each child leads its own process group
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait()


def free_port_run(n: int, attempts: int = 200) -> int:
    """The first of `n` consecutive loopback ports that are free now (the fleet's replica ports)."""
    import random
    import socket

    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def host_stats(admin_url: str, cluster: str = CLUSTER) -> dict[str, dict[str, float]]:
    """{"host:port": {"rq_total": ..., "rq_active": ..., "rq_error": ..., "cx_connect_fail": ...,
    "weight": ...}} of every replica, from Envoy's /clusters (its `cluster::host::stat::value` lines)."""
    out: dict[str, dict[str, float]] = {}
    for line in _get(admin_url + "/clusters").splitlines():
        parts = line.split("::")
        if len(parts) != 4 or parts[0] != cluster:
            continue
        _, host, name, value = parts
        if ":" not in host:
            continue  # default_priority::max_connections and the like: the cluster's, not a host's
        try:
            out.setdefault(host, {})[name] = float(value)
        except ValueError:
            pass  # health_flags, hostname, zone: words
    return out


def cluster_stats(admin_url: str, cluster: str = CLUSTER) -> dict[str, float]:
    """The cluster's counters and gauges by short name (`upstream_rq_retry`, ...), plus the
    listener's `downstream_rq_*` as `downstream.<name>`."""
    data = json.loads(_get(admin_url + "/stats?format=json"))
    out: dict[str, float] = {}
    prefix, http = f"cluster.{cluster}.", f"http.{cluster}."
    for stat in data.get("stats", []):
        name, value = stat.get("name", ""), stat.get("value")
        if not isinstance(value, (int, float)):
            continue
        if name.startswith(prefix):
            out[name[len(prefix) :]] = float(value)
        elif name.startswith(http):
            out["downstream." + name[len(http) :]] = float(value)
    return out
