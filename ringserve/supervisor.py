"""`ringserve serve`: the supervisor.

It builds the one Config, creates the shared memory and doorbells, removes stale segments, starts
the GPU process and waits until the model is loaded, starts the API workers on one port
(SO_REUSEPORT), then watches its children: a dead GPU process is restarted with a new generation, a
dead worker is restarted in its slot. Ctrl-C or SIGTERM stops everything and unlinks the shared
memory. It imports no torch: it stays small and starts fast.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from ringserve.config import Config, ConfigError
from ringserve.shm import layout as L
from ringserve.shm.instance import ShmInstance
from ringserve.shm.segment import ShmSpaceError, cleanup_stale

log = logging.getLogger("ringserve.supervisor")

_PR_SET_PDEATHSIG = 1


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def default_model_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ringserve" / "tiny-llama"


def ensure_tiny_model(path: Path) -> Path:
    """The built-in model: built once (seconds) on first start, then reused."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    log.info("building the built-in tiny model in %s", path)
    subprocess.run([sys.executable, "-m", "ringserve", "make-tiny-model", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the supervisor is SIGKILLed, the kernel sends
    # the child SIGTERM, so no orphan keeps serving from shared memory nobody will clean up.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    def __init__(self, config: Config, model_dir: Path, shm_dir: str = L.DEFAULT_DIRECTORY) -> None:
        self.config = config
        self.model_dir = model_dir
        self.shm_dir = shm_dir
        self.n_workers = config.workers or default_workers()
        self.shm: ShmInstance | None = None
        self.gpu: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * self.n_workers
        self.stopping = False
        self.gpu_starts: list[float] = []

    # -- children --------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["RINGSERVE_CONFIG_JSON"] = self.config.replace(workers=self.n_workers).to_json()
        return env

    def _common_args(self) -> list[str]:
        fds = ",".join(str(fd) for fd in self.shm.bell_fds())
        return ["--instance", self.shm.instance, "--shm-dir", self.shm_dir, "--bell-fds", fds,
                "--model-dir", str(self.model_dir)]

    def _spawn(self, module: str, extra: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, *self._common_args(), *extra],
                                env=self._env(), pass_fds=self.shm.bell_fds(),
                                preexec_fn=_die_with_parent)

    def start_gpu(self) -> None:
        control = self.shm.control
        gen = control.bump_gpu_generation()
        control.set_gpu_state(L.GpuState.STARTING)
        self.gpu_starts.append(time.monotonic())
        self.gpu = self._spawn("ringserve.gpu_proc.main", [])
        log.info("GPU process started: pid %d, generation %d", self.gpu.pid, gen)

    def wait_gpu_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.shm.control.gpu_state != L.GpuState.READY:
            if self.gpu.poll() is not None:
                raise RuntimeError(f"the GPU process exited with status {self.gpu.returncode} while loading "
                                   f"{self.model_dir} (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the GPU process did not become ready within {timeout_s:.0f} s")
            time.sleep(0.05)

    def start_worker(self, slot: int) -> None:
        proc = self._spawn("ringserve.api.worker", ["--slot", str(slot)])
        gen = self.shm.control.start_worker_slot(slot, proc.pid)
        self.workers[slot] = proc
        log.debug("worker %d started: pid %d, slot generation %d", slot, proc.pid, gen)

    def wait_workers_listening(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        control = self.shm.control
        while any(control.worker_slot(i)["heartbeat_age_s"] is None for i in range(self.n_workers)):
            for i, proc in enumerate(self.workers):
                if proc.poll() is not None:
                    raise RuntimeError(f"API worker {i} exited with status {proc.returncode} at start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the API workers did not start listening within {timeout_s:.0f} s")
            time.sleep(0.05)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        removed = cleanup_stale(self.shm_dir)
        if removed:
            log.info("removed %d stale shared-memory segments", len(removed))
        self.shm = ShmInstance.create(ring_bytes=self.config.ring_bytes, n_workers=self.n_workers,
                                      directory=self.shm_dir)
        self.start_gpu()
        self.wait_gpu_ready()
        for slot in range(self.n_workers):
            self.start_worker(slot)
        self.wait_workers_listening()
        facts = self.shm.control.model_facts() or {}
        log.info("ringserve listening on http://%s:%d with %d workers, model %s (%s, %s, %s KV blocks)",
                 self.config.host, self.config.port, self.n_workers, facts.get("model"),
                 facts.get("device"), facts.get("dtype"), facts.get("num_blocks"))

    def watch_once(self) -> None:
        """Restart whatever died (with a crash-loop limit for the GPU process)."""
        if self.gpu is not None and self.gpu.poll() is not None:
            status = self.gpu.returncode
            self.shm.control.set_gpu_state(L.GpuState.DEAD)
            window = self.config.restart_window_s
            now = time.monotonic()
            recent = [t for t in self.gpu_starts if now - t <= window]
            if len(recent) >= self.config.restart_limit:
                raise RuntimeError(f"the GPU process died {len(recent)} times within {window:.0f} s "
                                   f"(last status {status}); giving up")
            log.error("GPU process exited with status %s; restarting", status)
            self.start_gpu()
            self.wait_gpu_ready()
        for slot, proc in enumerate(self.workers):
            if proc is not None and proc.poll() is not None:
                log.error("API worker %d exited with status %s; restarting", slot, proc.returncode)
                self.start_worker(slot)

    def stop(self) -> None:
        children = [p for p in [*self.workers, self.gpu] if p is not None and p.poll() is None]
        for p in children:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_timeout_s + 5
        for p in children:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.shm is not None:
            self.shm.unlink()
            self.shm.close()
            self.shm = None

    def run(self) -> int:
        def on_signal(signum, _frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.start()
            while not self.stopping:
                self.watch_once()
                time.sleep(0.1)
            log.info("stopping")
            return 0
        except (RuntimeError, ShmSpaceError) as exc:
            log.error("%s", exc)
            return 1
        finally:
            self.stop()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--shm-dir", default=L.DEFAULT_DIRECTORY, help=argparse.SUPPRESS)
    for f in fields(Config):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        typ = int if kind.startswith("int") else float if kind.startswith("float") else str
        p.add_argument(flag, type=typ, default=None, help=f"(default {f.default}; env RINGSERVE_{f.name.upper()})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "shm_dir"}
    try:
        config = Config.from_env(**overrides)
    except ConfigError as exc:
        print(f"ringserve serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s supervisor %(levelname)s %(message)s")
    model_dir = Path(config.model) if config.model else ensure_tiny_model(default_model_dir())
    return Supervisor(config, model_dir, args.shm_dir).run()
