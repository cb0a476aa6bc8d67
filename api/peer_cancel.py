"""Cross-worker DELETE: a request lives in the worker that accepted it, but SO_REUSEPORT hands the
DELETE for it to any worker. Each worker therefore listens on a private Unix socket (Linux
abstract namespace: no file to clean up, gone when the process exits) and a worker that does not
hold the id asks its peers: the owner named in a generated id (`cmpl-<slot>-...`), or every other
worker for a client-chosen id. Only processes of the same user may connect (SO_PEERCRED).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
from urllib.parse import quote

from aiohttp import web

from ringserve.api.registry import Registry
from ringserve.shm.messages import CancelReason

_OWNER = re.compile(r"^cmpl-(\d+)-")
_TENANT_HEADER = "x-ringserve-tenant"
_PEER_TIMEOUT_S = 2.0


class PeerCancel:
    """This worker's side: answer peers' cancel requests, and ask peers to cancel."""

    def __init__(self, instance: str, slot: int, n_workers: int) -> None:
        if not 0 <= slot < n_workers:
            raise ValueError(f"slot {slot} out of range for {n_workers} workers")
        self.instance = instance
        self.slot = slot
        self.n_workers = n_workers
        self._runner: web.ServerRunner | None = None
        self._registry: Registry | None = None

    def address(self, slot: int) -> str:
        return f"\0ringserve.{self.instance}.api.{slot}"

    # serving ---------------------------------------------------------------------------------
    async def start(self, registry: Registry) -> None:
        self._registry = registry
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.address(self.slot))
        sock.listen(64)
        sock.setblocking(False)
        self._runner = web.ServerRunner(web.Server(self._handle), access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.BaseRequest) -> web.Response:
        if not _same_user(request):
            return web.Response(status=403)
        match = re.fullmatch(r"/requests/([^/]+)", request.path)  # path is already unquoted
        tenant = request.headers.get(_TENANT_HEADER)
        if request.method != "DELETE" or match is None or tenant is None:
            return web.Response(status=400)
        entry = self._registry.get(match.group(1), tenant) if self._registry is not None else None
        ended = entry is not None and entry.end(CancelReason.DELETE)
        return web.Response(status=200 if ended else 404)

    # asking ----------------------------------------------------------------------------------
    async def cancel(self, request_id: str, tenant: str) -> bool:
        """Ask the peers that may hold `request_id` to cancel it; True if one did."""
        owner = _OWNER.match(request_id)
        if owner is not None and int(owner.group(1)) < self.n_workers:
            slots = [] if int(owner.group(1)) == self.slot else [int(owner.group(1))]
        else:
            slots = [s for s in range(self.n_workers) if s != self.slot]
        results = await asyncio.gather(*(self._ask(s, request_id, tenant) for s in slots))
        return any(results)

    async def _ask(self, slot: int, request_id: str, tenant: str) -> bool:
        # NOTE: a plain socket and a hand-written request rather than aiohttp's UnixConnector:
        # uvloop cannot connect to an abstract-namespace name given as a path, but it takes a
        # connected socket.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        writer = None
        try:
            async with asyncio.timeout(_PEER_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, self.address(slot))
                reader, writer = await asyncio.open_unix_connection(sock=sock)
                writer.write(
                    f"DELETE /requests/{quote(request_id, safe='')} HTTP/1.1\r\n"
                    f"Host: worker\r\n{_TENANT_HEADER}: {tenant}\r\n"
                    "Content-Length: 0\r\nConnection: close\r\n\r\n".encode()
                )
                await writer.drain()
                status_line = await reader.readline()
        except (OSError, TimeoutError):
            return False  # that worker is restarting or gone: its requests went with it
        finally:
            if writer is not None:
                writer.close()
            else:
                sock.close()
        parts = status_line.split()
        return len(parts) >= 2 and parts[1] == b"200"


def _same_user(request: web.BaseRequest) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is None:
        return False
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()
