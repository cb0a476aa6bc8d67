"""`ringserve loadtest`: metrics parsing, per-rate statistics and goodput, and runs against a real
API worker (the in-process fake GPU) and against a server that never answers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from ringserve.tools.harness import loadtest
from ringserve.tools.harness.loadtest_report import RequestRecord, goodput, summarize_rate
from ringserve.tools.harness.trace import TraceRequest
from tests.helpers.net import free_port


@pytest.fixture(scope="module")
def fake_server(tiny_model_dir):
    """An API worker with the fake GPU (echoes prompt tokens, 2 ms steps) on a free loopback port."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringserve.api.worker",
            "--fake",
            "--tokenizer",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--step-ms",
            "2",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the fake API worker did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _rec(ttft: float, gap: float, n: int = 5, status: int = 200) -> RequestRecord:
    r = RequestRecord(10, n, "k", status=status, finish_reason="length" if status == 200 else None, queue_ms=1.0)
    if status == 200:
        r.token_times = [ttft + i * gap for i in range(n)]
    return r


def test_parse_metrics_reads_ours_and_vllm_names():
    """Rows, KV use, preemptions and 429s come from ringserve's names, or vLLM's when ours are absent."""
    ours = (
        "# TYPE ringserve_running_rows gauge\nringserve_running_rows 7.0\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
        "# TYPE ringserve_preemptions counter\nringserve_preemptions_total 3.0\n"
        "# TYPE ringserve_requests_rejected counter\n"
        'ringserve_requests_rejected_total{status="400"} 5.0\nringserve_requests_rejected_total{status="429"} 2.0\n'
    )
    assert loadtest.parse_metrics(ours) == {
        "running_rows": 7.0,
        "kv_usage": 0.25,
        "preemptions": 3.0,
        "rejected_429": 2.0,
    }
    vllm = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 4.0\n'
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    )
    assert loadtest.parse_metrics(vllm) == {"running_rows": 4.0, "kv_usage": 0.5}


def test_record_latencies():
    """TTFT is the first token, TPOT the mean gap after it, max gap the longest one."""
    r = RequestRecord(1, 4, "k", status=200, finish_reason="length", token_times=[0.5, 0.6, 0.9, 1.0])
    assert r.ttft_s == 0.5 and r.tpot_s == pytest.approx(0.5 / 3) and r.max_gap_s == pytest.approx(0.3)
    assert r.meets(0.5, 0.2) and not r.meets(0.4, 0.2) and not r.meets(0.5, 0.1)
    single = RequestRecord(1, 1, "k", status=200, finish_reason="length", token_times=[0.2])
    assert single.tpot_s is None and single.meets(0.5, 0.001)


def test_summary_and_goodput():
    """Percentiles in ms, 429s counted apart, goodput is the highest rate with >= 95 % meeting both."""
    fast = [_rec(0.1, 0.02) for _ in range(20)]
    slow = [_rec(0.1, 0.02) for _ in range(17)] + [_rec(2.0, 0.02)] + [_rec(0, 0, status=429)] * 2
    kw = dict(
        ttft_target_ms=1000,
        tpot_target_ms=50,
        wall_s=10.0,
        before={"preemptions": 1.0},
        after={"preemptions": 4.0},
        samples=[{"running_rows": 2.0}, {"running_rows": 4.0, "kv_usage": 0.5}],
    )
    rows = [summarize_rate(1.0, fast, **kw), summarize_rate(2.0, slow, **kw), summarize_rate(3.0, fast, **kw)]
    assert rows[0]["ttft_ms"]["p50"] == pytest.approx(100.0) and rows[0]["tpot_ms"]["p95"] == pytest.approx(20.0)
    assert rows[1]["rejected_429"] == 2 and rows[1]["errors"] == 0 and rows[1]["attainment"] == pytest.approx(0.85)
    assert rows[0]["preemptions"] == 3.0 and rows[0]["rows_per_step_mean"] == 3.0 and rows[0]["kv_use_max"] == 0.5
    assert goodput(rows) == 3.0
    assert goodput(rows[1:2]) is None


def test_refuses_a_remote_host():
    """Loopback only unless asked: a routable address is refused with the flag to use."""
    loadtest.check_loopback("http://127.0.0.1:8000")
    loadtest.check_loopback("http://localhost:8000")
    loadtest.check_loopback("http://[::1]:8000")
    with pytest.raises(SystemExit, match="--allow-remote"):
        loadtest.check_loopback("http://10.1.2.3:8000")


def test_one_request_replays_its_output_length(fake_server):
    """A streamed request gets exactly max_tokens tokens, a finish reason and the server's queue time."""
    import aiohttp

    async def go():
        rec = RequestRecord(6, 5, "key-0")
        body = {"prompt_token_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 5, "stream": True, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            await loadtest._one(s, fake_server, body, "key-0", rec, 20)
        return rec

    rec = asyncio.run(go())
    assert rec.ok and len(rec.token_times) == 5 and rec.finish_reason == "length" and rec.queue_ms is not None


def test_cli_against_an_api_worker(fake_server, tmp_path, capsys):
    """Two rates of ten requests: every request succeeds, JSON has both rates, goodput and plots."""
    code = loadtest.main(
        [
            "--url",
            fake_server,
            "--rates",
            "20,40",
            "--requests",
            "10",
            "--scale",
            "0.01",
            "--keys",
            "3",
            "--pause-s",
            "0",
            "--drain-s",
            "20",
            "--json",
            "--plot",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rate"] for r in report["rates"]] == [20.0, 40.0]
    assert all(r["sent"] == r["ok"] == 10 for r in report["rates"])
    assert report["goodput_rps"] == 40.0
    assert all((tmp_path / name).stat().st_size > 1000 for name in ("loadtest-latency.png", "loadtest-goodput.png"))


def test_a_server_that_never_answers_ends_the_run_on_time():
    """A rate ends `--drain-s` after its last arrival; the unanswered requests count as errors."""

    async def go():
        async def hold(reader, writer):
            await asyncio.sleep(30)

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        args = loadtest.build_parser().parse_args(
            ["--url", f"http://127.0.0.1:{port}", "--requests", "3", "--drain-s", "0.5", "--sample-s", "0.1"]
        )
        import aiohttp

        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            row = await loadtest.run_rate(s, args, 50.0, [TraceRequest(4, 2)] * 3, 0)
        server.close()
        return row, time.monotonic() - t0

    row, took = asyncio.run(go())
    assert row["sent"] == 3 and row["ok"] == 0 and row["errors"] == 3
    assert took < 8
