"""Doorbells: blocking wait with timeout, coalescing, asyncio readiness, inheritance."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

from ringserve.shm.doorbell import Doorbell


def test_wait_times_out_when_not_rung():
    """wait() returns False after its timeout when nobody rings."""
    bell = Doorbell.create()
    t0 = time.monotonic()
    assert bell.wait(0.02) is False
    assert time.monotonic() - t0 >= 0.015
    bell.close()


def test_many_rings_coalesce_into_one_wakeup():
    """Rings before a wait add up: one wait consumes them all, the next one times out."""
    bell = Doorbell.create()
    for _ in range(5):
        bell.ring()
    assert bell.wait(1.0) is True
    assert bell.drain() == 0
    assert bell.wait(0) is False
    bell.ring()
    assert bell.drain() == 1
    bell.close()


def test_usable_with_asyncio_add_reader():
    """A bell's fd becomes readable for asyncio when rung from another process."""
    bell = Doorbell.create()
    assert os.get_inheritable(bell.fileno())

    async def main() -> int:
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        loop.add_reader(bell.fileno(), woke.set)
        proc = multiprocessing.get_context("fork").Process(target=bell.ring)
        proc.start()
        await asyncio.wait_for(woke.wait(), 5)
        loop.remove_reader(bell.fileno())
        proc.join()
        return bell.drain()

    assert asyncio.run(main()) == 1
    bell.close()


def test_wait_forever_survives_a_non_blocking_description():
    """If another process's event loop made the shared fd non-blocking, wait(None) still
    sleeps until rung instead of failing."""
    bell = Doorbell.create()
    os.set_blocking(bell.fileno(), False)  # what libuv does to fds it polls
    proc = multiprocessing.get_context("fork").Process(target=_ring_later, args=(bell,))
    proc.start()
    assert bell.wait(None) is True
    proc.join()
    bell.ring()
    assert bell.drain() == 1 and bell.drain() == 0
    bell.close()


def _ring_later(bell: Doorbell) -> None:
    time.sleep(0.05)
    bell.ring()
