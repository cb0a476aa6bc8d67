"""Start a real `ringserve serve` (supervisor, GPU process, API workers) on loopback for a test."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.net import free_port, http_json, metrics


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
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(self.shm_dir) / "server.log"

    def __enter__(self) -> ServerProcess:
        os.makedirs(self.shm_dir, exist_ok=True)
        self._log = open(self.log_path, "wb")
        limit = self.rlimit_nofile

        def set_limit() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, limit)

        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=set_limit,
            env=self.env,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if http_json(self.url + "/ready", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"server not ready in {self.ready_timeout_s} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()

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
