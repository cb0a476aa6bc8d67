"""The stored-responses database: TTL, the per-tenant and total byte caps (oldest first), tenants
apart, and several processes (the API workers) sharing one file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ringserve.api.responses.store import ResponseStore

pytestmark = pytest.mark.asyncio


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(path=None, *, ttl_s=60.0, tenant_bytes=1000, total_bytes=3000, clock=None) -> ResponseStore:
    return ResponseStore(path, ttl_s=ttl_s, tenant_bytes=tenant_bytes, total_bytes=total_bytes, clock=clock or _Clock())


async def _put(store: ResponseStore, tenant: str, rid: str, size: int) -> bool:
    """A record of `size` bytes (response and items halves)."""
    return await store.put(tenant, rid, b"r" * (size // 2), b"i" * (size - size // 2))


async def test_a_record_expires_after_the_ttl():
    clock = _Clock()
    store = _store(clock=clock)
    assert await _put(store, "t", "a", 100)
    clock.now += 59.9
    got = await store.get("t", "a")
    assert got is not None and got.response == b"r" * 50 and got.items == b"i" * 50
    clock.now += 0.2
    assert await store.get("t", "a") is None and not await store.delete("t", "a")
    store.check_integrity()
    store.close()


async def test_a_tenant_over_its_cap_loses_its_oldest_records_only():
    clock = _Clock()
    store = _store(clock=clock)
    await _put(store, "other", "o", 900)
    for i in range(5):  # 5 x 300 bytes under a 1000-byte cap: the 3 newest fit
        clock.now += 1
        assert await _put(store, "t", f"r{i}", 300)
    kept = [i for i in range(5) if await store.get("t", f"r{i}") is not None]
    assert kept == [2, 3, 4]
    assert await store.get("other", "o") is not None
    store.check_integrity()
    store.close()


async def test_the_total_cap_evicts_the_oldest_of_any_tenant():
    clock = _Clock()
    store = _store(clock=clock)
    for i in range(4):  # 4 tenants x 900 bytes under a 3000-byte total
        clock.now += 1
        assert await _put(store, f"t{i}", "x", 900)
    assert [await store.get(f"t{i}", "x") is not None for i in range(4)] == [False, True, True, True]
    store.check_integrity()
    store.close()


async def test_a_record_over_a_tenants_share_or_a_disabled_store_keeps_nothing():
    store = _store()
    assert not await _put(store, "t", "big", 1001)
    assert await store.get("t", "big") is None
    off = _store(tenant_bytes=0, total_bytes=0)
    assert not off.enabled and not await _put(off, "t", "a", 10)
    store.close()
    off.close()


async def test_ids_are_per_tenant():
    """Another tenant's id is a miss for reading and deleting, and the same id may be another
    tenant's record."""
    store = _store()
    await store.put("a", "same", b"A", b"[]")
    await store.put("b", "same", b"B", b"[]")
    assert (await store.get("a", "same")).response == b"A"
    assert await store.delete("b", "same")
    assert await store.get("b", "same") is None and (await store.get("a", "same")).response == b"A"
    store.close()


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from ringserve.api.responses.store import ResponseStore

    async def main(path, name):
        store = ResponseStore(path, ttl_s=600, tenant_bytes=1 << 20, total_bytes=1 << 22)
        for i in range(50):
            assert await store.put("t", f"{name}-{i}", name.encode(), b"[]")
        store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_processes_sharing_the_file_see_each_others_records(tmp_path):
    """Three writer processes at once (as two API workers) and a reader in this one: every record
    of both is found, whichever process stored it."""
    path = str(tmp_path / "ringserve.test.responses")
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, path, name]) for name in ("w0", "w1", "w2")]
    assert [w.wait(60) for w in writers] == [0, 0, 0]
    store = _store(path, tenant_bytes=1 << 20, total_bytes=1 << 22)
    for name in ("w0", "w1", "w2"):
        for i in range(50):
            got = await store.get("t", f"{name}-{i}")
            assert got is not None and got.response == name.encode()
    store.check_integrity()
    store.close()
    assert oct((tmp_path / "ringserve.test.responses").stat().st_mode & 0o777) == "0o600"
