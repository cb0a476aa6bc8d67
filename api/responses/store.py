"""Stored responses: what `store: true` on /v1/responses keeps, for `GET /v1/responses/{id}`,
`DELETE` and `previous_response_id` (`docs/api.md#stored-responses`).

One SQLite database per server instance, a file in its shared-memory directory
(`ringserve.<instance>.responses`), which every API worker opens: SO_REUSEPORT hands the next
request of a conversation to any worker, and each finds the response whichever worker stored it.
It lives on the API side, so a GPU-process restart (or a worker's) loses nothing; the supervisor
removes it with the instance's shared memory, so a restart of the whole server loses every stored
response. In the fake-GPU apps of the tests it is an in-memory database of the one worker.

A record is a response's id, its tenant, its expiry, and two JSON texts: the response object
(what GET answers) and the conversation's items up to and including its output (what
`previous_response_id` continues). Bounds, all enforced in the one transaction that stores a
record: records older than `ttl_s` are gone; a tenant's records add up to at most
`tenant_bytes` and all records to at most `total_bytes`, the oldest evicted first; a record
larger than a tenant's share is not stored. Lookups name the tenant, so another key's id is a
miss, exactly like an id that never existed.

SQLite calls block, so each worker runs them in one thread of its own (the connection lives
there); WAL lets the workers read while one writes, and a write waits at most `BUSY_TIMEOUT_S`
for another's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ringserve.config import Config

log = logging.getLogger("ringserve.api.responses.store")

BUSY_TIMEOUT_S = 5.0
T = TypeVar("T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses ("
    " tenant TEXT NOT NULL, id TEXT NOT NULL, expires REAL NOT NULL, size INTEGER NOT NULL,"
    " response BLOB NOT NULL, items BLOB NOT NULL, PRIMARY KEY (tenant, id)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS responses_by_age ON responses (expires)",
    "CREATE INDEX IF NOT EXISTS responses_by_tenant_age ON responses (tenant, expires)",
)
# The records beyond `limit` bytes, newest kept first (one tenant's, or everyone's).
_OVER_TENANT = (
    "SELECT tenant, id FROM (SELECT tenant, id, SUM(size) OVER (ORDER BY expires DESC, id DESC) AS kept"
    " FROM responses WHERE tenant = ?) WHERE kept > ?"
)
_OVER_TOTAL = (
    "SELECT tenant, id FROM (SELECT tenant, id, SUM(size) OVER (ORDER BY expires DESC, id DESC) AS kept"
    " FROM responses) WHERE kept > ?"
)


class StoreUnavailable(Exception):
    """The database could not be read (the message says why); the route answers 503."""


@dataclass(frozen=True, slots=True)
class Stored:
    """A stored response: the response object's JSON and its conversation's items' JSON."""

    response: bytes
    items: bytes


class ResponseStore:
    """The instance's stored responses, as one worker reaches them (see the module docstring)."""

    def __init__(
        self,
        path: str | None,
        *,
        ttl_s: float,
        tenant_bytes: int,
        total_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`path` None: an in-memory database, this process's alone."""
        self.path = path
        self.ttl_s = ttl_s
        self.tenant_bytes = tenant_bytes
        self.total_bytes = total_bytes
        self.clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._db: sqlite3.Connection | None = None

    @classmethod
    def for_config(cls, config: Config, path: str | None) -> ResponseStore:
        return cls(
            path,
            ttl_s=config.response_store_ttl_s,
            tenant_bytes=config.response_store_tenant_bytes,
            total_bytes=config.response_store_bytes,
        )

    @property
    def enabled(self) -> bool:
        """False when the server stores nothing (`--response-store-bytes 0`)."""
        return self.total_bytes > 0 and self.tenant_bytes > 0

    # the API (each call runs in the store's thread) -------------------------------------------
    async def put(self, tenant: str, response_id: str, response: bytes, items: bytes) -> bool:
        """Store a response; False when it was not kept (larger than a tenant's share, or the
        database failed: logged)."""
        return await self._call(self._put, tenant, response_id, response, items)

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's response `response_id`, None if it has none by that id (any more);
        `StoreUnavailable` when the database cannot be read."""
        return await self._call(self._get, tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Remove the tenant's response; False if it had none by that id."""
        return await self._call(self._delete, tenant, response_id)

    def close(self) -> None:
        self._executor.submit(self._close_db)
        self._executor.shutdown(wait=True)

    def check_integrity(self) -> None:
        """The bounds hold, expired records counted until they are removed (tests call it after
        each scenario)."""
        rows = self._executor.submit(self._totals).result()
        total = sum(size for size in rows.values())
        if total > self.total_bytes:
            raise AssertionError(f"stored responses hold {total} bytes, over the {self.total_bytes} cap")
        for tenant, size in rows.items():
            if size > self.tenant_bytes:
                raise AssertionError(f"tenant {tenant} holds {size} bytes, over the {self.tenant_bytes} cap")

    # in the store's thread -------------------------------------------------------------------
    async def _call(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path is not None:
                # created private to this user before SQLite opens it (it holds prompts and answers)
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            db = sqlite3.connect(self.path or ":memory:", timeout=BUSY_TIMEOUT_S, isolation_level=None)
            _use_wal(db)
            # no fsync per commit: a machine that loses power loses the server's store anyway
            db.execute("PRAGMA synchronous=NORMAL")
            for statement in _SCHEMA:
                db.execute(statement)
            self._db = db
        return self._db

    def _put(self, tenant: str, response_id: str, response: bytes, items: bytes) -> bool:
        size = len(response) + len(items)
        if not self.enabled or size > self.tenant_bytes:
            return False
        now = self.clock()
        try:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                db.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                    (tenant, response_id, now + self.ttl_s, size, response, items),
                )
                over = db.execute(_OVER_TENANT, (tenant, self.tenant_bytes)).fetchall()
                over += db.execute(_OVER_TOTAL, (self.total_bytes,)).fetchall()
                db.executemany("DELETE FROM responses WHERE tenant = ? AND id = ?", over)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:
            log.warning("a response was not stored: %s (%s)", exc, self.path or "in memory")
            return False
        return True

    def _get(self, tenant: str, response_id: str) -> Stored | None:
        query = "SELECT response, items FROM responses WHERE tenant = ? AND id = ? AND expires > ?"
        row = self._execute(query, (tenant, response_id, self.clock())).fetchone()
        return Stored(bytes(row[0]), bytes(row[1])) if row is not None else None

    def _delete(self, tenant: str, response_id: str) -> bool:
        query = "DELETE FROM responses WHERE tenant = ? AND id = ? AND expires > ?"
        return self._execute(query, (tenant, response_id, self.clock())).rowcount > 0

    def _execute(self, query: str, args: tuple) -> sqlite3.Cursor:
        try:
            return self._connection().execute(query, args)
        except (sqlite3.Error, OSError) as exc:
            log.warning("the response store could not be read: %s (%s)", exc, self.path or "in memory")
            raise StoreUnavailable(str(exc)) from None

    def _totals(self) -> dict[str, int]:
        rows = self._connection().execute("SELECT tenant, SUM(size) FROM responses GROUP BY tenant")
        return dict(rows.fetchall())

    def _close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _use_wal(db: sqlite3.Connection) -> None:
    """Put the database in WAL mode (it stays so, in the file). NOTE: switching modes needs the
    database alone and SQLite answers "locked" at once, without waiting as for a busy write, when
    another worker is in it: the first workers to start retry until one has switched."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
