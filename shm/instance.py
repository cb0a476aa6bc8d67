"""The shared memory of one server instance: the control segment, a ring pair per worker slot,
and the doorbells.

The supervisor calls `ShmInstance.create(...)`, hands `bell_fds()` to its children (`pass_fds`)
along with `instance` and `directory`, and finally `unlink()`s. A child calls
`ShmInstance.attach(instance, bell_fds=..., directory=...)` and then builds its side of each ring
with `Ring.producer(...)` / `Ring.consumer(...)` over `request_segment(i).buf` /
`output_segment(i).buf` (the helpers below do that).

Segment parts: `control`, `req.<i>` (worker i -> GPU), `out.<i>` (GPU -> worker i).
Doorbells: one input bell the GPU process waits on (all request rings ring it), one output bell
per worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ringserve.shm import layout as L
from ringserve.shm.control import Control
from ringserve.shm.doorbell import Doorbell
from ringserve.shm.ring import Ring, format_ring
from ringserve.shm.segment import (
    Segment,
    ShmSpaceError,
    check_space,
    instance_id,
    parse_segment_name,
    segment_name,
)


@dataclass(frozen=True)
class ShmSizes:
    """How much shared memory an instance needs."""

    ring_bytes: int
    n_workers: int

    def __post_init__(self) -> None:
        if self.ring_bytes < L.RING_MIN_CAPACITY or self.ring_bytes % 8:
            raise ValueError(f"ring_bytes must be a multiple of 8 and >= {L.RING_MIN_CAPACITY}, got {self.ring_bytes}")
        if not 1 <= self.n_workers <= L.MAX_WORKERS:
            raise ValueError(f"n_workers must be in 1..{L.MAX_WORKERS}, got {self.n_workers}")

    @property
    def total_bytes(self) -> int:
        return L.control_segment_size(self.n_workers) + 2 * self.n_workers * L.ring_segment_size(self.ring_bytes)


class ShmInstance:
    """Segments (and, when known, doorbells) of one instance."""

    def __init__(
        self,
        instance: str,
        directory: str,
        control: Segment,
        requests: list[Segment],
        outputs: list[Segment],
        input_bell: Doorbell | None,
        output_bells: list[Doorbell] | None,
    ):
        self.instance = instance
        self.directory = directory
        self.control_segment = control
        self.control = Control(control.buf)
        self.request_segments = requests
        self.output_segments = outputs
        self.input_bell = input_bell
        self.output_bells = output_bells

    @property
    def n_workers(self) -> int:
        return len(self.request_segments)

    @classmethod
    def create(
        cls,
        *,
        ring_bytes: int,
        n_workers: int,
        directory: str = L.DEFAULT_DIRECTORY,
        instance: str | None = None,
        fallocate: Callable[[int, int, int], None] = os.posix_fallocate,
    ) -> ShmInstance:
        """Create and format every segment and doorbell; all or nothing.

        Raises ShmSpaceError (naming the bytes needed) when `directory` is too small.
        """
        sizes = ShmSizes(ring_bytes, n_workers)
        instance = instance_id() if instance is None else instance
        check_space(directory, sizes.total_bytes)
        made: list[Segment] = []

        def make(part: str, size: int) -> Segment:
            seg = Segment.create(segment_name(instance, part), size, directory, fallocate)
            made.append(seg)
            return seg

        try:
            control = make("control", L.control_segment_size(n_workers))
            Control.format(control.buf, n_workers)
            requests: list[Segment] = []
            outputs: list[Segment] = []
            for i in range(n_workers):
                for part, group in ((f"req.{i}", requests), (f"out.{i}", outputs)):
                    seg = make(part, L.ring_segment_size(ring_bytes))
                    format_ring(seg.buf, ring_bytes)
                    group.append(seg)
        except BaseException as exc:
            for seg in made:
                seg.unlink()
                seg.close()
            if isinstance(exc, ShmSpaceError):
                raise ShmSpaceError(
                    exc.errno, f"{exc.strerror}; the whole instance needs {sizes.total_bytes:,} bytes"
                ) from None
            raise
        bells = [Doorbell.create() for _ in range(n_workers + 1)]
        return cls(instance, directory, control, requests, outputs, bells[0], bells[1:])

    @classmethod
    def attach(
        cls, instance: str, *, directory: str = L.DEFAULT_DIRECTORY, bell_fds: list[int] | None = None
    ) -> ShmInstance:
        """Map an existing instance; `bell_fds` as returned by `bell_fds()` in the creator."""
        control = Segment.attach(segment_name(instance, "control"), directory)
        n = Control(control.buf).n_workers
        requests = [Segment.attach(segment_name(instance, f"req.{i}"), directory) for i in range(n)]
        outputs = [Segment.attach(segment_name(instance, f"out.{i}"), directory) for i in range(n)]
        input_bell = output_bells = None
        if bell_fds is not None:
            if len(bell_fds) != n + 1:
                raise ValueError(f"expected {n + 1} doorbell fds (input + one per worker), got {len(bell_fds)}")
            input_bell = Doorbell.from_fd(bell_fds[0])
            output_bells = [Doorbell.from_fd(fd) for fd in bell_fds[1:]]
        return cls(instance, directory, control, requests, outputs, input_bell, output_bells)

    def bell_fds(self) -> list[int]:
        """[input bell, output bell 0, ...]: pass these to children (`pass_fds`)."""
        if self.input_bell is None or self.output_bells is None:
            raise ValueError("this instance was attached without its doorbells")
        return [self.input_bell.fileno()] + [b.fileno() for b in self.output_bells]

    # -- ring sides -----------------------------------------------------------------------------
    def worker_rings(self, slot: int) -> tuple[Ring, Ring]:
        """Worker `slot`: (request ring as producer, output ring as consumer).

        Output left in the ring by a dead predecessor in the slot is dropped: it is for requests
        this worker never made. (The rings' generation is the GPU process's; only the supervisor
        and the GPU process stamp it.)
        """
        req = Ring.producer(self.request_segments[slot].buf)
        out = Ring.consumer(self.output_segments[slot].buf)
        out.skip_committed()
        return req, out

    def gpu_rings(self, generation: int) -> tuple[list[Ring], list[Ring]]:
        """GPU process `generation`: (request rings as consumer, output rings as producer), one per
        slot, adopted: requests queued for a dead predecessor are dropped, and every ring carries
        the generation (which is how workers see a restart)."""
        requests = [Ring(s.buf) for s in self.request_segments]
        outputs = [Ring(s.buf) for s in self.output_segments]
        for ring in requests:
            ring.adopt_consumer(generation)
        for ring in outputs:
            ring.adopt_producer(generation)
        return requests, outputs

    def segments(self) -> list[Segment]:
        return [self.control_segment, *self.request_segments, *self.output_segments]

    def close(self) -> None:
        """Unmap everything and close the doorbells this object holds."""
        for seg in self.segments():
            seg.close()
        for bell in [self.input_bell, *(self.output_bells or [])]:
            if bell is not None:
                bell.close()

    def unlink(self) -> None:
        """Remove the segment names and every other file named for this instance (the API
        workers' stored responses): the supervisor, on exit."""
        for seg in self.segments():
            seg.unlink()
        for name in os.listdir(self.directory):
            parsed = parse_segment_name(name)
            if parsed is not None and parsed[0] == self.instance:
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def __enter__(self) -> ShmInstance:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
