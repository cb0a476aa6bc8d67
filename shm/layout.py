"""Every byte offset in ringserve shared memory, declared once.

Two kinds of segment live under the segment directory (default `/dev/shm`):

* a **ring segment** (`ringserve.<instance>.req.<i>` / `.out.<i>`): a 4 KiB header, then the data
  area of `capacity` bytes holding 8-byte-aligned records;
* the **control segment** (`ringserve.<instance>.control`): GPU generation, state, heartbeat, model
  facts, the GPU process's exit note, the supervisor's restart status, the step in flight and the
  quarantined requests (crash attribution, `shm/in_flight.py`), seqlock-protected GPU stats, and
  one block per worker slot (pid, generation, heartbeat, seqlock-protected worker stats).

Rings, the control block and the `ringserve shm` inspector import these names; nothing else
writes an offset. Every stat is declared in `stats_schema.py` (GPU stats, worker counters,
histograms); the regions' sizes follow from it here, and `SCHEMA_ID` changes so processes built from different
code refuse each other's segments (it covers the ring messages' fields too).

NOTE: every 64-bit word is read with a *native* `struct` format (no `<`/`=` prefix): CPython unpacks
native integers with one `memcpy` of 8 bytes, a single aligned load on x86-64 (the standard-size
formats go byte by byte and could see a word half-written). Words are *stored* with `store_word`,
never `struct.pack_into`: `pack_into` zeroes its target before writing the value (CPython's
`s_pack_internal` starts with a `memset`), so a reader in another process can see 0 in between -- an
even sequence word over a half-written snapshot, a heartbeat of 0, a tail of 0 that makes a ring
look full. `store_word` copies the 8 packed bytes with one `memcpy` (one 8-byte store in glibc's
x86-64 and aarch64 copies); `tests/shm/test_words.py` catches a zero or a torn word between processes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

from ringserve.shm import messages
from ringserve.shm import stats_schema as S

LAYOUT_VERSION = 5
CACHE_LINE = 64
PAGE = 4096
SEGMENT_PREFIX = "ringserve."
DEFAULT_DIRECTORY = "/dev/shm"

U64 = struct.Struct("Q")  # native: one aligned 8-byte load (see the module note)
_pack_word = U64.pack


def store_word(buf, offset: int, value: int) -> None:
    """Store one 64-bit word so that a concurrent reader sees the old value or the new, never 0 or
    a mix (`U64.pack_into` would zero the word first; see the module note)."""
    buf[offset : offset + 8] = _pack_word(value)


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
        store_word(buf, self.offset, value)


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
CTRL_FINGERPRINT_KEY_OFF = 48  # 16 random bytes from the supervisor: the key of request fingerprints
FINGERPRINT_KEY_BYTES = 16
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
# The step in flight (`shm/in_flight.py`): a seqlock word, a header of STEP_HEADER_WORDS words
# (writer's GPU generation, step number, monotonic ns at its start, entries), then up to
# STEP_MAX_ENTRIES entries of STEP_ENTRY_WORDS words (worker slot, rid, fingerprint, tenant tag).
# The GPU loop writes it before each forward and clears it after the step's samples are in.
STEP_HEADER_WORDS = 4
STEP_ENTRY_WORDS = 4
STEP_MAX_ENTRIES = 512  # distinct requests in one step; beyond it a step's requests go unnamed
CTRL_STEP_OFF = _align(CTRL_RESTART_OFF + 16 + CTRL_NOTE_BYTES)
CTRL_STEP_BYTES = 8 * (STEP_HEADER_WORDS + STEP_ENTRY_WORDS * STEP_MAX_ENTRIES)
# The quarantined requests (supervisor -> workers): a blob like the facts, of
# [[fingerprint, until_unix_s], ...].
CTRL_QUARANTINE_BYTES = 16 * 1024 - 16
CTRL_QUARANTINE_OFF = _align(CTRL_STEP_OFF + 8 + CTRL_STEP_BYTES)
# The tenants whose next request the GPU process would refuse now, and their Retry-After: workers
# answer those 429s before reading the body (`api/refusals.py`); written when it changes.
CTRL_REFUSALS_OFF = _align(CTRL_QUARANTINE_OFF + 16 + CTRL_QUARANTINE_BYTES)
CTRL_REFUSALS_BYTES = 4096 - 16
MAX_REFUSED_TENANTS = 64  # the most queued first; a tenant past them is refused by the GPU process
# The LoRA adapters served (GPU process -> workers, and to the next GPU process): a blob of
# [[index, name, path, runtime], ...], `index` the adapter's position in the GPU stats'
# lora_running_<i> / lora_waiting_<i>; written when an adapter is loaded or unloaded.
CTRL_LORAS_OFF = _align(CTRL_REFUSALS_OFF + 16 + CTRL_REFUSALS_BYTES)
CTRL_LORAS_BYTES = 48 * 1024 - 16  # MAX_LORA_ADAPTERS of the longest name and path
# The tenants with their own metrics slot (GPU process -> workers): a blob of [hash, ...] in slot
# order (`gpu_proc/tenant_book.py`), written when a tenant gets a slot.
CTRL_TENANTS_OFF = _align(CTRL_LORAS_OFF + 16 + CTRL_LORAS_BYTES)
CTRL_TENANTS_BYTES = 4096 - 16  # MAX_METRICS_TENANTS hashes of 18 characters
CTRL_GPU_STATS_OFF = _align(CTRL_TENANTS_OFF + 16 + CTRL_TENANTS_BYTES)
CTRL_WORKERS_OFF = CTRL_GPU_STATS_OFF + stats_region_size(len(S.GPU_STAT_NAMES))

# Per worker slot: one line of slot words, then its stats region.
SLOT_PID = 0
SLOT_GENERATION = 8  # bumped by the supervisor when it starts a worker in this slot
SLOT_HB = 16  # time.monotonic_ns() of the worker's last heartbeat
SLOT_STATS_OFF = CACHE_LINE
WORKER_BLOCK_BYTES = CACHE_LINE + stats_region_size(len(S.WORKER_STAT_NAMES))
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
    "|".join((str(LAYOUT_VERSION),) + S.GPU_STAT_NAMES + S.WORKER_STAT_NAMES + _MESSAGE_FIELDS).encode()
    + repr([h.bounds for h in S.HISTOGRAMS]).encode()
)
