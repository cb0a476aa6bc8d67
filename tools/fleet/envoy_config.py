"""The Envoy configuration in front of a fleet of ringserve replicas (docs/design.md#fleet).

`envoy_config(FleetSpec)` returns the bootstrap as a dict (`to_yaml` renders it); `ringserve fleet`
runs Envoy on it and `ringserve fleet --print-config` prints it for use elsewhere. Everything the
fleet needs is one of Envoy's own mechanisms, nothing hand-rolled:

* routing by load: least-request with power-of-two choices (the default: it balanced better on the
  trace, see the design doc), or client-side weighted round robin fed by the ORCA
  `endpoint-load-metrics` header each replica sends (`api/orca_report.py`);
* health: active checks on `/ready` (fails while the GPU process restarts or the replica drains),
  outlier detection on consecutive 5xx and connect failures, a hung GPU seen through the
  replica's watchdog; no panic routing, so dead replicas never get traffic because few are left;
* retries only for what has not started: connect failures, resets before the response began,
  503 and 429 from a replica that is full, restarting or draining, on another replica, under a
  retry budget (a share of the active requests). Envoy never retries once response headers went
  downstream, and a replica sends its headers at admission: what fails after that is the
  replica's to answer (hold and resubmit before the first token, an error event after it);
* streaming untouched: no buffering filter, a route timeout that fits the longest answer, client
  disconnects passed upstream (the replica cancels the row at the next step);
* Envoy's own answers in ringserve's OpenAI-style error object, each saying what happened: a
  request it cannot read (400 `invalid_http_request`, 413, 408: the client's to fix, never
  retried), a replica that did not answer in time (504 `fleet_timeout`), no ready replica (503
  `fleet_unavailable`); the 5xx with a Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass

LB_POLICIES = ("least_request", "orca")
CLUSTER = "ringserve"
LORA_CLUSTER = "ringserve_lora_fanout"
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ORCA_HEADER = "endpoint-load-metrics"
REPLICA_HEADER = "x-ringserve-replica"  # host:port of the replica that answered


@dataclass(frozen=True)
class FleetSpec:
    """What the Envoy config is generated from. Durations are seconds."""

    endpoints: tuple[tuple[str, int], ...]  # (host, port) of each replica
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9901
    lb_policy: str = "least_request"
    # The replica's request deadline (Config.request_timeout_s): a 1,000-token answer at 25 tokens/s
    # takes 40 s, the deadline is 600 s; the route allows that plus a margin.
    request_timeout_s: float = 600.0
    # No byte for this long on a stream (queue wait + first token, or between tokens) ends it; a
    # replica's slow-reader limit is 30 s, and its queue limit 2 s of work.
    stream_idle_timeout_s: float = 60.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    consecutive_5xx: int = 3
    ejection_s: float = 5.0
    retries: int = 2  # per request, each on another replica
    retry_budget_percent: float = 10.0  # of active requests (the design's 10 %)
    min_retry_concurrency: int = 3
    # The replica closes idle keep-alive connections after 15 s (Config.keepalive_timeout_s):
    # Envoy closes its own first, so it never sends a request on a connection being closed.
    upstream_idle_timeout_s: float = 10.0
    max_body_bytes: int = 4 * 1024 * 1024  # a replica's body limit: every body fits the retry buffer
    retry_after_s: int = 1  # on Envoy's own 503s: one health-check interval
    # The fleet process's server that sends adapter loads and unloads to every replica
    # (tools/fleet/lora_fanout.py); None (a config for replicas elsewhere): one replica gets them.
    lora_fanout: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("a fleet needs at least one replica endpoint")
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(f"lb_policy must be one of {', '.join(LB_POLICIES)}, got {self.lb_policy!r}")


def _s(seconds: float) -> str:
    """A protobuf Duration in Envoy's YAML spelling."""
    return f"{seconds:g}s"


def _typed(type_name: str, **fields) -> dict:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def lb_policy(spec: FleetSpec) -> dict:
    """The cluster's balancing fields."""
    if spec.lb_policy == "least_request":
        # NOTE: the cluster's own LEAST_REQUEST, not the typed least_request extension: in Envoy
        # 1.40 the extension, configured the same way, sent 5 of 6 concurrent streams to one of
        # three idle replicas (it did not see the open requests); this one spreads them.
        return {"lb_policy": "LEAST_REQUEST", "least_request_lb_config": {"choice_count": 2}}
    cswrr = _typed(
        "envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin",
        # Weights from each response's header (in-band), recomputed twice a second; a replica's
        # first reports count after 2 s, and weights older than 30 s are dropped.
        blackout_period=_s(2),
        weight_update_period=_s(0.5),
        weight_expiration_period=_s(30),
        error_utilization_penalty=1.0,
    )
    extension = {"name": "envoy.load_balancing_policies.client_side_weighted_round_robin", "typed_config": cswrr}
    return {"load_balancing_policy": {"policies": [{"typed_extension_config": extension}]}}


def retry_policy(spec: FleetSpec) -> dict:
    """Retry only what has not started, each try on a replica not tried yet."""
    return {
        # connect-failure: the replica is gone; reset: it closed the connection before any
        # response header (killed mid-admission); refused-stream: HTTP/2 refusal;
        # retriable-status-codes: 503 (restarting, draining, not ready) and 429 (full).
        "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes",
        "retriable_status_codes": [503, 429],
        "num_retries": spec.retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": _typed("envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"),
            }
        ],
        "host_selection_retry_max_attempts": 5,
        # A retry holds its place in the budget while it backs off: at Envoy's 25 ms default a
        # full survivor's instant 429s reused each place so fast that the budget hardly bit.
        "retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"},
    }


def _cancel_route(spec: FleetSpec) -> dict:
    """`DELETE /v1/requests/{id}` must reach the replica that holds the request, which the proxy
    does not know: a replica without it answers 404, so the DELETE is retried on every other one."""
    return {
        "match": {"prefix": "/v1/requests/", "headers": [{"name": ":method", "string_match": {"exact": "DELETE"}}]},
        "route": {
            "cluster": CLUSTER,
            "timeout": _s(10),
            "retry_policy": {
                "retry_on": "connect-failure,reset,retriable-status-codes",
                "retriable_status_codes": [404, 503],
                "num_retries": max(1, len(spec.endpoints) - 1),
                "retry_host_predicate": retry_policy(spec)["retry_host_predicate"],
                "host_selection_retry_max_attempts": 5 * len(spec.endpoints),
            },
        },
    }


def _lora_routes(spec: FleetSpec) -> list[dict]:
    """The adapter routes go to the fleet's fan-out server, which waits for every replica: no
    retries (a load is not idempotent), the time of a checkpoint read per replica."""
    if spec.lora_fanout is None:
        return []
    return [
        {"match": {"path": path}, "route": {"cluster": LORA_CLUSTER, "timeout": _s(150 * len(spec.endpoints))}}
        for path in LORA_PATHS
    ]


def _lora_cluster(spec: FleetSpec) -> list[dict]:
    if spec.lora_fanout is None:
        return []
    host, port = spec.lora_fanout
    return [
        {
            "name": LORA_CLUSTER,
            "type": "STATIC",
            "connect_timeout": _s(1),
            "load_assignment": {
                "cluster_name": LORA_CLUSTER,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                        ]
                    }
                ],
            },
        }
    ]


def _status_filter(low: int, high: int) -> dict:
    """An access-log filter matching Envoy's own replies with a status in [low, high]."""

    def compare(op: str, value: int) -> dict:
        key = f"ringserve.local_{op.lower()}_{value}"
        return {"status_code_filter": {"comparison": {"op": op, "value": {"default_value": value, "runtime_key": key}}}}

    if low == high:
        return compare("EQ", low)
    return {"and_filter": {"filters": [compare("GE", low), compare("LE", high)]}}


def _error_body(message: str, type_: str, code: str) -> dict:
    """ringserve's OpenAI-style error object, with what Envoy says and its response flags."""
    return {
        "json_format": {
            "error": {
                "message": message,
                "type": type_,
                "param": None,
                "code": code,
                "envoy_response_flags": "%RESPONSE_FLAGS%",
            }
        },
        "content_type": "application/json",
    }


def _local_reply_config(spec: FleetSpec) -> dict:
    """Envoy's own error responses in ringserve's error shape, each saying what happened: a request
    Envoy cannot take is the client's (4xx, never retried); a timeout waiting for a replica, and no
    replica to take it (5xx, with a Retry-After), are the fleet's."""
    mine = "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
    retry_after = [
        {
            "header": {"key": "Retry-After", "value": str(spec.retry_after_s)},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
    ]
    return {
        "mappers": [
            {
                "filter": _status_filter(413, 413),
                "body_format_override": _error_body(
                    f"The request is larger than the fleet's proxy takes ({spec.max_body_bytes} bytes): {mine}.",
                    "invalid_request_error",
                    "request_too_large",
                ),
            },
            {
                "filter": _status_filter(408, 408),
                "body_format_override": _error_body(
                    f"The request did not arrive in time at the fleet's proxy: {mine}.",
                    "invalid_request_error",
                    "request_timeout",
                ),
            },
            {
                "filter": _status_filter(400, 499),
                "body_format_override": _error_body(
                    f"The fleet's proxy could not read the request, so no replica saw it: {mine}. Fix the request.",
                    "invalid_request_error",
                    "invalid_http_request",
                ),
            },
            {
                "filter": _status_filter(504, 504),
                "headers_to_add": retry_after,
                "body_format_override": _error_body(
                    f"A replica took the request but did not answer within the fleet's timeouts: {mine}; the "
                    "replica has cancelled it.",
                    "service_unavailable",
                    "fleet_timeout",
                ),
            },
            {"filter": _status_filter(500, 599), "headers_to_add": retry_after},
        ],
        "body_format": _error_body(
            "The fleet's proxy could not reach a ready replica: %LOCAL_REPLY_BODY%",
            "service_unavailable",
            "fleet_unavailable",
        ),
    }


def _listener(spec: FleetSpec) -> dict:
    hcm = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=CLUSTER,
        codec_type="AUTO",
        # A replica names its requests (cmpl-<worker>-...) unless the client chose an id; a UUID
        # from Envoy would replace the replica's own.
        generate_request_id=False,
        preserve_external_request_id=True,
        stream_idle_timeout=_s(spec.stream_idle_timeout_s),
        request_headers_timeout=_s(10),
        common_http_protocol_options={"idle_timeout": _s(15)},
        route_config={
            "name": CLUSTER,
            "virtual_hosts": [
                {
                    "name": CLUSTER,
                    "domains": ["*"],
                    "routes": [
                        _cancel_route(spec),
                        *_lora_routes(spec),
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": CLUSTER,
                                "timeout": _s(spec.request_timeout_s + 10),
                                "idle_timeout": _s(spec.stream_idle_timeout_s),
                                "retry_policy": retry_policy(spec),
                            },
                        },
                    ],
                }
            ],
            # The load report is for Envoy's balancer, not for clients; which replica answered is
            # for them (and for whoever reads a log line about a request).
            "response_headers_to_remove": [ORCA_HEADER],
            "response_headers_to_add": [
                {
                    "header": {"key": REPLICA_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        },
        local_reply_config=_local_reply_config(spec),
        http_filters=[
            {
                "name": "envoy.filters.http.router",
                "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
            }
        ],
    )
    return {
        "name": CLUSTER,
        "address": {"socket_address": {"address": spec.listen_host, "port_value": spec.listen_port}},
        # A retried request is replayed from Envoy's buffer: every legal body must fit in it.
        "per_connection_buffer_limit_bytes": spec.max_body_bytes,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def _cluster(spec: FleetSpec) -> dict:
    return {
        "name": CLUSTER,
        "type": "STATIC",
        "connect_timeout": _s(1),
        "per_connection_buffer_limit_bytes": spec.max_body_bytes,
        **lb_policy(spec),
        # Never route to replicas known to be down, however few are left (the default panics
        # below 50 % healthy and spreads over all of them, dead ones included).
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {
            "cluster_name": CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                        for host, port in spec.endpoints
                    ]
                }
            ],
        },
        "health_checks": [
            {
                "timeout": _s(spec.health_timeout_s),
                "interval": _s(spec.health_interval_s),
                "no_traffic_interval": _s(spec.health_interval_s),
                "unhealthy_threshold": spec.unhealthy_threshold,
                "healthy_threshold": spec.healthy_threshold,
                "http_health_check": {"path": "/ready"},
            }
        ],
        "outlier_detection": {
            "consecutive_5xx": spec.consecutive_5xx,
            "consecutive_gateway_failure": spec.consecutive_5xx,
            "interval": _s(1),
            "base_ejection_time": _s(spec.ejection_s),
            "max_ejection_time": _s(spec.ejection_s * 6),
            "max_ejection_percent": 100,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    # A replica bounds its own work (429 above its queue limit); Envoy's defaults
                    # (1,024) would cap a large fleet's open streams below what it can serve.
                    "max_connections": 100000,
                    "max_pending_requests": 100000,
                    "max_requests": 100000,
                    "retry_budget": {
                        "budget_percent": {"value": spec.retry_budget_percent},
                        "min_retry_concurrency": spec.min_retry_concurrency,
                    },
                }
            ]
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                common_http_protocol_options={"idle_timeout": _s(spec.upstream_idle_timeout_s)},
                explicit_http_config={"http_protocol_options": {}},
            )
        },
    }


def envoy_config(spec: FleetSpec) -> dict:
    """The Envoy bootstrap for `spec`."""
    return {
        "admin": {"address": {"socket_address": {"address": spec.admin_host, "port_value": spec.admin_port}}},
        "static_resources": {"listeners": [_listener(spec)], "clusters": [_cluster(spec), *_lora_cluster(spec)]},
    }


def to_yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
