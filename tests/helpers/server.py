"""Start a real `ringserve serve` (supervisor, GPU process, API workers) on loopback for a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ringserve.tools.harness.server_process import ChildServer
from tests.helpers.net import free_port, metrics


class ServerProcess:
    """`with ServerProcess(model_dir, workers=2, queue_limit_s=60) as srv: srv.url ...`

    Extra keyword arguments become `--flag value` options of `ringserve serve`. Shared memory goes
    to a private directory so a test never touches another server's segments. `rlimit_nofile`
    (soft, hard) starts the server with that open-file limit; `env` adds environment variables.
    `sitecustomize` (test only) is Python source every process of the server runs at start: a
    planted fault or a pre-driven estimator, through the real processes.
    """

    def __init__(
        self,
        model_dir: str | Path,
        shm_dir: str | Path,
        *,
        ready_timeout_s: float = 120.0,
        rlimit_nofile: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
        sitecustomize: str | None = None,
        **options,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm_dir = str(shm_dir)
        self.ready_timeout_s = ready_timeout_s
        options.setdefault("workers", 2)
        self.args = [
            sys.executable,
            "-m",
            "ringserve",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--shm-dir",
            self.shm_dir,
        ]
        for name, value in options.items():
            self.args += ["--" + name.replace("_", "-"), str(value)]
        self.rlimit_nofile = rlimit_nofile
        env = dict(env or {})
        if sitecustomize is not None:
            hook = Path(self.shm_dir) / "hook"
            hook.mkdir(parents=True, exist_ok=True)
            (hook / "sitecustomize.py").write_text(sitecustomize)
            repo = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), repo, os.environ.get("PYTHONPATH")]))
        self.env = dict(os.environ, **env) if env else None
        self.log_path = Path(self.shm_dir) / "server.log"
        self.child = ChildServer(
            self.args, self.log_path, self.url + "/ready", env=self.env, rlimit_nofile=rlimit_nofile
        )

    @property
    def proc(self) -> subprocess.Popen:
        return self.child.running

    def __enter__(self) -> ServerProcess:
        os.makedirs(self.shm_dir, exist_ok=True)
        try:
            ready = self.child.start().wait_ready(self.ready_timeout_s)
        except RuntimeError:
            self.child.stop()
            raise
        if ready is None:
            self.child.stop()
            raise RuntimeError(f"server not ready in {self.ready_timeout_s} s:\n{self.log()}")
        return self

    def log(self) -> str:
        return self.child.log_tail()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; the exit status."""
        return self.child.stop(timeout_s)

    def __exit__(self, *exc) -> None:
        self.child.stop()

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name (labelled ones keyed `name{k="v",...}`)."""
        return metrics(self.url)

    def wait_metric(self, name: str, predicate, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"metric {name} = {value} did not reach the expected value")
            time.sleep(0.1)
