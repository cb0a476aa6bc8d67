"""Loading and unloading LoRA adapters while the GPU process serves (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`): the GPU loop's side.

A `LoadLora` reads and checks a checkpoint (tens of MB of safetensors, at disk speed) on a thread
of its own, so the loop keeps stepping meanwhile; when it is read, the loop serves it
(`LoraRegistry.add`), publishes the table the workers read (`Control.set_loras`) and answers the
worker. An `UnloadLora` takes the name away at once (new requests naming it are 404s) and the
weights go when no queued or running request runs them (`LoraRegistry.collect`). A GPU process
that restarts loads the runtime-loaded adapters of the table again (`restore`), at their stats
indices, so a crash does not turn them into 404s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from ringserve.shm import messages as M
from ringserve.shm.control import LoraEntry

if TYPE_CHECKING:  # lora.py imports torch, which the GPU process imports while it beats (main.py)
    from ringserve.gpu_proc.lora import Adapter, LoraRegistry

log = logging.getLogger("ringserve.gpu")


class LoraAdmin:
    """Runtime adapter changes for one GPU process: `handle` takes the workers' messages, `poll`
    (every loop pass) serves what finished loading and frees unloaded adapters nobody runs."""

    def __init__(self, registry: LoraRegistry | None, control, scheduler, wake: Callable[[], None]) -> None:
        self.registry, self.control, self.scheduler, self._wake = registry, control, scheduler, wake
        self._loads: list[tuple[Callable[[M.Message], None], M.LoadLora, Future[Adapter]]] = []
        self._pool: ThreadPoolExecutor | None = None

    def handle(self, msg: M.LoadLora | M.UnloadLora, reply: Callable[[M.Message], None]) -> None:
        registry = self.registry
        if registry is None:
            reply(_refused(msg.rid, 400, "LoRA adapters are not served by this GPU process."))
            return
        from ringserve.gpu_proc.lora import AdapterError, load_adapter

        if isinstance(msg, M.UnloadLora):
            if msg.name not in registry.ids:
                reply(_refused(msg.rid, 404, f"The LoRA adapter {msg.name!r} cannot be found.", "model_not_found"))
                return
            registry.unload(msg.name)
            self._changed()
            log.info("LoRA adapter %s unloaded", msg.name)
            reply(M.Accepted(rid=msg.rid, est_gpu_ms=0.0))
            return
        try:
            if any(m.name == msg.name for _, m, _ in self._loads):
                raise AdapterError(f"The LoRA adapter {msg.name!r} is being loaded.")
            registry.check_name(msg.name, pending=len(self._loads))
        except AdapterError as exc:
            reply(_refused(msg.rid, 400, str(exc)))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        future = self._pool.submit(load_adapter, msg.name, msg.path, registry.args, registry.max_rank)
        future.add_done_callback(lambda _: self._wake())
        self._loads.append((reply, msg, future))

    def poll(self) -> None:
        if self._loads:
            self._finish_loads()
        if self.registry is not None and self.registry.retired:
            before = len(self.registry.adapters)
            self.registry.collect(self.scheduler.lora_ids())
            if len(self.registry.adapters) != before:
                self._changed()

    def after_step(self) -> float:
        """The ms of the step just run that went into slot fills (kept out of the cost model's
        step fit: a swap is priced per request instead), and the scheduler's view of which
        adapters are resident and what a fill costs, brought up to date."""
        registry = self.registry
        if registry is None or not registry.swaps:
            return 0.0
        self.scheduler.lora_resident, self.scheduler.lora_swap_ms = registry.resident, registry.fill_ms
        return registry.take_fill_ms()

    def restore(self, entries: tuple[LoraEntry, ...]) -> None:
        """Load again the runtime-loaded adapters of a previous GPU process's table; one that no
        longer loads is dropped, with a warning (the --lora-modules ones are loaded already)."""
        from ringserve.gpu_proc.lora import AdapterError, load_adapter

        registry = self.registry
        if registry is None:
            return
        for entry in entries:
            if not entry.runtime or entry.name in registry.ids:
                continue
            try:
                adapter = load_adapter(entry.name, entry.path, registry.args, registry.max_rank)
                registry.add(adapter, runtime=True, index=entry.stat)
            except (AdapterError, OSError) as exc:
                log.warning("LoRA adapter %s not loaded again after the restart: %s", entry.name, exc)
        self._changed()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _finish_loads(self) -> None:
        from ringserve.gpu_proc.lora import AdapterError

        registry = self.registry
        assert registry is not None
        waiting = []
        for reply, msg, future in self._loads:
            if not future.done():
                waiting.append((reply, msg, future))
                continue
            try:
                adapter = future.result()
                registry.add(adapter, runtime=True)
            except (AdapterError, OSError) as exc:
                reply(_refused(msg.rid, 400, str(exc)))
                continue
            self._changed()
            log.info("LoRA adapter %s loaded (rank %d, %.1f MB)", msg.name, adapter.rank, adapter.nbytes / 1e6)
            reply(M.Accepted(rid=msg.rid, est_gpu_ms=0.0))
        self._loads = waiting

    def _changed(self) -> None:
        registry = self.registry
        assert registry is not None
        self.scheduler.lora_index = dict(registry.index)
        self.control.set_loras(registry.table())


def _refused(rid: int, status: int, message: str, code: str = "invalid_request") -> M.Rejected:
    return M.Rejected(rid=rid, status=status, code=code, message=message)
