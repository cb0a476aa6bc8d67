"""One adapter set for the whole fleet: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
sent to the fleet reach every replica, not the one Envoy would pick.

Envoy routes those two paths to a small HTTP server in the fleet process (loopback, a free port),
which forwards the request as it came (body and `Authorization`: each replica checks the admin key
itself) to every running replica in turn and answers once all have. The fleet keeps the resulting
set, `--lora-modules` of the serve arguments plus what was loaded minus what was unloaded, and
starts a replica it restarts with that set, so a replica that died is not left without an adapter
the others serve.

What the client gets:
* every replica gave the same status: the first replica's answer, unchanged (200 and vLLM's line;
  401, 400, 404 in the OpenAI shape);
* the others succeeded and some found the work already done (a load whose name was loaded, an
  unload whose name was gone: a retry after a partial failure): 200;
* anything else: 502 `fleet_partial`, naming each replica's status; the set still takes the change
  if any replica made it (a retry converges, by the rule above).
"""

from __future__ import annotations

import json
import shlex
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROUTES = {"/v1/load_lora_adapter": "load", "/v1/unload_lora_adapter": "unload"}
MAX_BODY_BYTES = 64 * 1024  # a name and a path
REPLICA_TIMEOUT_S = 120.0  # reading a checkpoint off the GPU process's loop: seconds at most


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    def code(self) -> str:
        try:
            return str(json.loads(self.body)["error"].get("code") or "")
        except (ValueError, KeyError, TypeError, AttributeError):
            return ""

    def done_already(self, kind: str) -> bool:
        """The work this replica was asked for had been done on it before."""
        if kind == "load":
            return self.status == 400 and b"has already been loaded" in self.body
        return self.status == 404 and self.code() == "model_not_found"


def combine(kind: str, answers: list[tuple[int, Answer]]) -> tuple[Answer, bool]:
    """(the client's answer, whether some replica made the change) from each replica's answer."""
    changed = any(a.status == 200 for _, a in answers)
    if not answers:
        return _error(503, "no replica of the fleet is running; try again when one is", "fleet_unavailable"), False
    if len({a.status for _, a in answers}) == 1:
        return answers[0][1], changed
    if all(a.status == 200 or a.done_already(kind) for _, a in answers):
        return next(a for _, a in answers if a.status == 200), changed
    each = ", ".join(f"replica {i}: {a.status}{' ' + a.code() if a.code() else ''}" for i, a in answers)
    return _error(502, f"the replicas answered differently ({each}); send the request again", "fleet_partial"), changed


def _error(status: int, message: str, code: str) -> Answer:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return Answer(status, json.dumps(body).encode(), "application/json")


class AdapterSet:
    """The fleet's adapters {name: path}; `--lora-modules` in the serve args start it."""

    def __init__(self, serve_args: list[str]) -> None:
        self.startup = _lora_modules(serve_args)
        self.lora_dir = _flag(serve_args, "--lora-dir")
        self.adapters = dict(self.startup)
        self.lock = threading.Lock()  # one change at a time, and no replica started mid-change

    def apply(self, kind: str, body: bytes) -> None:
        try:
            fields = json.loads(body)
            name = fields["lora_name"]
        except (ValueError, KeyError, TypeError):
            return
        if kind == "unload":
            self.adapters.pop(name, None)
        elif isinstance(fields.get("lora_path"), str):
            # As the replica read it: relative to its --lora-dir (it refused a path outside).
            self.adapters[name] = _join(self.lora_dir, fields["lora_path"])

    def serve_args(self) -> list[str]:
        """What a (re)started replica adds to its arguments: the last --lora-modules wins."""
        if self.adapters == self.startup:
            return []
        return ["--lora-modules=" + " ".join(f"{n}={p}" for n, p in self.adapters.items())]


def _lora_modules(args: list[str]) -> dict[str, str]:
    """--lora-modules a=p b=q (or --lora-modules=a=p): the last occurrence, as argparse reads it."""
    found: list[str] | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--lora-modules":
            found = []
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                found.append(args[i])
                i += 1
            continue
        if arg.startswith("--lora-modules="):
            found = shlex.split(arg.partition("=")[2])
        i += 1
    return dict(pair.partition("=")[::2] for pair in found or [] if pair)


def _flag(args: list[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def _join(directory: str | None, path: str) -> str:
    import os

    return os.path.realpath(os.path.join(directory or ".", path))


def forward(url: str, body: bytes, authorization: str | None) -> Answer:
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=REPLICA_TIMEOUT_S) as resp:
            return Answer(resp.status, resp.read(), resp.headers.get("Content-Type", "text/plain"))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read(), exc.headers.get("Content-Type", "application/json"))
    except OSError as exc:
        return _error(502, f"the replica did not answer: {type(exc).__name__}", "fleet_replica_unreachable")


class FanoutServer:
    """The fleet process's server for the two routes; `running()` lists (index, base URL) of the
    replicas to reach now."""

    def __init__(self, adapters: AdapterSet, running: Callable[[], Iterable[tuple[int, str]]]) -> None:
        self.adapters = adapters
        self.running = running
        fanout = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                kind = ROUTES.get(self.path.partition("?")[0])
                length = int(self.headers.get("Content-Length") or 0)
                if kind is None:
                    answer = _error(404, f"{self.path} is not a route of the fleet's adapter server", "not_found")
                elif length > MAX_BODY_BYTES:
                    answer = _error(413, f"the body is over {MAX_BODY_BYTES} bytes", "request_too_large")
                else:
                    answer = fanout.handle(kind, self.path, self.rfile.read(length), self.headers.get("Authorization"))
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

            def log_message(self, *args) -> None:  # requests carry admin keys' headers: no log
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="lora-fanout", daemon=True)

    def handle(self, kind: str, path: str, body: bytes, authorization: str | None) -> Answer:
        with self.adapters.lock:
            answers = [(i, forward(url + path, body, authorization)) for i, url in self.running()]
            answer, changed = combine(kind, answers)
            if changed:
                self.adapters.apply(kind, body)
        return answer

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
