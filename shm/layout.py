"""Every byte offset in ringserve shared memory, declared once.

Two kinds of segment live under the segment directory (default `/dev/shm`):

* a **ring segment** (`ringserve.<instance>.req.<i>` / `.out.<i>`): a 4 KiB header, then the data
  area of `capacity` bytes holding 8-byte-aligned records;
* the **control segment** (`ringserve.<instance>.control`): GPU generation, state, heartbeat, model
  facts, the GPU process's exit note, the supervisor's restart status, seqlock-protected GPU stats,
  and one block per worker slot (pid, generation, heartbeat, seqlock-protected worker stats).

Rings, the control block and the `ringserve shm` inspector import these names; nothing else
writes an offset. Adding a stat is one entry in `stats_schema.GPU_STATS` / `WORKER_COUNTER_NAMES` /
`HISTOGRAMS`: offsets and sizes follow, and `SCHEMA_ID` changes so processes built from different
code refuse each other's segments (it covers the ring messages' fields too).

NOTE: every 64-bit word is packed with a *native* `struct` format (no `<`/`=` prefix). CPython
packs native integers with one `memcpy` of 8 bytes, which compiles to a single aligned store on
x86-64; the standard-size formats write byte by byte and could be observed half-written.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

from ringserve.shm import messages, stats_schema
from ringserve.shm.messages import FINISH_REASONS

LAYOUT_VERSION = 2
CACHE_LINE = 64
PAGE = 4096
SEGMENT_PREFIX = "ringserve."
DEFAULT_DIRECTORY = "/dev/shm"

U64 = struct.Struct("Q")  # native: one aligned 8-byte load/store (see the module note)


def _magic(tag: bytes) -> int:
    return int.from_bytes(tag, "little")


RING_MAGIC = _magic(b"RSRING01")
CONTROL_MAGIC = _magic(b"RSCTRL01")


@dataclass(frozen=True)
class Field:
    """One named 64-bit word at a fixed offset (for readers like the inspector)."""

    name: str
    offset: int

    def read(self, buf) -> int:
        return U64.unpack_from(buf, self.offset)[0]

    def write(self, buf, value: int) -> None:
        U64.pack_into(buf, self.offset, value)


# --- ring segment header --------------------------------------------------------------------
# Line 0 is written at creation / reset; head, tail and the two heartbeats each own a cache line
# so the producer's and consumer's stores never share one.
RING_MAGIC_OFF = 0
RING_VERSION_OFF = 8
RING_CAPACITY_OFF = 16
RING_GENERATION_OFF = 24
RING_CREATED_NS_OFF = 32  # time.time_ns() at format
RING_PRODUCER_PID_OFF = 40
RING_CONSUMER_PID_OFF = 48
RING_HEAD_OFF = 1 * CACHE_LINE  # bytes ever reserved by the producer (monotonic)
RING_TAIL_OFF = 2 * CACHE_LINE  # bytes ever consumed (monotonic)
RING_PRODUCER_HB_OFF = 3 * CACHE_LINE  # time.monotonic_ns() of the producer's last heartbeat
RING_CONSUMER_HB_OFF = 4 * CACHE_LINE
RING_DATA_OFF = PAGE  # the data area starts page-aligned
RING_MIN_CAPACITY = 256

RING_FIELDS = tuple(
    Field(n, o)
    for n, o in (
        ("magic", RING_MAGIC_OFF),
        ("version", RING_VERSION_OFF),
        ("capacity", RING_CAPACITY_OFF),
        ("generation", RING_GENERATION_OFF),
        ("created_ns", RING_CREATED_NS_OFF),
        ("producer_pid", RING_PRODUCER_PID_OFF),
        ("consumer_pid", RING_CONSUMER_PID_OFF),
        ("head", RING_HEAD_OFF),
        ("tail", RING_TAIL_OFF),
        ("producer_heartbeat_ns", RING_PRODUCER_HB_OFF),
        ("consumer_heartbeat_ns", RING_CONSUMER_HB_OFF),
    )
)

# --- ring records ---------------------------------------------------------------------------
# A record is an 8-byte header word, then the payload, padded to 8 bytes. The header word is
#   bit 63     COMMIT (a zero word means "nothing here yet")
#   bit 62     PAD (a filler record running to the end of the data area)
#   bits 32-61 stamp: (record position >> 3) & STAMP_MASK, so a word left from an earlier lap
#              or a different position is recognised as corruption, not taken as a record
#   bits 0-31  payload length in bytes
REC_HEADER_BYTES = 8
REC_COMMIT = 1 << 63
REC_PAD = 1 << 62
REC_STAMP_SHIFT = 32
REC_STAMP_MASK = (1 << 30) - 1
REC_LEN_MASK = (1 << 32) - 1
REC_CHECK_MASK = ~(REC_PAD | REC_LEN_MASK) & ((1 << 64) - 1)  # COMMIT + stamp bits


def record_size(length: int) -> int:
    """Bytes a record of `length` payload bytes occupies in the data area (header + padding)."""
    return (length + REC_HEADER_BYTES + 7) & ~7


def record_check(pos: int) -> int:
    """The COMMIT + stamp bits a committed header word at ring position `pos` must carry."""
    return REC_COMMIT | (((pos >> 3) & REC_STAMP_MASK) << REC_STAMP_SHIFT)


def ring_segment_size(capacity: int) -> int:
    return RING_DATA_OFF + capacity


# --- control segment ------------------------------------------------------------------------
class GpuState(IntEnum):
    """What the GPU process is doing; `NONE` until the supervisor first starts one."""

    NONE = 0
    STARTING = 1
    READY = 2
    DEAD = 4


# The GPU stats region holds one value per stat of `stats_schema.GPU_STATS`, in that order.
GPU_STAT_NAMES: tuple[str, ...] = stats_schema.GPU_STAT_NAMES


@dataclass(frozen=True)
class Histogram:
    """A fixed-bucket histogram: counts per upper bound (plus +Inf), a sum and a count."""

    name: str
    bounds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.bounds or any(a >= b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"histogram {self.name}: bounds must be non-empty and increasing")

    @property
    def field_names(self) -> tuple[str, ...]:
        buckets = tuple(f"{self.name}_bucket_{i}" for i in range(len(self.bounds) + 1))
        return buckets + (f"{self.name}_sum", f"{self.name}_count")

    def bucket_name(self, value: float) -> str:
        """The field that counts `value`: the first bucket whose bound is at least it, else +Inf."""
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                return f"{self.name}_bucket_{i}"
        return f"{self.name}_bucket_{len(self.bounds)}"

    def cumulative(self, stats) -> list[float]:
        """Cumulative counts per bound, then +Inf, from a stats snapshot ({field: value})."""
        running, out = 0.0, []
        for i in range(len(self.bounds) + 1):
            running += stats.get(f"{self.name}_bucket_{i}", 0.0)
            out.append(running)
        return out


TTFT_MS_BOUNDS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TPOT_MS_BOUNDS = (5, 10, 20, 30, 40, 50, 70, 100, 150, 250, 500, 1000)
# The design's "latency split by prompt-length bucket" (`docs/design.md#limits-and-timeouts`): TTFT
# and TPOT again per bucket of prompt tokens, named `<base>_plen_<label>` (the worker observes
# them, /metrics labels them).
PROMPT_LEN_LABELS = ("0_512", "512_2048", "2048_8192", "8192_plus")

HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram("ttft_ms", TTFT_MS_BOUNDS),
    Histogram("tpot_ms", TPOT_MS_BOUNDS),
    Histogram("max_gap_ms", (25, 50, 100, 250, 500, 1000, 2500, 5000)),
) + tuple(
    Histogram(f"{base}_plen_{label}", bounds)
    for base, bounds in (("ttft_ms", TTFT_MS_BOUNDS), ("tpot_ms", TPOT_MS_BOUNDS))
    for label in PROMPT_LEN_LABELS
)

WORKER_COUNTER_NAMES: tuple[str, ...] = (
    "requests_total",
    "requests_rejected_400",
    "requests_rejected_429",
    "requests_rejected_other",
    "prompt_tokens_total",
    "completion_tokens_total",
    "open_streams",
    "slow_reader_cancels",
    "disconnects",
) + tuple(f"finished_{reason}" for reason in FINISH_REASONS)

WORKER_STAT_NAMES: tuple[str, ...] = WORKER_COUNTER_NAMES + tuple(name for h in HISTOGRAMS for name in h.field_names)


def _align(n: int, to: int = CACHE_LINE) -> int:
    return (n + to - 1) // to * to


def stats_region_size(n_fields: int) -> int:
    """A seqlock word followed by `n_fields` float64 values, rounded to a cache line."""
    return _align(8 + 8 * n_fields)


CTRL_MAGIC_OFF = 0
CTRL_VERSION_OFF = 8
CTRL_SCHEMA_OFF = 16
CTRL_N_WORKERS_OFF = 24
CTRL_CREATED_NS_OFF = 32
CTRL_OWNER_PID_OFF = 40
CTRL_GPU_GENERATION_OFF = 1 * CACHE_LINE  # bumped by the supervisor for each GPU process start
CTRL_GPU_STATE_OFF = CTRL_GPU_GENERATION_OFF + 8
CTRL_GPU_PID_OFF = CTRL_GPU_GENERATION_OFF + 16
CTRL_GPU_HB_OFF = 2 * CACHE_LINE  # time.monotonic_ns(), written by the GPU process every step
CTRL_FACTS_OFF = 3 * CACHE_LINE  # seqlock word, length word, then msgpack bytes
CTRL_FACTS_BYTES = 2048 - 16  # payload capacity of the model-facts blob
# Two more blobs like the facts: why the last GPU process exited (written by that process before
# it exits), and the supervisor's restart status (last GPU error, failures, next attempt).
CTRL_NOTE_BYTES = 1024 - 16
CTRL_GPU_EXIT_OFF = _align(CTRL_FACTS_OFF + 16 + CTRL_FACTS_BYTES)
CTRL_RESTART_OFF = _align(CTRL_GPU_EXIT_OFF + 16 + CTRL_NOTE_BYTES)
CTRL_GPU_STATS_OFF = _align(CTRL_RESTART_OFF + 16 + CTRL_NOTE_BYTES)
CTRL_WORKERS_OFF = CTRL_GPU_STATS_OFF + stats_region_size(len(GPU_STAT_NAMES))

# Per worker slot: one line of slot words, then its stats region.
SLOT_PID = 0
SLOT_GENERATION = 8  # bumped by the supervisor when it starts a worker in this slot
SLOT_HB = 16  # time.monotonic_ns() of the worker's last heartbeat
SLOT_STATS_OFF = CACHE_LINE
WORKER_BLOCK_BYTES = CACHE_LINE + stats_region_size(len(WORKER_STAT_NAMES))
MAX_WORKERS = 1024

CONTROL_FIELDS = tuple(
    Field(n, o)
    for n, o in (
        ("magic", CTRL_MAGIC_OFF),
        ("version", CTRL_VERSION_OFF),
        ("schema", CTRL_SCHEMA_OFF),
        ("n_workers", CTRL_N_WORKERS_OFF),
        ("created_ns", CTRL_CREATED_NS_OFF),
        ("owner_pid", CTRL_OWNER_PID_OFF),
        ("gpu_generation", CTRL_GPU_GENERATION_OFF),
        ("gpu_state", CTRL_GPU_STATE_OFF),
        ("gpu_pid", CTRL_GPU_PID_OFF),
        ("gpu_heartbeat_ns", CTRL_GPU_HB_OFF),
    )
)


def worker_block_offset(slot: int) -> int:
    return CTRL_WORKERS_OFF + slot * WORKER_BLOCK_BYTES


def control_segment_size(n_workers: int) -> int:
    return _align(worker_block_offset(n_workers), PAGE)


# Identifies the exact field lists, of the stats regions and of the messages on the rings:
# attach refuses a segment whose schema differs.
_MESSAGE_FIELDS = tuple(f"{cls.__name__}({','.join(cls.__struct_fields__)})" for cls in messages.MESSAGE_TYPES)
SCHEMA_ID = zlib.crc32(
    "|".join((str(LAYOUT_VERSION),) + GPU_STAT_NAMES + WORKER_STAT_NAMES + _MESSAGE_FIELDS).encode()
    + repr([h.bounds for h in HISTOGRAMS]).encode()
)
