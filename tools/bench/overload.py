"""`ringserve bench overload [--json]`: closed-loop clients far past capacity, on a real server
(issue 32; `docs/design.md#admission`).

Two workloads, each on a fresh `ringserve serve` (SmolLM2 unless `--model`), clients retrying a
429 as real ones do:

- long-prompts: `--long-clients` closed-loop clients each sending a ~1,000-token document and
  "Summary:" for 8 tokens (RAG-shaped), retrying after the Retry-After;
- chats: closed-loop streams of ~90-token chat requests (32-token answers, not streamed; their
  "TTFT" is the whole answer) retrying 0.1 s after each 429, at `--chat-streams` (default 32 and
  512), one server per level in turn, through a lean keep-alive client (`_LeanClient`: an aiohttp
  client's own CPU would take the cores the server needs on a small box).

Per workload and level it reports requests answered and refused, the refusals that carried a
Retry-After, the admitted requests' TTFT (the client's: send to first token) p50 / p95 / max, the
server's queue wait (Submit to join) p95, goodput (finished requests per second) and how long a
429 took to arrive (p50 / p99). The checks (exit status 1 when one fails): the long-prompt
clients are refused once the queue holds its limit, every refusal carries a Retry-After, the
admitted requests' TTFT beyond their own prefill (priced by the server's cost model: a prompt
that alone costs more than the limit is slow, not refused) is within the queue limit plus two
step targets at p95, 512 chat streams keep goodput at least 0.8 of 32's, and a 429 arrives
within 50 ms at p99.
Loopback only, bounded by `--duration-s` per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from ringserve.tools.bench.sched_sim import percentile
from ringserve.tools.harness.metrics_page import scrape
from ringserve.tools.harness.server_process import ChildServer, ringserve_server
from ringserve.tools.harness.sse_stream import DONE, iter_sse

GOODPUT_SHARE = 0.8  # 512 streams keep this share of 32 streams' goodput
REFUSAL_P99_MS = 50.0


@dataclass
class Level:
    workload: str
    clients: int
    duration_s: float
    finished: int = 0
    refused: int = 0
    refused_with_retry_after: int = 0
    refused_at_once: int = 0  # of the refusals, those a worker answered before reading the body (server's count)
    errors: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # of each admitted request, as ttft_ms
    own_prefill_ms: list[float] = field(default_factory=list)  # each one's prefill, priced by the server's model
    queue_ms: list[float] = field(default_factory=list)
    refusal_ms: list[float] = field(default_factory=list)
    queue_limit_s: float = 0.0
    step_target_ms: float = 0.0

    def waits_ms(self) -> list[float]:
        """Each admitted request's TTFT less its own prefill: what it waited for others' work."""
        return [t - p for t, p in zip(self.ttft_ms, self.own_prefill_ms)]

    def summary(self) -> dict:
        def pct(xs, q):
            return round(percentile(xs, q), 1) if xs else None

        return {
            "workload": self.workload,
            "clients": self.clients,
            "finished": self.finished,
            "refused": self.refused,
            "refused_with_retry_after": self.refused_with_retry_after,
            "refused_at_once": self.refused_at_once,
            "errors": self.errors,
            "goodput_rps": round(self.finished / self.duration_s, 3),
            "ttft_p50_ms": pct(self.ttft_ms, 50),
            "ttft_p95_ms": pct(self.ttft_ms, 95),
            "ttft_max_ms": round(max(self.ttft_ms), 1) if self.ttft_ms else None,
            "queue_p95_ms": pct(self.queue_ms, 95),
            "ttft_beyond_own_prefill_p95_ms": pct(self.waits_ms(), 95),
            "refusal_p50_ms": pct(self.refusal_ms, 50),
            "refusal_p99_ms": pct(self.refusal_ms, 99),
        }


def document(i: int, words: int) -> str:
    body = " ".join(f"entry{(i * 31 + k * 7) % 997} holds {(k * 13) % 89}" for k in range(words))
    return f"Report {i}. {body}\nSummary:"


async def _one(s: aiohttp.ClientSession, url: str, path: str, body: dict, level: Level) -> float | None:
    """One streamed request; the seconds to wait before the next (a refusal's), or None when answered."""
    t0 = time.perf_counter()
    try:
        async with s.post(f"{url}{path}", json=body | {"stream": True}) as resp:
            if resp.status == 429:
                level.refusal_ms.append((time.perf_counter() - t0) * 1000)
                level.refused += 1
                retry = resp.headers.get("Retry-After")
                level.refused_with_retry_after += retry is not None
                await resp.read()
                return float(retry) if retry is not None else 1.0
            if resp.status != 200:
                level.errors += 1
                await resp.read()
                return 1.0
            first, prompt = None, 0
            async for ev in iter_sse(resp):
                if ev == DONE:
                    continue
                if first is None and ev.get("choices"):
                    first = time.perf_counter()
                if ev.get("timing"):
                    level.queue_ms.append(ev["timing"].get("queue_ms", 0.0))
                if ev.get("usage"):
                    prompt = ev["usage"].get("prompt_tokens", 0)
            if first is not None:
                level.ttft_ms.append((first - t0) * 1000)
                level.prompt_tokens.append(prompt)
            level.finished += 1
            return None
    except (TimeoutError, aiohttp.ClientError):
        level.errors += 1
        return 1.0


class _LeanClient:
    """A keep-alive HTTP/1.1 client of one connection, for the chat storm: with hundreds of
    streams retrying every 0.1 s on a 2-core box, an aiohttp client's own CPU would take the cores
    the server's worker and GPU process need, and measure the client. Non-streamed requests,
    a status line, headers and a Content-Length body; reconnects when the server closes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        for attempt in range(2):
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            try:
                self.writer.write(head + body)
                status_line = await self.reader.readline()  # type: ignore[union-attr]
                if not status_line:
                    raise ConnectionResetError("closed")
                headers: dict[str, str] = {}
                while (line := await self.reader.readline()) not in (b"\r\n", b""):  # type: ignore[union-attr]
                    k, _, v = line.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                data = await self.reader.readexactly(int(headers.get("content-length", 0)))  # type: ignore[union-attr]
                if headers.get("connection", "").lower() == "close":
                    self.close()
                return int(status_line.split()[1]), headers, data
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def chat_body(i: int, k: int) -> dict:
    """Stream `i`'s `k`-th chat: ~90 prompt tokens of its own, a 32-token answer."""
    text = f"Conversation {i}-{k}. " + " ".join(f"note{(i + k * 7 + j) % 101}" for j in range(30))
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 32, "temperature": 0.7}


async def _lean_chats(url: str, level: Level, retry_s: float) -> None:
    """The chat storm through `_LeanClient`s: each stream's next request when the last ends, or
    `retry_s` after a refusal. Admitted requests' latency is their whole answer (not streamed)."""
    host, port = url.removeprefix("http://").split(":")
    stop_at = time.monotonic() + level.duration_s

    async def stream(i: int) -> None:
        c = _LeanClient(host, int(port))
        k = 0
        try:
            while time.monotonic() < stop_at:
                k += 1
                body = chat_body(i, k)
                t0 = time.perf_counter()
                try:
                    status, headers, _ = await c.post("/v1/chat/completions", json.dumps(body).encode())
                except (ConnectionError, asyncio.IncompleteReadError, OSError):
                    level.errors += 1
                    await asyncio.sleep(1.0)
                    continue
                ms = (time.perf_counter() - t0) * 1000
                if status == 200:
                    level.finished += 1
                    level.ttft_ms.append(ms)
                    level.own_prefill_ms.append(0.0)
                elif status == 429:
                    level.refused += 1
                    level.refused_with_retry_after += "retry-after" in headers
                    level.refusal_ms.append(ms)
                    await asyncio.sleep(retry_s)
                else:
                    level.errors += 1
                    await asyncio.sleep(1.0)
        finally:
            c.close()

    tasks = [asyncio.create_task(stream(i)) for i in range(level.clients)]
    await asyncio.sleep(level.duration_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drive(url: str, level: Level, retry_s: float | None) -> None:
    """`level.clients` closed-loop clients for `level.duration_s`: each sends its next request when
    the last one ends, after the refusal's Retry-After (or `retry_s`, when given)."""
    stop_at = time.monotonic() + level.duration_s

    async def client(s: aiohttp.ClientSession, i: int) -> None:
        k = 0
        while time.monotonic() < stop_at:
            k += 1
            if level.workload == "long-prompts":
                path, body = "/v1/completions", {"prompt": document(i * 1000 + k, 110), "max_tokens": 8}
            else:
                path, body = "/v1/chat/completions", chat_body(i, k)
            wait = await _one(s, url, path, body, level)
            if wait is not None:
                await asyncio.sleep(min(retry_s if retry_s is not None else wait, max(stop_at - time.monotonic(), 0)))

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        tasks = [asyncio.create_task(client(s, i)) for i in range(level.clients)]
        await asyncio.sleep(level.duration_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _serve(args, work: Path) -> ChildServer:
    model = ["--model", args.model] if args.model else []
    return ringserve_server(work, model + args.server_args.split(), args.ready_timeout_s, python=args.server_python)


def run_level(args, work: Path, workload: str, clients: int, retry_s: float | None) -> Level:
    child = _serve(args, work)
    url = child.ready_url.rsplit("/", 1)[0]
    level = Level(workload, clients, args.duration_s)
    try:
        m = scrape(url)
        level.step_target_ms = m.get("ringserve_step_target_ms", 0.0)
        if level.workload == "chats" and retry_s is not None:
            asyncio.run(_lean_chats(url, level, retry_s))
        else:
            asyncio.run(_drive(url, level, retry_s))
        m = scrape(url)
        level.refused_at_once = int(m.get("ringserve_requests_refused_at_once_total", 0))
        token, read = m.get("ringserve_cost_token_ms", 0.0), m.get("ringserve_cost_read_us", 0.0) / 1000
        level.own_prefill_ms = [p * token + read * p * (p + 1) / 2 for p in level.prompt_tokens]
    finally:
        child.stop()
    level.queue_limit_s = args.queue_limit_s
    return level


def checks(levels: list[Level]) -> list[tuple[str, bool]]:
    out = []
    for lv in levels:
        s = lv.summary()
        if lv.workload == "long-prompts":
            bound = lv.queue_limit_s * 1000 + 2 * lv.step_target_ms
            out.append((f"long prompts refused once the queue is full ({lv.refused} refused)", lv.refused > 0))
            wait = s["ttft_beyond_own_prefill_p95_ms"]
            out.append(
                (
                    f"admitted TTFT beyond its own prefill p95 {wait} ms <= limit + 2 step targets ({bound:.0f} ms)",
                    wait is not None and wait <= bound,
                )
            )
        if lv.refused:
            out.append(
                (
                    f"{lv.workload} x{lv.clients}: every 429 has a Retry-After",
                    lv.refused_with_retry_after == lv.refused,
                )
            )
            out.append(
                (
                    f"{lv.workload} x{lv.clients}: 429 p99 {s['refusal_p99_ms']} ms < {REFUSAL_P99_MS:.0f} ms",
                    s["refusal_p99_ms"] < REFUSAL_P99_MS,
                )
            )
    chats = {lv.clients: lv for lv in levels if lv.workload == "chats"}
    if len(chats) >= 2:
        lo, hi = chats[min(chats)], chats[max(chats)]
        ratio = (hi.finished / hi.duration_s) / max(lo.finished / lo.duration_s, 1e-9)
        out.append(
            (
                f"chats: goodput at {hi.clients} streams {ratio:.2f} of {lo.clients}'s >= {GOODPUT_SHARE}",
                ratio >= GOODPUT_SHARE,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench overload", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model to serve (default: the server's, SmolLM2)")
    p.add_argument("--server-args", default="", help="more server flags")
    p.add_argument("--server-python", help="the interpreter that runs the server (another checkout's venv)")
    p.add_argument("--workload", action="append", choices=["long-prompts", "chats"], help="default: both")
    p.add_argument("--long-clients", type=int, default=12)
    p.add_argument("--chat-streams", type=int, action="append", help="default: 32 and 512")
    p.add_argument("--duration-s", type=float, default=60.0, help="per level")
    p.add_argument("--queue-limit-s", type=float, default=2.0, help="the server's (for the check)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    workloads = args.workload or ["long-prompts", "chats"]
    levels: list[Level] = []
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as work:
        for workload in workloads:
            plan: list[tuple[int, float | None]]
            if workload == "long-prompts":
                plan = [(args.long_clients, None)]
            else:
                plan = [(n, 0.1) for n in (args.chat_streams or [32, 512])]
            for clients, retry_s in plan:
                level = run_level(args, Path(work), workload, clients, retry_s)
                levels.append(level)
                if not args.json:
                    print(json.dumps(level.summary()), flush=True)
    verdicts = checks(levels)
    if args.json:
        print(
            json.dumps(
                {"levels": [lv.summary() for lv in levels], "checks": verdicts, "raw": [asdict(lv) for lv in levels]},
                indent=1,
            )
        )
    else:
        for text, ok in verdicts:
            print(f"{'ok  ' if ok else 'FAIL'} {text}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
