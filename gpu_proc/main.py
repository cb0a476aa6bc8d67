"""The GPU process: one thread owns the device and runs the scheduler pass in a loop
(`docs/design.md#processes`, `#scheduler-pass`).

    drain request rings -> schedule (leave, join, build) -> record the step in flight -> forward
    -> sample -> update -> push one StepOutput per worker -> publish stats + heartbeat
    -> sleep on the doorbell if idle

It never blocks on a worker: output that does not fit in a worker's ring waits in a bounded
backlog, and a worker whose backlog overflows has its requests cancelled. Any unexpected exception
ends the process with a non-zero status — a process in a broken state must not keep serving; the
supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.grammar_gate import GrammarGate
from ringserve.gpu_proc.heartbeat import LoopHeartbeat
from ringserve.gpu_proc.lora_admin import LoraAdmin
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.rules import GrammarLimits, Violation, submit_violation
from ringserve.shm import layout as L
from ringserve.shm import messages as M
from ringserve.shm.in_flight import tenant_tag
from ringserve.shm.instance import ShmInstance

log = logging.getLogger("ringserve.gpu")

IDLE_WAIT_S = 0.25  # heartbeat period while idle
GRAMMAR_WAIT_S = 0.05  # the idle wait while Submits wait for their grammar (compile deadlines)
BACKLOG_LIMIT = 4096  # records per worker waiting for ring space before its requests are cancelled


class Outbox:
    """One worker's pending output: encoded records waiting for room in its ring."""

    __slots__ = ("ring", "bell", "backlog", "tokens", "finishes", "prompts", "pooled")

    def __init__(self, ring, bell) -> None:
        self.ring = ring
        self.bell = bell
        self.backlog: deque[bytes] = deque()
        self.tokens: list[M.Token] = []
        self.finishes: list[M.Finish] = []
        self.prompts: list[M.PromptLogprobs] = []
        self.pooled: list[M.Pooled] = []

    def send(self, msg: M.Message) -> None:
        self.backlog.append(M.encode(msg))

    def flush(self) -> bool:
        """Push what fits; ring the bell once if anything went. True when nothing is left."""
        backlog, pushed = self.backlog, False
        while backlog and self.ring.try_push(backlog[0]):
            backlog.popleft()
            pushed = True
        if pushed:
            self.bell.ring()
        return not backlog


class EngineLoop:
    """The GPU process's loop (module docstring): rings in, the scheduler's pass, the executor's
    step, records out, stats and heartbeat."""

    def __init__(self, config: Config, shm: ShmInstance, executor, scheduler: Scheduler, cpu_share=None) -> None:
        self.config = config
        self.shm = shm
        self.control = shm.control
        self.executor = executor
        self.scheduler = scheduler
        if shm.input_bell is None or shm.output_bells is None:
            raise ValueError("the GPU loop needs the instance's doorbells (attach with bell_fds)")
        self.input_bell = shm.input_bell
        self.generation = self.control.gpu_generation
        self.requests, outputs = shm.gpu_rings(self.generation)
        self.outboxes = [Outbox(ring, bell) for ring, bell in zip(outputs, shm.output_bells)]
        self.slot_generations = [self.control.worker_slot(i)["generation"] for i in range(shm.n_workers)]
        self.step_no = 0
        self.forward_ms = self.forward_est_ms = 0.0  # the last step's, measured and as the cost model expected
        self.near_limit: dict[str, tuple[int, int]] = {}  # as last published for the workers' refusals
        self.published_tenants = -1  # metrics tenants last published (Control.set_tenants): a count, slots only grow
        self.stopping = False
        self.in_flight = self.control.step_record  # which requests the running step holds, for the supervisor
        self.heartbeat = LoopHeartbeat(
            self.control.gpu_heartbeat, config.watchdog_step_cap_s, config.watchdog_timeout_s
        )
        # constrained Submits wait here until their grammar is compiled (`grammar_gate.py`); the
        # compile threads ring the loop's doorbell as each ends
        self.grammars = GrammarGate(executor.grammar.compiler, GrammarLimits.of(config))
        # adapters loaded and unloaded at runtime (`lora_admin.py`); a load's read rings the doorbell
        self.loras = LoraAdmin(getattr(executor.runner, "loras", None), self.control, scheduler, self.input_bell.ring)
        executor.grammar.compiler.on_done = self.input_bell.ring
        self._constrained: dict[tuple[int, int], M.Submit] = {}  # admitted Submits pinning a grammar
        self.release_memory = None  # called when the loop goes idle (the CPU engine's heap)
        self.cpu_share = cpu_share  # the model's threads, re-decided as the machine's load changes
        self.cpu_threads = 0  # the model's fixed threads on the CPU (without a share), as published
        if getattr(executor, "device", None) is not None and executor.device.type == "cpu":
            import torch

            from ringserve.gpu_proc.cpu_tuning import release_free_memory

            self.release_memory = release_free_memory
            self.cpu_threads = torch.get_num_threads()

    # -- inputs ----------------------------------------------------------------------------------

    def drain(self) -> int:
        """Take every waiting Submit, Cancel and adapter change; answer admissions at once. Returns
        records read."""
        n = 0
        for slot, ring in enumerate(self.requests):
            records = ring.pop_many()
            if not records:
                continue
            n += len(records)
            for buf in records:
                msg = M.decode(buf)
                if isinstance(msg, M.Submit):
                    self._submit(slot, msg)
                elif isinstance(msg, M.Cancel):
                    if not self.scheduler.cancel((slot, msg.rid), msg.reason, msg.index) and msg.index is None:
                        self.grammars.drop(slot, msg.rid)  # it was waiting for its grammar
                elif isinstance(msg, (M.LoadLora, M.UnloadLora)):
                    self.loras.handle(msg, self.outboxes[slot].send)
                else:
                    raise TypeError(f"worker {slot} sent {type(msg).__name__}, which only flows GPU -> worker")
            self.outboxes[slot].flush()
        return n

    def _submit(self, slot: int, msg: M.Submit) -> None:
        broken = submit_violation(msg, self.executor.vocab_size, self.executor.eos_token_ids)
        lora = 0
        if msg.lora is not None:
            loras = self.loras.registry
            lora = loras.ids.get(msg.lora, 0) if loras is not None else 0
            if not lora:  # the worker checked the name: an adapter unloaded meanwhile
                self.outboxes[slot].send(_no_adapter(msg))
                return
        if broken is None:
            try:
                req = Request.from_submit(
                    slot, msg, cache_per_tenant=not self.config.prefix_cache_across_tenants, lora=lora
                )
            except ValueError as exc:
                broken = Violation("prompt", str(exc))
        if broken is not None:
            self.outboxes[slot].send(
                M.Rejected(rid=msg.rid, status=400, code="invalid_request", message=broken.message)
            )
            return
        held = self.grammars.hold(slot, msg, req)
        if held is True:
            return  # `admit_compiled` admits it once its grammar is compiled
        if held is not False:
            self.outboxes[slot].send(M.Rejected(rid=msg.rid, status=400, code=held.code, message=held.message))
            return
        self._admit(slot, msg, req)

    def _admit(self, slot: int, msg: M.Submit, req: Request) -> None:
        loras = self.loras.registry
        if req.lora and (loras is None or req.lora not in loras.adapters):
            # unloaded and freed while its grammar compiled: no queued request held it
            self.grammars.release(msg)
            self.outboxes[slot].send(_no_adapter(msg))
            return
        decision = self.scheduler.admit(req)
        reply: M.Accepted | M.Rejected
        if decision.accepted:
            if msg.sampling.grammar is not None:
                self._constrained[(slot, msg.rid)] = msg  # its compiled grammar stays until it ends
            reply = M.Accepted(rid=msg.rid, est_gpu_ms=decision.est_gpu_ms)
        else:
            self.grammars.release(msg)
            reply = M.Rejected(
                rid=msg.rid,
                est_gpu_ms=decision.est_gpu_ms,
                status=decision.status,
                code=decision.code,
                message=decision.message,
                retry_after_s=decision.retry_after_s,
            )
        self.outboxes[slot].send(reply)

    def admit_compiled(self) -> None:
        """Admit (or refuse) the constrained Submits whose grammar compile ended."""
        for held, refusal in self.grammars.poll():
            box = self.outboxes[held.slot]
            if refusal is None:
                self._admit(held.slot, held.msg, held.request)  # type: ignore[arg-type]
            else:
                box.send(M.Rejected(rid=held.msg.rid, status=400, code=refusal.code, message=refusal.message))
            box.flush()

    def _grammars_ended(self, events) -> None:
        """Unpin the grammars of constrained Submits that have ended (every sample finished)."""
        for slot, record in events:
            if type(record) is M.Finish:
                key = (slot, record.rid)
                msg = self._constrained.get(key)
                if msg is not None and not self.scheduler.is_live(key):
                    del self._constrained[key]
                    self.grammars.release(msg)

    def check_worker_slots(self) -> None:
        """A restarted worker (new slot generation) no longer wants its predecessor's rows."""
        for slot, known in enumerate(self.slot_generations):
            gen = self.control.worker_slot(slot)["generation"]
            if gen != known:
                self.slot_generations[slot] = gen
                self._drop_worker(slot, f"worker slot {slot} restarted (generation {gen})", keep=gen)

    def _drop_worker(self, slot: int, why: str, keep: int | None = None) -> None:
        """Cancel the slot's requests (all, or those numbered by another worker than generation
        `keep`: the successor's own requests may already be here) and drop its pending output."""
        dropped = [
            key
            for key in self.scheduler.live_keys()
            if key[0] == slot and (keep is None or M.rid_generation(key[1]) != keep)
        ]
        for key in dropped:
            self.scheduler.cancel(key, M.CancelReason.CANCELLED)
        held = self.grammars.drop(slot, keep_generation=keep)
        box = self.outboxes[slot]
        box.backlog.clear()
        box.tokens.clear()
        box.finishes.clear()
        box.prompts.clear()
        if dropped or held:
            log.warning("%s: cancelled %d requests", why, len(dropped) + held)

    # -- the pass --------------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass; False when there was nothing to run."""
        sched = self.scheduler
        batch = sched.schedule()
        if batch.seqs:
            # NOTE: written before the forward, cleared once the samples are in: a process that
            # dies in between leaves the supervisor the names of the requests it was running.
            self.in_flight.begin(
                self.generation,
                self.step_no + 1,
                time.monotonic_ns(),
                ((r.key[0], r.key[1], r.fingerprint, tenant_tag(r.tenant)) for r in sched.step_requests(batch)),
            )
            t0 = time.perf_counter()
            samples = self.executor.step(batch)
            self.forward_ms = (time.perf_counter() - t0) * 1e3
            fill_ms = self.loras.after_step()  # LoRA slot fills: priced per request, not per step
            self.forward_est_ms = sched.observe_step_time(self.forward_ms - fill_ms)
            events = sched.update(samples)
            self.in_flight.end()
            self.step_no += 1
        else:
            self.executor.release(batch.finished)
            events = sched.update(None)
        self._route(events)
        return bool(batch.seqs)

    def _route(self, events) -> None:
        if self._constrained:
            self._grammars_ended(events)
        boxes = self.outboxes
        for slot, record in events:
            box = boxes[slot]
            if type(record) is M.Token:
                box.tokens.append(record)
            elif type(record) is M.Finish:
                box.finishes.append(record)
            elif type(record) is M.Pooled:
                box.pooled.append(record)
            else:
                box.prompts.append(record)
        for slot, box in enumerate(boxes):
            if box.tokens or box.finishes or box.prompts or box.pooled:
                box.send(
                    M.StepOutput(
                        step=self.step_no,
                        tokens=box.tokens,
                        finishes=box.finishes,
                        prompt_logprobs=box.prompts,
                        pooled=box.pooled,
                    )
                )
                box.tokens, box.finishes, box.prompts, box.pooled = [], [], [], []
            if not box.flush() and len(box.backlog) > BACKLOG_LIMIT:
                self._drop_worker(slot, f"worker slot {slot} stopped reading its output ring")

    def publish(self, step_ms: float) -> None:
        """The scheduler's stats and the loop's own (`shm/stats_schema.py` declares them all)."""
        region = self.control.gpu_stats
        region.update(self.scheduler.stats().as_dict())
        region.update(
            {
                "step_ms": step_ms,
                "steps": self.step_no,
                "forward_ms": self.forward_ms,
                "forward_est_ms": self.forward_est_ms,
                "cpu_threads": self.cpu_share.threads if self.cpu_share is not None else self.cpu_threads,
            }
        )
        region.publish()
        names = self.scheduler.tenants.names
        if len(names) != self.published_tenants:
            self.published_tenants = len(names)
            self.control.set_tenants(names)
        near = self.scheduler.tenants_near_limit(L.MAX_REFUSED_TENANTS)
        if near != self.near_limit:
            self.near_limit = near
            self.control.set_refusals(self.scheduler.admission.queue_limit_ms, near)
        self.heartbeat.beat()

    def run(self) -> None:
        with self.heartbeat.watching():  # beats for a long pass while it computes (heartbeat.py)
            self._run()

    def _run(self) -> None:
        bell = self.input_bell
        last_slot_check = 0.0
        was_idle = True
        while not self.stopping:
            bell.drain()  # NOTE: before reading the rings, so a push after the read re-arms the bell
            self.drain()
            self.admit_compiled()
            self.loras.poll()
            now = time.monotonic()
            if now - last_slot_check > 0.05:
                self.check_worker_slots()
                last_slot_check = now
            t0 = time.perf_counter()
            ran = self.step()
            # NOTE: idle passes too (every IDLE_WAIT_S at most): a count lowered while a neighbour ran
            # comes back once it stops, before the next request's first step
            if self.cpu_share is not None:
                self.cpu_share.poll()
            self.publish((time.perf_counter() - t0) * 1e3 if ran else 0.0)
            idle = not ran and not self.scheduler.has_work and not any(b.backlog for b in self.outboxes)
            if idle:
                if not was_idle and self.release_memory is not None:
                    self.release_memory()  # cpu_tuning.py: a busy step's memory is kept while busy
                # NOTE: a compile that ends rings the bell; the shorter wait checks compile deadlines
                bell.wait(GRAMMAR_WAIT_S if self.grammars else IDLE_WAIT_S)
            elif not ran and any(b.backlog for b in self.outboxes):
                time.sleep(0.0005)  # only output is pending: give the workers a moment to read
            was_idle = idle


def _no_adapter(msg: M.Submit) -> M.Rejected:
    return M.Rejected(
        rid=msg.rid,
        status=404,
        code="model_not_found",
        message=f"The model {msg.lora!r} does not exist (no such LoRA adapter is loaded).",
    )


@contextmanager
def _beating(beat, every_s: float = IDLE_WAIT_S):
    """Heartbeats from a thread while a step that cannot report progress runs (importing torch
    takes seconds). A stopped process stops this thread too, so the watchdog still sees it."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            beat()

    thread = threading.Thread(target=run, name="load-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def serve(config: Config, shm: ShmInstance, model_dir: str) -> None:
    """Load the model and build the executor, declare readiness, run until killed. Loading beats the heartbeat as it
    makes progress (per tensor read), so the supervisor's watchdog covers a load that hangs."""
    control = shm.control
    control.set_gpu_state(L.GpuState.STARTING, pid=os.getpid())
    control.gpu_heartbeat()
    t0 = time.monotonic()
    with _beating(control.gpu_heartbeat):
        from ringserve.gpu_proc.calibration import calibrate, describe
        from ringserve.gpu_proc.cpu_tuning import CpuShare, available_cpus
        from ringserve.gpu_proc.executor import build_executor
    # NOTE: the heartbeat between load phases (and between kernel compiles and calibration steps)
    # keeps the supervisor's watchdog satisfied through a long load; every kernel is compiled before
    # READY. A single warm-up or calibration step (a full prefill budget) can outlast the watchdog
    # on a slow box, so the loop's own monitor vouches for it while this thread computes, and a
    # load that blocks still goes unbeaten (heartbeat.py).
    loading = LoopHeartbeat(control.gpu_heartbeat, config.watchdog_step_cap_s, config.watchdog_timeout_s)
    with loading.watching():
        # cpu_threads 0 on the CPU: the model's threads follow the CPUs the other processes leave
        # free (`cpu_tuning.CpuShare`), decided first over the load, before calibration times steps
        share = CpuShare(available_cpus()) if config.cpu_threads == 0 else None
        executor = build_executor(config, model_dir, progress=loading.beat)
        if executor.device.type != "cpu":
            share = None
        elif share is not None:
            share.poll(force=True)
        # NOTE: timed steps of each kind on this device, so the first request is priced by what a
        # step costs here (`calibration.py`)
        samples = calibrate(
            executor, config.max_rows, config.prefill_budget, config.context_limit, progress=loading.beat
        )
    sched = Scheduler(
        config,
        BlockManager(executor.num_blocks, config.block_size),
        eos_token_ids=executor.eos_token_ids,
        calibration=samples,
    )
    log.info("cost model: %s", describe(sched.costs, config.max_rows, config.prefill_budget, sched.step_target_ms))
    loop = EngineLoop(config, shm, executor, sched, cpu_share=share)
    with _beating(control.gpu_heartbeat):
        loop.loras.restore(control.loras())  # the runtime-loaded adapters of the process before this one
    control.set_model_facts(
        {
            "model": config.model_name or os.path.basename(os.path.normpath(model_dir)),
            "vocab_size": executor.vocab_size,
            "block_size": config.block_size,
            "num_blocks": executor.num_blocks,
            "context_limit": config.context_limit,
            "eos_token_ids": sorted(executor.eos_token_ids),
            "device": str(executor.device),
            "dtype": str(executor.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(executor.runner.kv_pool.dtype).removeprefix("torch."),
            "load_s": round(time.monotonic() - t0, 3),
            "attention": executor.attention,
            "weights": executor.weights(),
        }
    )
    loop.publish(0.0)
    control.set_gpu_state(L.GpuState.READY, pid=os.getpid())
    log.info(
        "GPU process ready: %s on %s, %d KV blocks, loaded in %.1f s",
        model_dir,
        executor.device,
        executor.num_blocks,
        time.monotonic() - t0,
    )
    # SIGTERM (the supervisor's stop, sent once the workers have drained) ends the loop between
    # passes, so the process exits 0 rather than dying mid-step.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: setattr(loop, "stopping", True))
    try:
        loop.run()
    finally:
        loop.loras.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ringserve-gpu", description="the ringserve GPU process (started by the supervisor)"
    )
    p.add_argument("--instance", required=True)
    p.add_argument("--shm-dir", default=L.DEFAULT_DIRECTORY)
    p.add_argument("--bell-fds", required=True, help="comma-separated doorbell fds: input, then one per worker")
    p.add_argument("--model-dir", required=True)
    args = p.parse_args(argv)
    config = Config.from_json(os.environ["RINGSERVE_CONFIG_JSON"])
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s gpu %(levelname)s %(message)s")
    shm = ShmInstance.attach(
        args.instance, directory=args.shm_dir, bell_fds=[int(fd) for fd in args.bell_fds.split(",")]
    )
    try:
        serve(config, shm, args.model_dir)
    except BaseException as exc:
        if not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            # The supervisor quotes this in its log and the API in its 503s while restarting.
            shm.control.set_gpu_exit(f"{type(exc).__name__}: {exc}")
        shm.control.set_gpu_state(L.GpuState.DEAD)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
