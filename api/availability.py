"""The 503 a client gets while the GPU process is not ready: why, and when to come back.

While the supervisor restarts a failed GPU process (docs/design.md#failure-semantics), the API
stays up: each request is answered at once with the last GPU error the supervisor published and a
Retry-After covering the backoff still to wait plus one measured model load.
"""

from __future__ import annotations

import time

from ringserve.api.errors import ApiError
from ringserve.api.state import ApiState


def retry_after_s(st: ApiState, status: dict | None) -> float:
    wait = 0.0
    retry_at = (status or {}).get("retry_at")
    if isinstance(retry_at, (int, float)):
        wait = max(0.0, retry_at - time.time())
    return wait + st.status.reload_s()


def gpu_not_ready(st: ApiState) -> ApiError:
    """503 `gpu_not_ready`, quoting the last GPU-process failure when there was one."""
    try:
        status = st.status.restart_status()
    except Exception:  # a torn control-block read must not turn this 503 into a 500
        status = None
    status = status or {}
    last = status.get("last_error")
    if last and status.get("state") != "ready":
        failures = status.get("failures") or 1
        message = (
            f"The GPU process is restarting after a failure: it {last} ({failures} failure"
            f"{'s' if failures != 1 else ''} recently); retry after the Retry-After seconds."
        )
    else:
        message = "The GPU process is not ready (starting or restarting); retry after the Retry-After seconds."
    return ApiError(503, message, code="gpu_not_ready", retry_after_s=retry_after_s(st, status))
