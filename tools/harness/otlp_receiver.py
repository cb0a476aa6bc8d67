"""A real OTLP/HTTP trace receiver, built on the OTLP protobuf definitions (`opentelemetry-proto`),
for the tests and `ringserve bench tracing`: `POST /v1/traces` with an `ExportTraceServiceRequest`,
answered as a collector answers. It keeps every raw body (to search for what must never be
exported) and the decoded spans; `delay_s` makes it a slow collector."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpReceiver:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.bodies: list[bytes] = []
        self.spans: list = []  # opentelemetry.proto.trace.v1.Span, with `resource` attributes dropped
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    request = ExportTraceServiceRequest.FromString(body)
                    with receiver.lock:
                        receiver.bodies.append(body)
                        for rs in request.resource_spans:
                            for ss in rs.scope_spans:
                                receiver.spans.extend(ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString() if ok else b""
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                try:
                    self.wfile.write(reply)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the exporter gave up waiting (a slow receiver): as a collector sees it

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def trace(self, trace_id: bytes, want_spans: int, timeout_s: float = 20.0) -> list:
        """The spans of `trace_id`, once at least `want_spans` of them arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if len(found) >= want_spans or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def attributes(span) -> dict:
    """A span's (or event's) attributes as plain Python values."""
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out
