"""A real OTLP trace receiver, built on the OTLP protobuf definitions (`opentelemetry-proto`),
for the tests and `ringserve bench tracing`: over HTTP, `POST /v1/traces` with an
`ExportTraceServiceRequest`; over gRPC (`protocol="grpc"`), the `TraceService/Export` call;
answered as a collector answers. It keeps every raw body (to search for what must never be
exported) and the decoded spans; `delay_s` makes it a slow collector."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpReceiver:
    def __init__(self, delay_s: float = 0.0, protocol: str = "http/protobuf") -> None:
        self.delay_s = delay_s
        self.protocol = protocol
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
                    receiver.keep(body)
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

        if protocol == "grpc":
            self.grpc = self._grpc_server()
            return
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _grpc_server(self):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                receiver.keep(request.SerializeToString())
                return ExportTraceServiceResponse()

        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
        # a bare host:port, as collectors are configured: the exporter must send it plaintext
        self.url = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        return server

    def keep(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            self.bodies.append(body)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)

    def __enter__(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            self.grpc.start()
        else:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.protocol == "grpc":
            self.grpc.stop(grace=None)
            return
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
