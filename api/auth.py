"""Bearer-key authentication and the fairness tenant.

With a keys file (`--api-keys FILE`: one key per line, `#` comments and blank lines ignored) every
path but /health, /ready and /metrics needs `Authorization: Bearer <key>` (or Anthropic's
`x-api-key: <key>`, which anthropic-SDK clients send) naming one of them; keys
are compared in constant time, all of them every time. The tenant the scheduler shares the GPU
between is the key. Without keys the tenant is the bearer token when one is sent, else one shared
tenant. Tenants travel as a short hash, so no key is ever written to shared memory or logs.

/metrics is open (a scraper needs no tenant key) unless `--metrics-keys-file FILE` names keys of its
own: then it needs `Authorization: Bearer <metrics key>`, and no tenant key opens it.

A key's line may restrict it to some LoRA adapters: `KEY adapters=support,legal` runs the base
model and those adapters only; any other adapter is, to that key, a model that does not exist
(404, the answer for a name nobody serves, so a key cannot learn which adapters others have).
The adapter admin routes (`ADMIN_PATHS`) need a key of `--admin-keys-file`, never a tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from aiohttp import web

from ringserve.api.errors import ApiError

METRICS_PATH = "/metrics"
PUBLIC_PATHS = frozenset({"/health", "/ready", METRICS_PATH})
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
SHARED_TENANT = "shared"


def load_keys(path: str | Path) -> frozenset[str]:
    """Read a keys file; an empty file is an error (it would lock every client out)."""
    return frozenset(load_key_scopes(path))


def load_key_scopes(path: str | Path) -> dict[str, frozenset[str] | None]:
    """A keys file as {key: the adapters it may run, None for all}, from `adapters=a,b` after a key."""
    keys: dict[str, frozenset[str] | None] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, *fields = line.split()
        scope: frozenset[str] | None = None
        for f in fields:  # a word without "=" is a note
            name, eq, value = f.partition("=")
            if not eq:
                continue
            if name != "adapters":
                raise ValueError(f"API keys file {path}, line {number}: unknown field {name!r} (adapters=a,b is known)")
            scope = frozenset(a for a in value.split(",") if a)
        keys[key] = scope
    if not keys:
        raise ValueError(f"API keys file {path} holds no keys (one key per line)")
    return keys


def _token_bytes(token: str) -> bytes:
    # NOTE: aiohttp decodes header bytes that are not UTF-8 as lone surrogates; they hash as the
    # bytes the client sent (a key with them never matches, and answers 401, not 500).
    return token.encode("utf-8", "surrogateescape")


def tenant_of(token: str) -> str:
    return "k-" + hashlib.sha256(_token_bytes(token)).hexdigest()[:16]


class Authenticator:
    """Maps a request to its tenant, raising 401 when keys are configured and it has none valid;
    guards /metrics with the metrics keys, when there are any."""

    def __init__(
        self,
        keys: frozenset[str] | dict[str, frozenset[str] | None] | None = None,
        metrics_keys: frozenset[str] | None = None,
        admin_keys: frozenset[str] | None = None,
    ) -> None:
        # Compare fixed-length digests so neither a key's length nor its position leaks through time.
        self._digests = _digests(keys)
        self._metrics_digests = _digests(metrics_keys)
        self._admin_digests = _digests(admin_keys)
        self.enabled = bool(keys)
        scopes = keys.items() if isinstance(keys, dict) else ()
        self._scopes = {tenant_of(k): s for k, s in scopes if s is not None}  # by tenant: no key kept

    def adapters_of(self, tenant: str) -> frozenset[str] | None:
        """The LoRA adapters `tenant` may run; None: every one served."""
        return self._scopes.get(tenant)

    def check_admin(self, request: web.Request) -> None:
        """401 unless the request carries an admin key (there are none: the routes are closed)."""
        token = _bearer(request)
        if not self._admin_digests or token is None or not _matches(self._admin_digests, token):
            raise ApiError(
                401,
                "This route needs an admin key: send 'Authorization: Bearer <admin key>' (--admin-keys-file).",
                code="invalid_admin_key",
            )

    def tenant(self, request: web.Request) -> str:
        token = _bearer(request) or request.headers.get("x-api-key", "").strip() or None
        if not self.enabled:
            return tenant_of(token) if token else SHARED_TENANT
        if token is None:
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                code="missing_api_key",
            )
        if not _matches(self._digests, token):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return tenant_of(token)

    def check_metrics(self, request: web.Request) -> None:
        """401 unless /metrics is open or the request carries a metrics key."""
        if not self._metrics_digests:
            return
        token = _bearer(request)
        if token is None or not _matches(self._metrics_digests, token):
            raise ApiError(
                401,
                "/metrics needs a metrics key on this server: send 'Authorization: Bearer <metrics key>'.",
                code="invalid_metrics_key",
            )


def _digests(keys) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys or ())


def _matches(digests: tuple[bytes, ...], token: str) -> bool:
    digest = hashlib.sha256(_token_bytes(token)).digest()
    found = False
    for d in digests:  # no early exit: the time does not depend on which key matched
        found |= hmac.compare_digest(d, digest)
    return found


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
