"""A 64-bit word in shared memory is seen by another process as its old value or its new one."""

from __future__ import annotations

import mmap
import multiprocessing
import time
from pathlib import Path

from ringserve.shm import layout as L

_A, _B = 0x5555555555555555, 0xAAAAAAAAAAAAAAAA  # every byte differs: a torn word is neither
_OFF = 64


def _flip(buf, store, rounds: int) -> None:
    for i in range(rounds):
        store(buf, _OFF, _B if i & 1 else _A)


def _odd_reads(store, rounds: int, stop_at_first: bool = False) -> tuple[int, int]:
    """(reads, reads that were neither value) while another process flips the word `rounds` times."""
    buf = mmap.mmap(-1, L.PAGE)
    L.store_word(buf, _OFF, _A)
    proc = multiprocessing.get_context("fork").Process(target=_flip, args=(buf, store, rounds))
    proc.start()
    reads = odd = 0
    load = L.U64.unpack_from
    while proc.is_alive():
        for _ in range(1000):
            value = load(buf, _OFF)[0]
            reads += 1
            odd += value != _A and value != _B
        if odd and stop_at_first:
            proc.kill()
            break
    proc.join()
    return reads, odd


def test_store_word_is_never_seen_zeroed_or_torn():
    reads, odd = _odd_reads(L.store_word, 300_000)
    assert reads > 0 and odd == 0, f"{odd} of {reads} reads saw neither value"


def test_the_check_catches_pack_into_zeroing_the_word_first():
    """The planted bug: `struct.pack_into` memsets the word before writing it (the cause of a seqlock
    reader accepting a torn snapshot under a sequence word read as 0)."""
    deadline = time.monotonic() + 20
    odd = 0
    while not odd and time.monotonic() < deadline:
        _, odd = _odd_reads(L.U64.pack_into, 300_000, stop_at_first=True)
    assert odd, "two processes never overlapped a pack_into: this check could not fail"


def test_no_shm_module_stores_a_word_with_pack_into():
    shm = Path(L.__file__).resolve().parent
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(shm.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if ".pack_into(" in line and not line.lstrip().startswith("#")
    ]
    assert offenders == [], f"use layout.store_word: {offenders}"
