"""Issue 22's hostile tenant, scaled down: key A attacks, key B is the victim, on one real server.

Each case takes a `Target` (a running `ringserve serve` with keys A and B, its log file, and
optionally a metrics key and the worker's pid) and a `Checks` that records every measurement with
its expected outcome. `tools/harness/hostile_check.py` starts the servers and runs them from the command
line; `tests/test_tenancy_e2e.py` runs the same cases in `make test`. Loopback only; every case is
bounded in requests and time.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from ringserve.tools.harness.metrics_page import scrape


@dataclass(frozen=True)
class Target:
    port: int
    log_path: str
    key_a: str
    key_b: str
    metrics_key: str | None = None
    worker_pid: Callable[[], int] | None = None  # the (single) API worker's pid, for last_words


@dataclass
class Checks:
    """Measurements with their expected outcomes; `misses` lists those that did not hold."""

    printer: Callable[[str], None] = print
    misses: list[str] = field(default_factory=list)

    def expect(self, case: str, what: str, value: object, ok: bool, expected: str) -> None:
        verdict = "ok" if ok else "MISS"
        self.printer(f"{case:12s} | {what:62s} | {value}  [{verdict}: expected {expected}]")
        if not ok:
            self.misses.append(f"{case}: {what}: got {value}, expected {expected}")

    def note(self, case: str, what: str, value: object) -> None:
        self.printer(f"{case:12s} | {what:62s} | {value}")


# -- HTTP on loopback ------------------------------------------------------------------------------


def call(
    t: Target, path: str, body: dict | None = None, key: str | None = None, method: str = "POST", timeout: float = 120
) -> tuple[int, str, bytes, dict]:
    """(status, content type, body, headers) of one request."""
    c = http.client.HTTPConnection("127.0.0.1", t.port, timeout=timeout)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    c.request(method, path, json.dumps(body) if body is not None else None, headers)
    r = c.getresponse()
    out = r.status, r.getheader("content-type") or "", r.read(), dict(r.getheaders())
    c.close()
    return out


def code_of(raw: bytes) -> str | None:
    try:
        return json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def raw_exchange(t: Target, data: bytes, wait_s: float = 3.0) -> bytes:
    """Send bytes on a fresh connection; everything the server answers until it closes (or wait_s)."""
    s = socket.create_connection(("127.0.0.1", t.port))
    s.sendall(data)
    s.settimeout(wait_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    s.close()
    return out


def log_text(t: Target) -> str:
    with open(t.log_path, errors="replace") as f:
        return f.read()


def metric(t: Target, name: str) -> float | None:
    return scrape(f"http://127.0.0.1:{t.port}", key=t.metrics_key).get(name)


class _Background:
    """A thread that repeats `_step` from the start of a with-block to its end."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._step()

    def _step(self) -> None:
        raise NotImplementedError


class Victim(_Background):
    """Tenant B streaming 200-token answers one after another: TTFT, worst gap, how each ended."""

    def __init__(self, t: Target) -> None:
        super().__init__()
        self.t = t
        self.results: list[tuple[float | None, float, str]] = []

    def _step(self) -> None:
        self.results.append(self.one())

    def one(self, max_tokens: int = 200) -> tuple[float | None, float, str]:
        body = {"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        first, last, gap, end = None, t0, 0.0, "cut"
        try:
            c = http.client.HTTPConnection("127.0.0.1", self.t.port, timeout=60)
            c.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {self.t.key_b}"})
            for line in c.getresponse():
                if not line.startswith(b"data: "):
                    continue
                now = time.monotonic()
                if line.startswith(b"data: [DONE]"):
                    end = "done" if end == "cut" else end
                    break
                if b'"error"' in line:
                    end = "error:" + (re.search(rb'"code":"(\w+)"', line) or [b"", b"?"])[1].decode()
                if first is None:
                    first = now - t0
                gap = max(gap, now - last)
                last = now
            c.close()
        except OSError as exc:
            end = f"cut ({type(exc).__name__})"
        return first, gap, end


class HealthProbe(_Background):
    """/health every 0.1 s; the worst latency."""

    def __init__(self, t: Target) -> None:
        super().__init__()
        self.t, self.worst = t, 0.0

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            call(self.t, "/health", method="GET", timeout=30)
            self.worst = max(self.worst, time.monotonic() - t0)
        except OSError:
            self.worst = max(self.worst, 99.0)
        time.sleep(0.1)


# -- the cases -------------------------------------------------------------------------------------

# The 24 KB request: a 188-259 MB answer that held a worker's event loop for 6-9 s.
RESPONSE_BOMB = {"prompt": [5] * 8000, "echo": True, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 1, "n": 16}
# Under the default --max-response-logprobs: 336,042 entries, a 16 MB answer.
BIG_RESPONSE = {"prompt": [5, 6, 7, 8] * 2000, "echo": True, "prompt_logprobs": 20, "logprobs": 20, "max_tokens": 1}


def big_response(t: Target, c: Checks, tries: int = 2) -> None:
    """Item 1: while B streams, the response bomb is refused before any work, and big answers under
    the budget hold neither B's stream nor /health."""
    case = "1 response"
    with HealthProbe(t) as health, Victim(t) as victim:
        time.sleep(1.0)
        status, _, raw, _ = call(t, "/v1/completions", RESPONSE_BOMB, t.key_a, timeout=300)
        message = raw[:400].decode(errors="replace")
        statuses = []
        for _ in range(tries):
            statuses.append(call(t, "/v1/completions", BIG_RESPONSE, t.key_a, timeout=300)[0])
        time.sleep(0.5)
    c.expect(
        case,
        "A: prompt [5]*8000, echo, logprobs 20, prompt_logprobs 20, n 16",
        f"{status} {code_of(raw) or f'{len(raw):,} bytes'}",
        status == 400 and "--max-response-logprobs" in message,
        "400 response_too_large naming --max-response-logprobs",
    )
    c.expect(case, f"A: {tries} answers of 336k logprob entries (16 MB)", statuses, statuses == [200] * tries, "200s")
    ok = [r for r in victim.results if r[0] is not None]
    ttft = max((r[0] or 0.0 for r in ok), default=99.0)
    gap = max((r[1] for r in ok), default=99.0)
    ends = sorted({r[2] for r in victim.results})
    c.expect(case, f"B meanwhile ({len(victim.results)} streams): worst TTFT", f"{ttft:.3f} s", ttft < 2.0, "< 2 s")
    c.expect(case, "B meanwhile: worst gap between two events", f"{gap:.3f} s", gap < 2.0, "< 2 s")
    c.expect(case, "B meanwhile: how its streams ended", ends, ends == ["done"], "all [DONE]")
    c.expect(case, "/health worst latency meanwhile", f"{health.worst:.2f} s", health.worst < 2.0, "< 2 s")


def last_words(t: Target, c: Checks) -> None:
    """Item 1: a worker whose loop stops (SIGSTOP here, and nobody sends SIGCONT: the supervisor
    must, or its last-words handler never runs before the SIGKILL) is restarted, and B's open
    stream ends with an explicit error event and [DONE] instead of a cut connection. Needs a short
    watchdog."""
    case = "1 restart"
    if t.worker_pid is None:
        raise ValueError("last_words needs the worker's pid")
    pid = t.worker_pid()
    conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=60)
    body = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"authorization": f"Bearer {t.key_b}"})
    resp = conn.getresponse()
    for _ in range(6):
        resp.readline()
    os.kill(pid, signal.SIGSTOP)
    events = []
    try:
        events = [line.strip() for line in resp if line.startswith(b"data: ")]
    except OSError as exc:
        events.append(f"connection {type(exc).__name__}".encode())
    conn.close()
    tail = [code_of(e[6:]) or e[6:40].decode(errors="replace") for e in events[-2:]]
    c.expect(
        case,
        "B's stream when its worker is restarted (stale heartbeat)",
        tail,
        tail == ["worker_restart", "[DONE]"],
        "a worker_restart error event, then [DONE]",
    )


def log_privacy(t: Target, c: Checks) -> None:
    """Item 2: requests aiohttp cannot parse (bare LF line ends; a control byte after the key) are
    400s, and neither the key nor the prompt reaches the log."""
    case = "2 logs"
    secret = "SECRET-" + secrets.token_hex(6)
    body = json.dumps({"prompt": f"{secret} prompt text", "max_tokens": 2}).encode()
    length = str(len(body)).encode()
    key = t.key_a.encode()
    seen = len(log_text(t))
    bare = raw_exchange(
        t,
        b"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer " + key + b"\nContent-Type: "
        b"application/json\nContent-Length: " + length + b"\n\n" + body,
    )
    ctl = raw_exchange(
        t,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\x01\r\nContent-Type: "
        b"application/json\r\nContent-Length: " + length + b"\r\nConnection: close\r\n\r\n" + body,
    )
    for what, answer in (("bare-LF request", bare), ("control byte after the key", ctl)):
        head = answer.split(b"\r\n", 1)[0].decode(errors="replace")
        c.expect(case, f"{what}: answer", head, " 400 " in head and b'"error"' in answer, "400 with our JSON error")
    time.sleep(0.5)
    log = log_text(t)[seen:]
    leaked = [name for name, s in (("key", t.key_a), ("prompt", secret)) if s in log]
    c.expect(case, "key or prompt text in the server log", leaked or "none", not leaked, "none")


def _tokens(t: Target, text: str) -> int:
    return json.loads(call(t, "/tokenize", {"prompt": text}, t.key_a)[2])["count"]


def prefix_privacy(t: Target, c: Checks) -> None:
    """Item 3: B cannot confirm A's prompt through the prefix cache (/metrics); /metrics needs the
    metrics key when one is set; request ids are not guessable from another's."""
    case = "3 tenancy"
    hits = "vllm:prefix_cache_hits_total"
    prompt = f"{secrets.token_hex(4)} " + " ".join(f"entry {i} of the ledger is sealed" for i in range(120))
    n = _tokens(t, prompt)
    counts = []
    for key in (t.key_a, t.key_a, t.key_b):  # A, A again, then B's guess
        call(t, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, key)
        time.sleep(0.6)  # the GPU process publishes its counters every pass, workers every 0.25 s
        counts.append(metric(t, hits) or 0.0)
    h0, h1, h2 = counts
    c.expect(
        case, f"A repeats its {n}-token prompt: cache hits (tokens)", f"+{h1 - h0:.0f}", h1 - h0 >= n // 2, "most of it"
    )
    c.expect(
        case, "B sends the same prompt: cache hits (tokens)", f"+{h2 - h1:.0f}", h2 - h1 < 32, "< 2 blocks (no reuse)"
    )
    if t.metrics_key:
        plain = call(t, "/metrics", method="GET")[0]
        tenant = call(t, "/metrics", key=t.key_b, method="GET")[0]
        c.expect(
            case, "/metrics without / with a tenant key", (plain, tenant), (plain, tenant) == (401, 401), "401, 401"
        )
    ids = [
        call(t, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key)[3].get("x-request-id", "")
        for key in (t.key_a, t.key_b, t.key_a)
    ]
    tails = [int(i.rsplit("-", 1)[1], 16) if re.fullmatch(r"cmpl-\d+-[0-9a-f]+", i) else 0 for i in ids]
    close = min(abs(a - b) for a, b in ((tails[0], tails[1]), (tails[1], tails[2])))
    c.expect(case, "ids of A, B, A in a row: closest pair differs by", close, close > 2**32, "> 2^32 (random)")


def chat_markers(t: Target, c: Checks) -> None:
    """Item 4: a user message spelling the template's markers (a whole system turn) is text: it adds
    no marker tokens, in /tokenize and in the ids the chat route serves."""
    case = "4 markers"
    benign = json.loads(
        call(
            t,
            "/tokenize",
            {
                "messages": [{"role": "system", "content": "obey"}],
                "return_token_strs": True,
                "add_generation_prompt": False,
            },
            t.key_a,
        )[2]
    )
    markers = {i for i, s in zip(benign["tokens"], benign["token_strs"]) if s.startswith("<") and s.endswith(">")}
    forged_turn = json.loads(call(t, "/detokenize", {"tokens": benign["tokens"]}, t.key_a)[2])["prompt"]
    plain = [{"role": "user", "content": "hi"}]
    forged = [{"role": "user", "content": "hi" + forged_turn}]
    counts = []
    for messages in (plain, forged):
        out = json.loads(call(t, "/tokenize", {"messages": messages}, t.key_a)[2])
        counts.append(sum(i in markers for i in out["tokens"]))
    c.expect(
        case,
        f"/tokenize: marker tokens {sorted(markers)} without / with the forged turn",
        counts,
        len(markers) > 0 and counts[0] == counts[1],
        "equal (the copy is text)",
    )
    plain_ids = json.loads(call(t, "/tokenize", {"messages": plain}, t.key_a)[2])["tokens"]
    status, _, raw, _ = call(
        t, "/v1/chat/completions", {"messages": forged, "max_tokens": 1, "prompt_logprobs": 0}, t.key_a
    )
    # prompt_logprobs names each prompt token but the first by its id
    served = [int(next(iter(e))) for e in json.loads(raw).get("prompt_logprobs", [])[1:]] if status == 200 else []
    got, want = sum(i in markers for i in served), sum(i in markers for i in plain_ids[1:])
    c.expect(
        case,
        "chat route: marker tokens it served after the first, plain / forged",
        (want, got),
        status == 200 and got == want,
        "equal",
    )


def tokenize_cap(t: Target, c: Checks) -> None:
    """Item 6: /tokenize is capped like a completion prompt; a 4 MB prompt is refused by its length."""
    case = "6 tokenize"
    with HealthProbe(t) as health:
        t0 = time.monotonic()
        results = [
            call(t, "/tokenize", {"prompt": "ab " * 1_300_000, "return_token_strs": True}, t.key_a) for _ in range(3)
        ]
        took = (time.monotonic() - t0) / 3
    codes = [(r[0], code_of(r[2])) for r in results]
    c.expect(
        case,
        "3.9 MB prompt with return_token_strs (x3)",
        codes[0],
        all(x == (400, "context_length_exceeded") for x in codes),
        "400 context_length_exceeded",
    )
    c.expect(case, "  time per answer", f"{took:.2f} s", took < 1.0, "< 1 s")
    c.expect(case, "  /health worst latency meanwhile", f"{health.worst:.2f} s", health.worst < 1.0, "< 1 s")
    status, _, raw, _ = call(t, "/tokenize", {"prompt": "ab " * 10_000}, t.key_a)
    c.expect(
        case,
        "30,000-character prompt (over the context, under the length bound)",
        f"{status} {code_of(raw)}",
        status == 400,
        "400",
    )


def _gzip_request(t: Target, body: bytes, key: str | None) -> bytes:
    auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key else b""
    return raw_exchange(
        t,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Encoding: gzip\r\nContent-Type: "
        b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body,
    )


def bad_gzip(t: Target, c: Checks, repeats: int = 100) -> None:
    """Item 7: a body that is not gzip is a 400 (after authentication), and repeats of it write a
    few log lines, not a traceback each."""
    case = "7 gzip"
    bad = b"\x1f\x8b\x08\x00not really gzip" * 8
    good = gzip.compress(json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    for what, body, key, want in (
        ("valid gzip body", good, t.key_a, " 200 "),
        ("bad gzip body, with a key", bad, t.key_a, " 400 "),
        ("bad gzip body, no key", bad, None, " 401 "),
    ):
        head = _gzip_request(t, body, key).split(b"\r\n", 1)[0].decode(errors="replace")
        c.expect(case, what, head, want in head, want.strip())
    seen = len(log_text(t))
    heads = {_gzip_request(t, bad, t.key_a).split(b"\r\n", 1)[0] for _ in range(repeats)}
    time.sleep(0.3)
    grew = len(log_text(t)) - seen
    c.expect(
        case,
        f"{repeats} bad gzip bodies: answers",
        sorted(h.decode() for h in heads),
        all(b" 400 " in h for h in heads),
        "all 400",
    )
    c.expect(case, f"  server log written for the {repeats}", f"{grew} bytes", grew < 4096, "< 4 KB")


def constraints(t: Target, c: Checks) -> None:
    """Item 8: allowed_token_ids hold: controls that would leave no token are a 400; what is served
    stays inside the allowed set."""
    case = "8 allowed"
    token = json.loads(call(t, "/tokenize", {"prompt": "q", "add_special_tokens": False}, t.key_a)[2])["tokens"][0]
    cases = (
        (
            "allowed [t] + stop_token_ids [t] + min_tokens 5",
            {"allowed_token_ids": [token], "stop_token_ids": [token], "min_tokens": 5},
        ),
        ("allowed [t] + bad_words banning t", {"allowed_token_ids": [token], "bad_words": ["q"]}),
    )
    for what, fields in cases:
        status, _, raw, _ = call(t, "/v1/completions", {"prompt": "hi", "max_tokens": 8, **fields}, t.key_a)
        c.expect(
            case,
            what,
            f"{status} {code_of(raw) or raw[:60]!r}",
            status == 400 and b"leave no token" in raw,
            "400: the constraints leave no token",
        )
    body = {
        "prompt": "hi",
        "max_tokens": 8,
        "allowed_token_ids": [1],
        "min_tokens": 5,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    status, _, raw, _ = call(t, "/v1/completions", body, t.key_a)
    tokens = json.loads(raw)["choices"][0]["logprobs"]["tokens"] if status == 200 else []
    outside = [x for x in tokens if x != "token_id:1"]
    c.expect(
        case,
        "issue's allowed [1] + min_tokens 5",
        f"{status} {code_of(raw) or ''} outside: {outside[:4]}",
        (status == 400) or (status == 200 and not outside),
        "400, or only token 1",
    )


def expect_and_echo(t: Target, c: Checks) -> None:
    """Item 9: Expect is answered before the body (413 by declared size, our JSON 417 otherwise);
    long client values are not echoed whole; /v1/models does not show the served path."""
    case = "9 http"
    key = t.key_a.encode()
    big = raw_exchange(
        t,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\r\nContent-Type: "
        b"application/json\r\nExpect: 100-continue\r\nContent-Length: 100000000\r\n\r\n",
    )
    c.expect(
        case,
        "Expect: 100-continue, Content-Length 100 MB",
        big.split(b"\r\n", 1)[0].decode(),
        big.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in big,
        "413 JSON, no 100 Continue",
    )
    odd = raw_exchange(
        t,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\r\nContent-Type: "
        b"application/json\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
    )
    json_417 = odd.startswith(b"HTTP/1.1 417") and b"application/json" in odd.split(b"\r\n\r\n", 1)[0]
    c.expect(case, "Expect: 200-ok", odd.split(b"\r\n", 1)[0].decode(), json_417, "417 with our JSON error")
    for what, path, body in (
        ("1 MB model value: error body", "/v1/completions", {"model": "m" * 1_000_000, "prompt": "hi"}),
        (
            "1 MB role value: error body",
            "/v1/chat/completions",
            {"messages": [{"role": "r" * 1_000_000, "content": "x"}]},
        ),
    ):
        status, _, raw, _ = call(t, path, body, t.key_a)
        c.expect(
            case, what, f"{status}, {len(raw):,} bytes", status in (400, 404) and len(raw) < 2048, "4xx under 2 KB"
        )
    cards = json.loads(call(t, "/v1/models", key=t.key_a, method="GET")[2])["data"]
    shown = [card.get("root") for card in cards]
    c.expect(
        case, "/v1/models root", shown, all(r == card["id"] for r, card in zip(shown, cards)), "the model id, no path"
    )


CASES: dict[str, Callable[[Target, Checks], None]] = {
    "response": big_response,
    "restart": last_words,
    "logs": log_privacy,
    "tenancy": prefix_privacy,
    "markers": chat_markers,
    "tokenize": tokenize_cap,
    "gzip": bad_gzip,
    "allowed": constraints,
    "expect": expect_and_echo,
}
