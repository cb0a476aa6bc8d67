"""One server child of a tool or a test: started, waited for, stopped, its output in one file.

    child = ChildServer(argv, log_path, "http://127.0.0.1:PORT/ready").start()
    child.wait_ready(90)         # seconds it took; None when not ready in time
    child.stop()                 # SIGTERM, then SIGKILL to whatever is left of its session

The child leads its own session, so a stop reaches every process it started (a supervisor's GPU
process and workers, vLLM's engine core) even after the parent has gone. `hostile_check.Server`,
`peer_servers.RunningServer` and the tests' `ServerProcess` each build their command line and
add what they need on top of this.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO

__all__ = ["ChildServer"]


class ChildServer:
    """`argv` run with stdout and stderr in `log_path`; ready when `ready_url` answers 200.

    `env` replaces the environment, `cwd` is its directory, `cpus` pins it (and what it starts),
    `rlimit_nofile` (soft, hard) is its open-file limit."""

    def __init__(
        self,
        argv: list[str],
        log_path: str | Path,
        ready_url: str,
        *,
        name: str = "server",
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        cpus: set[int] | None = None,
        rlimit_nofile: tuple[int, int] | None = None,
    ) -> None:
        self.argv = argv
        self.log_path = Path(log_path)
        self.ready_url = ready_url
        self.name = name
        self.env = env
        self.cwd = cwd
        self.cpus = cpus
        self.rlimit_nofile = rlimit_nofile
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ChildServer:
        cpus, limit = self.cpus, self.rlimit_nofile

        def in_child() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, limit)
            if cpus is not None:
                os.sched_setaffinity(0, cpus)

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=in_child if limit is not None or cpus is not None else None,
        )
        return self

    @property
    def running(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.name} has not been started")
        return self.proc

    def wait_ready(self, timeout_s: float, poll_s: float = 0.1) -> float | None:
        """Seconds until `ready_url` answered 200; None if it did not within `timeout_s`.
        RuntimeError, with the log's tail, if the process exits first."""
        proc = self.running
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {proc.returncode} before it was ready; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(poll_s)
        return None

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, up to `timeout_s` for it to exit, then SIGKILL to its session (children that
        outlived it too); the exit status. Safe to call twice."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode if proc is not None else None


def ringserve_server(
    work: str | Path,
    server_args: list[str],
    ready_timeout_s: float = 600.0,
    name: str = "ringserve",
    python: str | None = None,
) -> ChildServer:
    """`ringserve serve` with `server_args`, one worker, on a free loopback port, its shared
    memory and log in a fresh directory under `work`: started and ready (stopped, and
    RuntimeError naming its log, when not ready in `ready_timeout_s`). The benches' server;
    `python` (default: this one) runs it, so a bench can drive another checkout's server."""
    import sys
    import tempfile

    from ringserve.tools.harness.ports import free_port

    port = free_port()
    shm = Path(tempfile.mkdtemp(prefix="shm-", dir=work))
    argv = [python or sys.executable, "-m", "ringserve", "serve", "--port", str(port), "--shm-dir", str(shm)]
    argv += ["--workers", "1"]
    # NOTE: run from `work`, not here: `python -m` puts its cwd first on the path, and a checkout's
    # own ringserve/ there would shadow the package of another checkout's interpreter
    child = ChildServer(argv + server_args, shm / "server.log", f"http://127.0.0.1:{port}/ready", name=name, cwd=work)
    if child.start().wait_ready(ready_timeout_s) is None:
        child.stop()
        raise RuntimeError(f"{name} was not ready in {ready_timeout_s:.0f} s (log: {shm / 'server.log'})")
    return child
