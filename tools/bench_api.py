"""`ringserve bench api`: tokens per second one API worker streams to many concurrent clients.

The worker process runs the real app (validation, tokenization, GPU client, incremental
detokenization, stop-string checks, SSE encoding and socket writes) against the in-process fake
GPU as a producer that never waits (`step_interval_s=0`: one token per open sample every event-loop
pass, msgpack round-trip included, as from the ring). A separate client process opens `--clients`
concurrent streams on loopback and counts token events over a measured window. The producer's own
work runs in the worker's process, so the figure is a lower bound on what a worker fed by a real
GPU process achieves. While streaming, the client also sends long prompts (~8,000 tokens): the
worker reports its tokenization time and the event loop's longest stall, which shows whether a
long prompt holds up everyone else's stream.

Goal (issue 5): >= 20,000 tokens/s per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import sys
import time

GOAL_TOKENS_PER_S = 20_000
_PROMPT = "The quick brown fox jumps over the lazy dog, and then it streams many tokens. "


def _long_prompt(codec, target_tokens: int = 8000) -> str:
    unit = "Serving systems batch requests so the accelerator stays busy while streams flow. "
    per = len(codec.encode(unit)) - 1
    return unit * max(1, (target_tokens - 1) // per)


# the worker process ------------------------------------------------------------------------------
def _worker_main(tokenizer_json: str, conn, stop_strings: bool) -> None:
    import uvloop
    from aiohttp import web
    from tokenizers import Tokenizer

    from ringserve.api.app import init_app
    from ringserve.api.fake_gpu import FakeGpu
    from ringserve.api.gpu_client import GpuClient
    from ringserve.api.state import STATE
    from ringserve.api.tokenizer import TextCodec
    from ringserve.config import Config

    codec = TextCodec(Tokenizer.from_str(tokenizer_json))
    long_text = _long_prompt(codec)
    t0 = time.perf_counter()
    long_ids = codec.encode(long_text)
    tokenize_ms = (time.perf_counter() - t0) * 1000.0

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        config = Config(context_limit=16384, max_tokens_limit=1000)
        app = init_app(config, GpuClient(FakeGpu(step_interval_s=0.0)), codec, model_name="bench",
                       ready=lambda: True)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        conn.send({"port": port, "long_prompt_tokens": len(long_ids)})
        max_stall = 0.0
        tick = 0.002
        cpu = {}
        while not stop.is_set():  # the event loop's lateness: how long any one callback held it
            t = loop.time()
            await asyncio.sleep(tick)
            if "end" not in cpu:
                max_stall = max(max_stall, loop.time() - t - tick)
            if conn.poll():
                mark = conn.recv()  # "start" / "end" of the measured window
                cpu[mark] = time.process_time()
                if mark == "start":
                    max_stall = 0.0
        st = app[STATE]
        conn.send({"loop_max_stall_ms": max_stall * 1000.0, "tokenize_8k_ms": tokenize_ms,
                   "cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
                   "completion_tokens_total": st.stats.get("completion_tokens_total")})
        await runner.cleanup()

    uvloop.run(main())


# the client -------------------------------------------------------------------------------------
async def _client(port: int, clients: int, warmup_s: float, seconds: float, long_text: str,
                  long_every_s: float, stop: list[str] | None, mark) -> dict:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": _PROMPT, "max_tokens": 1000, "stream": True, "temperature": 0}
    if stop:
        body["stop"] = stop
    counted = {"events": 0, "streams_done": 0}
    window = {"on": False}
    end_at = time.perf_counter() + warmup_s + seconds

    async def one_stream(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < end_at:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"bench request failed: {resp.status} {await resp.text()}")
                async for chunk in resp.content.iter_any():
                    if window["on"]:
                        counted["events"] += chunk.count(b'"token_id"')
                    if time.perf_counter() >= end_at:
                        return
            counted["streams_done"] += 1

    async def long_prompts(session: aiohttp.ClientSession) -> int:
        sent = 0
        while time.perf_counter() < end_at - long_every_s:
            await asyncio.sleep(long_every_s)
            async with session.post(url, json={"prompt": long_text, "max_tokens": 1}) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"long prompt failed: {resp.status} {await resp.text()}")
                await resp.read()
                sent += 1
        return sent

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(one_stream(session)) for _ in range(clients)]
        longs = asyncio.create_task(long_prompts(session)) if long_every_s > 0 else None
        await asyncio.sleep(warmup_s)
        mark("start")
        window["on"] = True
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        window["on"] = False
        elapsed = time.perf_counter() - t0
        mark("end")
        events = counted["events"]
        await asyncio.gather(*tasks)
        long_sent = await longs if longs is not None else 0
    return {"events": events, "elapsed_s": elapsed, "long_prompts_sent": long_sent}


def run(clients: int = 64, seconds: float = 5.0, warmup_s: float = 1.0, long_every_s: float = 1.0,
        stop: list[str] | None = None) -> dict:
    from ringserve.api.tokenizer import TextCodec
    from ringserve.tools.make_tiny_model import train_tokenizer

    tok = train_tokenizer(2048)
    codec = TextCodec(tok)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(tok.to_str(), child, bool(stop)), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("the bench worker did not start within 60 s")
        info = parent.recv()
        import uvloop
        result = uvloop.run(_client(info["port"], clients, warmup_s, seconds, _long_prompt(codec),
                                    long_every_s, stop, parent.send))
        os.kill(proc.pid, signal.SIGTERM)
        if not parent.poll(30):
            raise RuntimeError("the bench worker did not report")
        worker = parent.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    tps = result["events"] / result["elapsed_s"]
    # The machine may be shared (and the client runs on it too): tokens per CPU-second of the
    # worker says what one worker does with a core of its own.
    per_cpu = result["events"] / worker["cpu_s"] if worker["cpu_s"] > 0 else 0.0
    return {"tokens_per_s_per_worker": round(tps, 1), "goal_tokens_per_s": GOAL_TOKENS_PER_S,
            "meets_goal": tps >= GOAL_TOKENS_PER_S, "clients": clients,
            "tokens_per_worker_cpu_s": round(per_cpu, 1),
            "worker_cpu_share": round(worker["cpu_s"] / result["elapsed_s"], 3),
            "window_s": round(result["elapsed_s"], 3), "token_events": result["events"],
            "stop_strings": stop or [], "long_prompt_tokens": info["long_prompt_tokens"],
            "long_prompts_sent": result["long_prompts_sent"],
            "tokenize_8k_ms": round(worker["tokenize_8k_ms"], 2),
            "loop_max_stall_ms": round(worker["loop_max_stall_ms"], 2),
            "cpu_count": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench api", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64, help="concurrent streams (default 64)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring (default 1)")
    p.add_argument("--long-every", type=float, default=1.0,
                   help="send an ~8,000-token prompt this often, seconds; 0: never (default 1)")
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string every stream carries (repeatable; it should not occur)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    res = run(args.clients, args.seconds, args.warmup, args.long_every, args.stop)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"api worker: {res['tokens_per_s_per_worker']:,.0f} tokens/s to {res['clients']} "
              f"streams (goal {GOAL_TOKENS_PER_S:,}: {'met' if res['meets_goal'] else 'NOT met'}), "
              f"{res['tokens_per_worker_cpu_s']:,.0f} per worker CPU-second; "
              f"8k-token prompt tokenizes in {res['tokenize_8k_ms']:.1f} ms, longest event-loop "
              f"stall {res['loop_max_stall_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
