"""Server-sent events as a client reads them: JSON objects, and the literal "[DONE]" as a string."""

from __future__ import annotations

import json

from ringserve.tools.harness.sse_stream import iter_sse  # noqa: F401 (the tests read streams as the tools do)


def sse_events(raw: bytes | str) -> list:
    """Parse a whole SSE body; every block must be a `data:` line."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        if not block.startswith("data: "):
            raise AssertionError(f"not an SSE data line: {block!r}")
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
