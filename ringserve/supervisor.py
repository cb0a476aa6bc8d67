"""`ringserve serve`: the supervisor.

It builds the one Config, removes stale segments, creates the shared memory and doorbells, starts
the GPU process, and once the model is loaded starts the API workers on one port (SO_REUSEPORT).
Then it watches its children every POLL_S:

* the GPU process exits (exception, CUDA error, SIGKILL, OOM kill) or stops beating, while
  loading (its loader beats per tensor) or ready (hang: the watchdog SIGKILLs it): the supervisor
  marks it DEAD, bumps the GPU generation and stamps it on every output ring, and rings the
  workers' bells, so each worker fails its open streams with an error event at once; it publishes
  the failure (the process's own last error when it wrote one) in the control block, where the
  workers' 503s quote it, and restarts the process with capped exponential backoff; only with a
  `restart_limit` does it give up, after that many crashes in `restart_window_s`, exiting 1.
  Before the fence it reads which requests were in the step the process was running and strikes
  them (`suspects.py`): a request struck twice is quarantined (its worker fails it rather than
  resubmit it; a resend is refused), and a death blamed on a known suspect is not counted;
* a worker exits, or its heartbeat goes stale (a stuck event loop): it is restarted in its slot
  after a backoff (a new slot generation at once, so the GPU process drops the dead worker's rows
  and frees their blocks); a stale one gets SIGCONT (a stopped one could run no handler) and
  SIGUSR1 first and SIGKILL `LAST_WORDS_S` later, so it can end its open streams with an error
  event (`api/last_words.py`);
* SIGTERM / SIGINT: drain (workers fail /ready for unready_lead_s, then refuse new requests;
  open streams get up to drain_timeout_s),
  stop the GPU process, unlink the shared memory, exit 0.

At start it refuses a port another server holds (`port_claim.py`) and a ring too small for the
largest legal request.

Children get SIGTERM if the supervisor itself dies (PR_SET_PDEATHSIG), and the next start removes
the segments it left. Under systemd (`Type=notify`) it reports READY, STATUS, EXTEND_TIMEOUT_USEC
and WATCHDOG (`sdnotify.py`). It imports no torch: it stays small and starts fast.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ringserve.config import Config
from ringserve.models import hidden_size
from ringserve.port_claim import PortInUse, claim_port
from ringserve.probe import AUTO_INTERVAL_S, MarkerProbe, first_key
from ringserve.restart_policy import RestartPolicy
from ringserve.rules import PROMPT_LOGPROB_TOKENS_PER_STEP
from ringserve.sdnotify import Notifier, watchdog_interval_s
from ringserve.shm import layout as L
from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import max_step_output_bytes, max_submit_bytes
from ringserve.shm.ring import Ring, max_record_bytes
from ringserve.shm.segment import cleanup_stale
from ringserve.suspects import STRIKES_TO_QUARANTINE, Suspects, Verdict

log = logging.getLogger("ringserve.supervisor")

_PR_SET_PDEATHSIG = 1
POLL_S = 0.05  # supervision pass period: bounds how late a death or a hang is noticed
LOAD_TIMEOUT_S = 900.0  # a GPU process still loading after this long is killed, progress or not
EXTEND_EVERY_S = 10.0  # EXTEND_TIMEOUT_USEC cadence while the first model load runs
WORKER_START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0  # beyond the drain: how long a child has to exit after SIGTERM
LAST_WORDS_S = 1.0  # a stale worker's time, after SIGUSR1, to end its streams before SIGKILL
UNKNOWN_HIDDEN_SIZE = 8192  # an embedding's width when config.json does not say (a 70B model's)


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the supervisor is SIGKILLed, the kernel sends
    # the child SIGTERM, so no orphan keeps serving from shared memory nobody will clean up.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _exit_text(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


class SupervisorError(RuntimeError):
    """The supervisor cannot keep the server up (crash loop, start-up failure); it exits non-zero."""


class Supervisor:
    """Owns the shared memory and the children; `run()` is the whole life of `ringserve serve`."""

    def __init__(
        self, config: Config, model_dir: Path, shm_dir: str = L.DEFAULT_DIRECTORY, notifier: Notifier | None = None
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.shm_dir = shm_dir
        self.n_workers = config.workers or default_workers()
        self.notifier = notifier or Notifier()
        self._shm: ShmInstance | None = None
        self.gpu: subprocess.Popen | None = None
        self.gpu_spawned_at = 0.0
        self.gpu_loading = False
        self.gpu_policy = RestartPolicy(config.restart_limit, config.restart_window_s)
        self.suspects = Suspects(config.quarantine_s, config.restart_window_s)
        self.gpu_exit_seq = 0  # the exit note's sequence when the GPU process started
        self.last_gpu_error: str | None = None  # how the last GPU process ended, for the workers
        self.workers: list[subprocess.Popen | None] = [None] * self.n_workers
        self.worker_kill_at: list[float | None] = [None] * self.n_workers  # SIGKILL due (after SIGUSR1)
        self.worker_policies = [
            RestartPolicy(config.restart_limit, config.restart_window_s) for _ in range(self.n_workers)
        ]
        self.port_claim: socket.socket | None = None  # held for the server's life: a second instance refuses the port
        self.workers_started_at: float | None = None
        self.announced = False  # READY=1 sent: the GPU process is ready and every worker listens
        self.stopping = False
        self._last_extend = 0.0
        self._last_watchdog = 0.0
        self._watchdog_every = watchdog_interval_s()
        self.probe: MarkerProbe | None = None  # set once the first GPU process is ready (probe_interval)

    @property
    def shm(self) -> ShmInstance:
        """The shared memory this supervisor created (`start()` creates it)."""
        if self._shm is None:
            raise SupervisorError("the supervisor has no shared memory: call start() first")
        return self._shm

    # -- children --------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["RINGSERVE_CONFIG_JSON"] = self.config.replace(workers=self.n_workers).to_json()
        # NOTE: systemd's variables are for the supervisor alone: a child that sent READY or
        # WATCHDOG would be ignored (NotifyAccess=main) or, worse, mistaken for the service.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(name, None)
        return env

    @property
    def model_name(self) -> str:
        return self.config.model_name or self.model_dir.name

    def _alias_args(self) -> list[str]:
        """Other names a request may give the model: the path it was served from, as given and
        resolved (vLLM's default model id is the `--model` argument)."""
        names = {str(self.model_dir), str(self.model_dir.resolve())}
        if self.config.model:
            names.add(self.config.model)
        return [arg for name in sorted(names - {self.model_name}) for arg in ("--model-alias", name)]

    def _spawn(self, module: str, args: list[str]) -> subprocess.Popen:
        fds = self.shm.bell_fds()
        return subprocess.Popen(
            [sys.executable, "-m", module, "--shm-dir", self.shm_dir, "--bell-fds", ",".join(map(str, fds)), *args],
            env=self._env(),
            pass_fds=fds,
            preexec_fn=_die_with_parent,
        )

    def start_gpu(self) -> None:
        """Spawn a GPU process for the current generation (bumped by `_gpu_down`, or 1 at start)."""
        control = self.shm.control
        if control.gpu_generation == 0:
            control.bump_gpu_generation()
        self.gpu = self._spawn(
            "ringserve.gpu_proc.main", ["--instance", self.shm.instance, "--model-dir", str(self.model_dir)]
        )
        control.set_gpu_state(L.GpuState.STARTING, pid=self.gpu.pid)
        self.gpu_exit_seq = control.gpu_exit()[0]
        self.gpu_spawned_at = time.monotonic()
        self.gpu_loading = True
        self.gpu_policy.restart_at = None
        log.info("GPU process started: pid %d, generation %d", self.gpu.pid, control.gpu_generation)
        self._status(f"loading {self.model_name} (GPU process generation {control.gpu_generation})")

    def start_worker(self, slot: int) -> None:
        self.worker_policies[slot].restart_at = None
        self.worker_kill_at[slot] = None
        proc = self._spawn(
            "ringserve.api.worker",
            [
                "--attach",
                self.shm.instance,
                "--slot",
                str(slot),
                "--tokenizer",
                str(self.model_dir),
                "--model-name",
                self.model_name,
                *self._alias_args(),
            ],
        )
        gen = self.shm.control.start_worker_slot(slot, proc.pid)
        self.workers[slot] = proc
        log.debug("worker %d started: pid %d, slot generation %d", slot, proc.pid, gen)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Shared memory and the first GPU process; workers follow once it is ready (`watch_once`)."""
        try:
            self.port_claim = claim_port(self.config.host, self.config.port)
        except PortInUse as exc:
            raise SupervisorError(f"cannot start: {exc}") from None
        largest = max(
            max_submit_bytes(self.config.context_limit),
            max_step_output_bytes(
                self.config.max_rows,
                PROMPT_LOGPROB_TOKENS_PER_STEP,
                hidden_size(self.model_dir) or UNKNOWN_HIDDEN_SIZE,
            ),
        )
        fits = max_record_bytes(self.config.ring_bytes)
        if largest > fits:
            raise SupervisorError(
                f"ring_bytes {self.config.ring_bytes} takes requests of up to {fits:,} "
                f"bytes, but a request at context_limit {self.config.context_limit} (or a step's output for "
                f"{self.config.max_rows} rows) can take "
                f"{largest:,}; raise --ring-bytes to at least {2 * largest + 64}"
            )
        removed = cleanup_stale(self.shm_dir)
        if removed:
            log.info("removed %d stale shared-memory segments", len(removed))
        self._shm = ShmInstance.create(
            ring_bytes=self.config.ring_bytes, n_workers=self.n_workers, directory=self.shm_dir
        )
        self.start_gpu()

    def watch_once(self) -> None:
        """One supervision pass: GPU process, workers, readiness, systemd watchdog. Never blocks."""
        now = time.monotonic()
        self._watch_gpu(now)
        if self.workers_started_at is None:
            if self.shm.control.gpu_state == L.GpuState.READY and not self.stopping:
                for slot in range(self.n_workers):
                    self.start_worker(slot)
                self.workers_started_at = now
        else:
            self._watch_workers(now)
        if not self.announced and self.workers_started_at is not None:
            self._announce_when_listening(now, self.workers_started_at)
        if self.announced and not self.gpu_loading and self.gpu is not None and not self.stopping:
            self._watch_probe(now)
        if self._watchdog_every is not None and now - self._last_watchdog >= self._watchdog_every:
            self.notifier.watchdog()
            self._last_watchdog = now

    def _watch_gpu(self, now: float) -> None:
        if self.gpu is None:
            if self.gpu_policy.due(now) and not self.stopping:
                self.start_gpu()
            return
        status = self.gpu.poll()
        if status is not None:
            self._gpu_down(now, _exit_text(status))
            return
        control = self.shm.control
        if self.gpu_loading:
            stalled = self._load_stalled_s(now)
            if control.gpu_state == L.GpuState.READY:
                self.gpu_loading = False
                facts = control.model_facts() or {}
                log.info(
                    "GPU process ready in %.1f s (generation %d, %s KV blocks on %s)",
                    now - self.gpu_spawned_at,
                    control.gpu_generation,
                    facts.get("num_blocks"),
                    facts.get("device"),
                )
                if self.last_gpu_error is not None:
                    self._publish_restart("ready", None)
                if self.probe is not None:
                    self.probe.reset(now)
                if self.announced:
                    self._status(self._serving_status())
            elif stalled > self.config.watchdog_timeout_s:
                self._kill_gpu(
                    now, f"made no loading progress for {stalled:.1f} s (watchdog {self.config.watchdog_timeout_s:g} s)"
                )
            elif now - self.gpu_spawned_at > LOAD_TIMEOUT_S:
                self._kill_gpu(now, f"did not become ready within {LOAD_TIMEOUT_S:.0f} s")
            elif not self.announced and now - self._last_extend > EXTEND_EVERY_S:
                # Still in systemd's start phase: ask for more time while the weights load.
                self.notifier.extend_timeout(EXTEND_EVERY_S * 3)
                self._last_extend = now
            return
        age = control.gpu_heartbeat_age_s()
        if age is not None and age > self.config.watchdog_timeout_s:
            # NOTE: the GPU loop beats every pass and every IDLE_WAIT_S while idle, and its monitor
            # beats for a long pass while the loop thread computes (gpu_proc/heartbeat.py), so a
            # stale heartbeat means a hang (SIGSTOP, a deadlock, a pass past the step cap), never
            # mere idleness or a slow step.
            self._kill_gpu(
                now,
                f"sent no heartbeat for {age:.1f} s (watchdog {self.config.watchdog_timeout_s:g} s: its loop is "
                f"blocked, stopped, or one pass ran past --watchdog-step-cap-s {self.config.watchdog_step_cap_s:g} s)",
            )

    def probe_interval_s(self, facts: dict) -> float:
        """Seconds between marker probes; 0 when off (auto: on CUDA with real weights)."""
        interval = self.config.probe_interval_s
        if interval >= 0:
            return interval
        real = self.config.load_format != "dummy" and str(facts.get("device", "")).startswith("cuda")
        return AUTO_INTERVAL_S if real else 0.0

    def _watch_probe(self, now: float) -> None:
        """The marker probe's verdicts: two failures in a row take the GPU process out of service."""
        if self.probe is None:
            interval = self.probe_interval_s(self.shm.control.model_facts() or {})
            if interval <= 0:
                return
            host = "127.0.0.1" if self.config.host in ("", "0.0.0.0", "::") else self.config.host
            key = first_key(self.config.api_keys_file)
            self.probe = MarkerProbe(f"http://{host}:{self.config.port}", self.model_name, key, interval)
            self.probe.reset(now)
        result = self.probe.poll(now)
        if result is None or result.ok:
            return
        log.warning("marker probe failed (%d in a row): %s", self.probe.failures, result.detail)
        if self.probe.should_act:
            self._kill_gpu(now, f"failed the marker probe {self.probe.failures} times in a row ({result.detail})")

    def _load_stalled_s(self, now: float) -> float:
        """Seconds since the loading GPU process last showed progress (a heartbeat; its spawn
        counts as one, so a beat left by its predecessor is never taken for its own)."""
        age = self.shm.control.gpu_heartbeat_age_s()
        since_spawn = now - self.gpu_spawned_at
        return since_spawn if age is None else min(age, since_spawn)

    def _kill_gpu(self, now: float, why: str) -> None:
        gpu = self.gpu
        if gpu is None:
            return
        log.error("GPU process %d %s; killing it", gpu.pid, why)
        gpu.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
        gpu.wait()
        self._gpu_down(now, why)

    def _gpu_down(self, now: float, why: str) -> None:
        """The GPU process is gone: blame its step, fence it off, fail its streams, schedule the
        restart."""
        control = self.shm.control
        seq, note = control.gpu_exit()
        if note and seq != self.gpu_exit_seq:
            why = f"{why}: {note}"  # what the process itself said before exiting
        # NOTE: the quarantine is published before the generation changes: a worker reads it when
        # it sees the change, to fail what must not be resubmitted.
        verdict = self._blame(control) if not self.stopping else None
        control.set_gpu_state(L.GpuState.DEAD)
        gen = control.bump_gpu_generation()
        self._fence_rings(gen)
        self.gpu = None
        self.gpu_loading = False
        self.last_gpu_error = why  # "was killed by SIGKILL", "exited with status 1: CheckpointError: ..."
        if self.stopping:
            log.error("GPU process %s while draining; not restarting", why)
            self._publish_restart("stopped", None)
            return
        backoff = self.gpu_policy.crashed(now, counts=verdict is None or verdict.counts)
        if backoff is None:
            self._status("GPU process crash loop: giving up")
            self._publish_restart("given_up", None)
            raise SupervisorError(
                f"the GPU process failed {self.gpu_policy.recent} times within "
                f"{self.config.restart_window_s:.0f} s (last: {why}); giving up so the service "
                f"manager can act (--restart-limit 0 keeps restarting instead)"
            )
        log.error(
            "GPU process %s; restarting it in %.2f s as generation %d (%d crashes counted in the last %.0f s)",
            why,
            backoff,
            gen,
            self.gpu_policy.recent,
            self.config.restart_window_s,
        )
        self._status(f"GPU process {why}; restarting (generation {gen})")
        self._publish_restart("restarting", time.time() + backoff)

    def _blame(self, control) -> Verdict:
        """Strike the requests that were in the step of the process that died (its own record:
        one of an older generation says nothing about it) and publish the quarantine."""
        record = control.step_record.read()
        mine = record is not None and record.generation == control.gpu_generation
        in_step = record.requests if mine else ()
        wall = time.time()
        verdict = self.suspects.death(wall, in_step)
        if verdict.struck:
            log.warning(
                "the GPU process was running step %d with %d requests (fingerprints %s); %s",
                record.step,
                len(verdict.struck),
                ", ".join(f"{fp:016x}" for fp in verdict.struck[:8]) + (" ..." if len(verdict.struck) > 8 else ""),
                "this failure counts toward --restart-limit"
                if verdict.counts
                else f"not counted toward --restart-limit: {verdict.why}",
            )
        for fp in verdict.quarantined:
            log.error(
                "request %016x was in the step at %d GPU-process failures: it is not run again, and a resend of it "
                "(same tenant, prompt and parameters) is refused for %.0f s",
                fp,
                STRIKES_TO_QUARANTINE,
                self.config.quarantine_s,
            )
        control.set_quarantine(self.suspects.quarantine(wall))
        return verdict

    def _publish_restart(self, state: str, retry_at: float | None) -> None:
        """Tell the workers (control block) why the GPU process is not ready and when it is next
        tried; their 503s quote it."""
        self.shm.control.set_restart_status(
            {
                "state": state,
                "last_error": self.last_gpu_error,
                "failures": self.gpu_policy.recent,
                "retry_at": retry_at,
            }
        )

    def _fence_rings(self, generation: int) -> None:
        """Stand in as every output ring's producer under the new generation and ring the bells.

        Each worker sees the generation change at once and fails its open requests with an error
        event (`api/ring_transport.py`) instead of waiting for the next GPU process to load. The
        next process adopts the rings under this same generation, so the workers see one change.
        """
        for seg, bell in zip(self.shm.output_segments, self.shm.output_bells or ()):
            Ring(seg.buf).adopt_producer(generation)
            bell.ring()

    def _watch_workers(self, now: float) -> None:
        control = self.shm.control
        for slot, proc in enumerate(self.workers):
            if proc is None:
                if self.worker_policies[slot].due(now) and not self.stopping:
                    self.start_worker(slot)
                continue
            if proc.poll() is None:
                # A worker beats every 0.25 s from its event loop; a stale beat means the loop is
                # stuck (or the process stopped), and its clients are stuck with it.
                age = control.worker_slot(slot)["heartbeat_age_s"]
                if not self.announced or age is None or age <= self.config.watchdog_timeout_s:
                    continue
                kill_at = self.worker_kill_at[slot]
                if kill_at is None:
                    log.error(
                        "API worker %d (pid %d) sent no heartbeat for %.1f s; telling it to end its "
                        "streams with an error, killing it in %.1f s",
                        slot,
                        proc.pid,
                        age,
                        LAST_WORDS_S,
                    )
                    # NOTE: SIGCONT first: a stopped process runs no handler, so SIGUSR1 alone
                    # would wait, and the SIGKILL after it would cut every stream with no event.
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGUSR1)
                    self.worker_kill_at[slot] = now + LAST_WORDS_S
                    continue
                if now < kill_at:
                    continue
                log.error("API worker %d (pid %d) is still unresponsive; killing it", slot, proc.pid)
                proc.kill()
                proc.wait()
            if not self.announced:
                raise SupervisorError(
                    f"API worker {slot} exited with status {proc.returncode} at "
                    f"start-up (is port {self.config.port} in use?)"
                )
            policy = self.worker_policies[slot]
            backoff = policy.crashed(now)
            if backoff is None:
                raise SupervisorError(
                    f"API worker {slot} failed {policy.recent} times within "
                    f"{self.config.restart_window_s:.0f} s; giving up"
                )
            log.error(
                "API worker %d (pid %d) exited with status %s; restarting it in %.2f s",
                slot,
                proc.pid,
                proc.returncode,
                backoff,
            )
            # A new slot generation now, so the GPU process drops the dead worker's rows at once.
            control.start_worker_slot(slot, 0)
            self.workers[slot] = None

    def _announce_when_listening(self, now: float, started_at: float) -> None:
        control = self.shm.control
        if any(control.worker_slot(i)["heartbeat_age_s"] is None for i in range(self.n_workers)):
            if now - started_at > WORKER_START_TIMEOUT_S:
                raise SupervisorError(f"the API workers did not start listening within {WORKER_START_TIMEOUT_S:.0f} s")
            return
        self.announced = True
        facts = control.model_facts() or {}
        log.info(
            "ringserve listening on http://%s:%d with %d workers, model %s (%s, %s, %s KV blocks)",
            self.config.host,
            self.config.port,
            self.n_workers,
            facts.get("model"),
            facts.get("device"),
            facts.get("dtype"),
            facts.get("num_blocks"),
        )
        self.notifier.ready(self._serving_status())

    def _serving_status(self) -> str:
        return (
            f"serving {self.model_name} on {self.config.host}:{self.config.port}, "
            f"{self.n_workers} workers, GPU generation {self.shm.control.gpu_generation}"
        )

    def _status(self, text: str) -> None:
        self.notifier.status(text)

    def drain(self) -> None:
        """SIGTERM: workers fail /ready for unready_lead_s, then refuse new requests and let open
        streams finish (up to drain_timeout_s); then the GPU process stops. Stragglers are killed."""
        drain_s = self.config.unready_lead_s + self.config.drain_timeout_s
        log.info(
            "draining: /ready fails now, new requests get 503 in %.1f s, open streams have up to %.0f s",
            self.config.unready_lead_s,
            drain_s,
        )
        self.notifier.stopping(f"draining (up to {drain_s:.0f} s)")
        self.notifier.extend_timeout(drain_s + STOP_GRACE_S * 2)
        workers = [p for p in self.workers if p is not None and p.poll() is None]
        for p in workers:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + drain_s + STOP_GRACE_S
        while any(p.poll() is None for p in workers) and time.monotonic() < deadline:
            if self.gpu is not None and self.gpu.poll() is not None:
                self._gpu_down(time.monotonic(), _exit_text(self.gpu.returncode))
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Stop every child still running (workers first), then unlink the shared memory."""
        for group in ([p for p in self.workers if p is not None], [self.gpu] if self.gpu else []):
            live = [p for p in group if p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in live:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("pid %d did not stop within %.0f s; killing it", p.pid, STOP_GRACE_S)
                    p.kill()
                    p.wait()
        if self._shm is not None:
            self._shm.unlink()
            self._shm.close()
            self._shm = None
        if self.port_claim is not None:
            self.port_claim.close()
            self.port_claim = None

    def run(self) -> int:
        """Start, supervise until SIGTERM/SIGINT, drain, clean up. 0 on a clean stop, 1 on failure."""

        def on_signal(signum, _frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            self.start()
            while not self.stopping:
                self.watch_once()
                time.sleep(POLL_S)
            self.drain()
            log.info("stopped")
            return 0
        except (SupervisorError, OSError) as exc:
            # OSError: the shared-memory directory is missing or full (ShmSpaceError names the
            # bytes needed), or a child could not be spawned; the message says which.
            log.error("%s", exc)
            self.notifier.status(f"failed: {exc}")
            return 1
        finally:
            self.stop()
            self.notifier.close()
