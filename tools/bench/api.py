"""`ringserve bench api`: tokens per second one API worker streams to many concurrent clients.

Default (ring mode): the real worker process (`ringserve.api.worker --attach`: validation,
tokenization, ring transport, incremental detokenization, stop-string checks, SSE encoding, socket
writes) on a shared-memory ring pair, fed by `tools/bench/producer.py` in its own process (the API
tests' stand-in driven over the ring), which answers as fast as the ring takes records (one token
per running sample per step). When the worker falls
behind, several steps wait in the ring and it writes them to each client in one go, so this is
the worker's throughput under saturation. `--inproc` runs the fake GPU inside the worker's process
instead: one token per stream per write and the producer's own work counted against the worker, a
lower bound; it also reports the event loop's longest stall.

The client (this process) opens `--clients` concurrent streams on loopback and counts token events
over a measured window; meanwhile it sends ~8,000-token prompts, which the worker tokenizes in a
thread so they do not stall other streams. On a shared machine the wall-clock figure depends on
how much CPU the worker got: `tokens_per_worker_cpu_s` is what one worker does per second of its
own CPU.

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
    from ringserve.api.fake_gpu import FakeGpu, FakeStatus
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
        fake = FakeGpu(step_interval_s=0.0)
        app = init_app(config, GpuClient(fake), codec, FakeStatus(fake), model_name="bench")
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
        conn.send(
            {
                "loop_max_stall_ms": max_stall * 1000.0,
                "tokenize_8k_ms": tokenize_ms,
                "cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
                "completion_tokens_total": st.stats.get("completion_tokens_total"),
            }
        )
        await runner.cleanup()

    uvloop.run(main())


# the client -------------------------------------------------------------------------------------
async def _client(
    port: int,
    clients: int,
    warmup_s: float,
    seconds: float,
    long_text: str,
    long_every_s: float,
    stop: list[str] | None,
    mark,
) -> dict:
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


def run_inproc(
    clients: int = 64,
    seconds: float = 5.0,
    warmup_s: float = 1.0,
    long_every_s: float = 1.0,
    stop: list[str] | None = None,
) -> dict:
    """The worker and the fake GPU in one process (no shared memory)."""
    from ringserve.api.tokenizer import TextCodec
    from ringserve.tools.commands.make_tiny_model import train_tokenizer

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

        result = uvloop.run(
            _client(info["port"], clients, warmup_s, seconds, _long_prompt(codec), long_every_s, stop, parent.send)
        )
        proc.terminate()
        if not parent.poll(30):
            raise RuntimeError("the bench worker did not report")
        worker = parent.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return _report(
        "inproc",
        clients,
        stop,
        result,
        worker["cpu_s"],
        info["long_prompt_tokens"],
        worker["tokenize_8k_ms"],
        worker["loop_max_stall_ms"],
    )


def run(
    clients: int = 64,
    seconds: float = 5.0,
    warmup_s: float = 1.0,
    long_every_s: float = 1.0,
    stop: list[str] | None = None,
) -> dict:
    """The real worker process (`ringserve.api.worker --attach`) on a shared-memory ring pair,
    fed by `tools/bench/producer.py` in its own process: the worker's CPU is only the worker's work."""
    import shutil
    import socket
    import subprocess
    import tempfile
    import urllib.request

    import psutil
    import uvloop

    from ringserve.api.tokenizer import TextCodec
    from ringserve.config import Config
    from ringserve.shm import layout as L
    from ringserve.shm.instance import ShmInstance
    from ringserve.tools.commands.make_tiny_model import train_tokenizer

    tok = train_tokenizer(2048)
    codec = TextCodec(tok)
    long_text = _long_prompt(codec)
    t0 = time.perf_counter()
    long_tokens = len(codec.encode(long_text))
    tokenize_ms = (time.perf_counter() - t0) * 1000.0
    tmp = tempfile.mkdtemp(prefix="ringserve-bench-api-")
    tok.save(os.path.join(tmp, "tokenizer.json"))
    shm_dir = L.DEFAULT_DIRECTORY if os.path.isdir(L.DEFAULT_DIRECTORY) else tmp
    shm = ShmInstance.create(ring_bytes=Config().ring_bytes, n_workers=1, directory=shm_dir)
    shm.control.set_gpu_state(L.GpuState.READY)
    shm.control.set_model_facts({"block_size": Config().block_size})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fds = shm.bell_fds()
    common = ["--bell-fds", ",".join(map(str, fds)), "--shm-dir", shm_dir]
    env = {**os.environ, "RINGSERVE_CONFIG_JSON": Config(port=port, workers=1).to_json()}
    log = open(os.path.join(tmp, "worker.log"), "w")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ringserve.tools.bench.producer", "--instance", shm.instance, *common], pass_fds=fds
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ringserve.api.worker",
                "--attach",
                shm.instance,
                "--slot",
                "0",
                "--tokenizer",
                tmp,
                "--model-name",
                "bench",
                *common,
            ],
            pass_fds=fds,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        ),
    ]
    shm.control.start_worker_slot(0, procs[1].pid)  # as the supervisor does
    try:
        _wait_healthy(port, procs, urllib.request)
        worker = psutil.Process(procs[1].pid)
        cpu: dict[str, float] = {}

        def mark(name: str) -> None:
            times = worker.cpu_times()
            cpu[name] = times.user + times.system

        result = uvloop.run(_client(port, clients, warmup_s, seconds, long_text, long_every_s, stop, mark))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
        shm.close()
        shm.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
    return _report("ring", clients, stop, result, cpu["end"] - cpu["start"], long_tokens, tokenize_ms, None)


def _wait_healthy(port: int, procs, urllib_request, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("the bench worker or producer exited during start-up")
        try:
            with urllib_request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the bench worker was not ready within {timeout_s:.0f} s")


def _report(
    mode: str,
    clients: int,
    stop: list[str] | None,
    result: dict,
    cpu_s: float,
    long_tokens: int,
    tokenize_ms: float,
    stall_ms: float | None,
) -> dict:
    tps = result["events"] / result["elapsed_s"]
    # The machine may be shared (and the client runs on it too): tokens per CPU-second of the
    # worker says what one worker does with a core of its own.
    per_cpu = result["events"] / cpu_s if cpu_s > 0 else 0.0
    return {
        "tokens_per_s_per_worker": round(tps, 1),
        "goal_tokens_per_s": GOAL_TOKENS_PER_S,
        "meets_goal": tps >= GOAL_TOKENS_PER_S,
        "mode": mode,
        "clients": clients,
        "tokens_per_worker_cpu_s": round(per_cpu, 1),
        "worker_cpu_share": round(cpu_s / result["elapsed_s"], 3),
        "window_s": round(result["elapsed_s"], 3),
        "token_events": result["events"],
        "stop_strings": stop or [],
        "long_prompt_tokens": long_tokens,
        "long_prompts_sent": result["long_prompts_sent"],
        "tokenize_8k_ms": round(tokenize_ms, 2),
        "loop_max_stall_ms": None if stall_ms is None else round(stall_ms, 2),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench api", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64, help="concurrent streams (default 64)")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring (default 1)")
    p.add_argument(
        "--long-every",
        type=float,
        default=1.0,
        help="send an ~8,000-token prompt this often, seconds; 0: never (default 1)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help="a stop string every stream carries (repeatable; it should not occur)",
    )
    p.add_argument(
        "--inproc",
        action="store_true",
        help="run the fake GPU inside the worker process instead of a producer process "
        "on a shared-memory ring (also reports the event loop's longest stall)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0:
        p.error("--clients must be >= 1 and --seconds > 0")
    res = (run_inproc if args.inproc else run)(args.clients, args.seconds, args.warmup, args.long_every, args.stop)
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"api worker: {res['tokens_per_s_per_worker']:,.0f} tokens/s to {res['clients']} "
            f"streams (goal {GOAL_TOKENS_PER_S:,}: {'met' if res['meets_goal'] else 'NOT met'}), "
            f"{res['tokens_per_worker_cpu_s']:,.0f} per worker CPU-second; "
            f"an ~8k-token prompt tokenizes in {res['tokenize_8k_ms']:.1f} ms (in a thread)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
