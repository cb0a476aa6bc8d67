"""Loopback plumbing for tests: a free port, one JSON request, the /metrics samples."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ringserve.tools.harness.metrics_page import scrape
from ringserve.tools.harness.ports import free_port as free_port  # re-exported: the tests import it from here


def http_json(
    url: str, body: dict | None = None, method: str | None = None, headers: dict | None = None, timeout: float = 30.0
) -> tuple[int, dict, dict]:
    """(status, json body, headers) of one request; error statuses are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null"), dict(err.headers)


def metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Samples of `url`/metrics by name; labelled ones keyed `name{k="v",...}` (labels sorted)."""
    return scrape(url, timeout)
