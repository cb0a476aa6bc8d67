"""Server-sent events as the tools' clients read them from an aiohttp streaming response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

DONE = "[DONE]"


async def iter_sse(resp) -> AsyncIterator:
    """The `data:` events of `resp` as they arrive: each a JSON object, then `DONE` when the server
    sends it. The iteration ends without `DONE` when the stream closes without it (the server never
    said it was finished); a data line that is not JSON raises ValueError."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE
            return
        yield json.loads(data)
