"""The GPU process: one thread owns the device and runs the seed's pass in a loop.

    drain request rings -> schedule (leave, join, build) -> forward -> sample -> update
    -> push one StepOutput per worker -> publish stats + heartbeat -> sleep on the doorbell if idle

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
import time
from collections import deque

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.request import Request, TokenEvent
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm import layout as L
from ringserve.shm import messages as M
from ringserve.shm.instance import ShmInstance

log = logging.getLogger("ringserve.gpu")

IDLE_WAIT_S = 0.25  # heartbeat period while idle
BACKLOG_LIMIT = 4096  # records per worker waiting for ring space before its requests are cancelled


class Outbox:
    """One worker's pending output: encoded records waiting for room in its ring."""

    __slots__ = ("ring", "bell", "backlog", "tokens", "finishes")

    def __init__(self, ring, bell) -> None:
        self.ring = ring
        self.bell = bell
        self.backlog: deque[bytes] = deque()
        self.tokens: list[M.Token] = []
        self.finishes: list[M.Finish] = []

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


class GpuLoop:
    def __init__(self, config: Config, shm: ShmInstance, engine, scheduler: Scheduler) -> None:
        self.config = config
        self.shm = shm
        self.control = shm.control
        self.engine = engine
        self.scheduler = scheduler
        self.requests, outputs = shm.gpu_rings()
        self.outboxes = [Outbox(ring, bell) for ring, bell in zip(outputs, shm.output_bells)]
        self.slot_generations = [self.control.worker_slot(i)["generation"] for i in range(shm.n_workers)]
        self.step_no = 0
        self.rejected_429 = 0
        self.stopping = False

    # -- inputs ----------------------------------------------------------------------------------

    def drain(self) -> int:
        """Take every waiting Submit and Cancel; answer admissions at once. Returns records read."""
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
                    self.scheduler.cancel((slot, msg.rid), "stop" if msg.reason == "stop" else msg.reason)
                else:
                    raise TypeError(f"worker {slot} sent {type(msg).__name__}, which only flows GPU -> worker")
            self.outboxes[slot].flush()
        return n

    def _submit(self, slot: int, msg: M.Submit) -> None:
        try:
            req = Request.from_submit(slot, msg)
            bad = next((t for t in msg.prompt_ids if not 0 <= t < self.engine.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{self.engine.vocab_size - 1})")
        except ValueError as exc:
            self.outboxes[slot].send(M.Rejected(rid=msg.rid, status=400, code="invalid_request", message=str(exc)))
            return
        decision = self.scheduler.admit(req)
        if decision.accepted:
            reply = M.Accepted(rid=msg.rid, est_gpu_ms=decision.est_gpu_ms)
        else:
            self.rejected_429 += decision.status == 429
            reply = M.Rejected(rid=msg.rid, status=decision.status, code=decision.code,
                               message=decision.message, retry_after_s=decision.retry_after_s)
        self.outboxes[slot].send(reply)

    def check_worker_slots(self) -> None:
        """A restarted worker (new slot generation) no longer wants its predecessor's rows."""
        for slot, known in enumerate(self.slot_generations):
            gen = self.control.worker_slot(slot)["generation"]
            if gen != known:
                self.slot_generations[slot] = gen
                self._drop_worker(slot, f"worker slot {slot} restarted (generation {gen})")

    def _drop_worker(self, slot: int, why: str) -> None:
        dropped = [key for key in self.scheduler.live_keys() if key[0] == slot]
        for key in dropped:
            self.scheduler.cancel(key, "cancelled")
        box = self.outboxes[slot]
        box.backlog.clear()
        box.tokens.clear()
        box.finishes.clear()
        if dropped:
            log.warning("%s: cancelled %d requests", why, len(dropped))

    # -- the pass --------------------------------------------------------------------------------

    def step(self) -> bool:
        """One pass; False when there was nothing to run."""
        sched = self.scheduler
        batch = sched.schedule()
        if batch.seqs:
            t0 = time.perf_counter()
            samples = self.engine.step(batch)
            sched.observe_step_time((time.perf_counter() - t0) * 1e3)
            events = sched.update(samples)
            self.step_no += 1
        else:
            events = sched.update(None)
        self._route(events)
        return bool(batch.seqs)

    def _route(self, events) -> None:
        boxes = self.outboxes
        for ev in events:
            slot, rid = ev.key
            if isinstance(ev, TokenEvent):
                boxes[slot].tokens.append(M.Token(rid, ev.index, ev.token_id, ev.logprob, ev.top_logprobs))
            else:
                boxes[slot].finishes.append(M.Finish(rid, ev.index, ev.reason, ev.prompt_tokens,
                                                     ev.completion_tokens, ev.queue_ms, ev.ttft_ms))
        for slot, box in enumerate(boxes):
            if box.tokens or box.finishes:
                box.send(M.StepOutput(step=self.step_no, tokens=box.tokens, finishes=box.finishes))
                box.tokens, box.finishes = [], []
            if not box.flush() and len(box.backlog) > BACKLOG_LIMIT:
                self._drop_worker(slot, f"worker slot {slot} stopped reading its output ring")

    def publish(self, step_ms: float) -> None:
        st = self.scheduler.stats()
        region = self.control.gpu_stats
        region.update({
            "queue_depth": st.queue_depth, "queued_gpu_seconds": st.queued_gpu_seconds,
            "running_rows": st.running_rows, "kv_blocks_free": st.kv_blocks_free,
            "kv_blocks_total": st.kv_blocks_total, "preemptions": st.preemptions,
            "cancelled_tokens": st.cancelled_tokens, "prompt_tokens_total": st.prompt_tokens_total,
            "generation_tokens_total": st.generation_tokens_total, "step_ms": step_ms,
            "steps": self.step_no, "rejected_429": self.rejected_429,
            "c_prefill_ms": st.c_prefill_ms, "c_decode_ms": st.c_decode_ms,
            "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
        })
        region.publish()
        self.control.gpu_heartbeat()

    def run(self) -> None:
        bell = self.shm.input_bell
        last_slot_check = 0.0
        while not self.stopping:
            bell.drain()  # NOTE: before reading the rings, so a push after the read re-arms the bell
            self.drain()
            now = time.monotonic()
            if now - last_slot_check > 0.05:
                self.check_worker_slots()
                last_slot_check = now
            t0 = time.perf_counter()
            ran = self.step()
            self.publish((time.perf_counter() - t0) * 1e3 if ran else 0.0)
            idle = not ran and not self.scheduler.has_work and not any(b.backlog for b in self.outboxes)
            if idle:
                bell.wait(IDLE_WAIT_S)
            elif not ran and any(b.backlog for b in self.outboxes):
                time.sleep(0.0005)  # only output is pending: give the workers a moment to read


def serve(config: Config, shm: ShmInstance, model_dir: str) -> None:
    """Load the engine, declare readiness, run until killed."""
    from ringserve.gpu_proc.engine import build_engine

    control = shm.control
    control.set_gpu_state(L.GpuState.STARTING, pid=os.getpid())
    control.gpu_heartbeat()
    t0 = time.monotonic()
    engine = build_engine(config, model_dir, progress=control.gpu_heartbeat)
    sched = Scheduler(config, BlockManager(engine.num_blocks, config.block_size),
                      eos_token_ids=engine.eos_token_ids)
    loop = GpuLoop(config, shm, engine, sched)
    for ring in loop.requests:
        ring.adopt_consumer(control.gpu_generation, discard=True)
    for box in loop.outboxes:
        box.ring.adopt_producer(control.gpu_generation)
    control.set_model_facts({
        "model": config.model_name or os.path.basename(os.path.normpath(model_dir)),
        "vocab_size": engine.vocab_size, "block_size": config.block_size,
        "num_blocks": engine.num_blocks, "context_limit": config.context_limit,
        "eos_token_ids": sorted(engine.eos_token_ids), "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."), "load_s": round(time.monotonic() - t0, 3),
    })
    loop.publish(0.0)
    control.set_gpu_state(L.GpuState.READY, pid=os.getpid())
    log.info("GPU process ready: %s on %s, %d KV blocks, loaded in %.1f s", model_dir, engine.device,
             engine.num_blocks, time.monotonic() - t0)
    # SIGTERM (the supervisor's stop, sent once the workers have drained) ends the loop between
    # passes, so the process exits 0 rather than dying mid-step.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: setattr(loop, "stopping", True))
    loop.run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve-gpu", description="the ringserve GPU process (started by the supervisor)")
    p.add_argument("--instance", required=True)
    p.add_argument("--shm-dir", default=L.DEFAULT_DIRECTORY)
    p.add_argument("--bell-fds", required=True, help="comma-separated doorbell fds: input, then one per worker")
    p.add_argument("--model-dir", required=True)
    args = p.parse_args(argv)
    config = Config.from_json(os.environ["RINGSERVE_CONFIG_JSON"])
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s gpu %(levelname)s %(message)s")
    shm = ShmInstance.attach(args.instance, directory=args.shm_dir,
                             bell_fds=[int(fd) for fd in args.bell_fds.split(",")])
    try:
        serve(config, shm, args.model_dir)
    except BaseException:
        shm.control.set_gpu_state(L.GpuState.DEAD)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
