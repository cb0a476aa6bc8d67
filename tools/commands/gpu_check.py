"""`ringserve gpu-check [--out FILE]`: everything about the CUDA path that needs a GPU, in one run.

Writes one JSON (default `bench-results/gpu-check.json`), rewritten after every section so a run cut
off still returns what ran, and prints a short table. Sections in order of importance, each in its
own process (so one's GPU memory is gone before the next starts) with a time limit inside one
budget (`--budget-s`, 450 s), so the whole run, install included, fits eight minutes on one H200:

1. `tests/gpu`: correctness first: the kernels against the float64 oracle and the torch reference
   on the device, the CUDA engine's tokens against the CPU engine's (parity); `ok` only when every
   test ran (none skipped) and passed;
2. `bench step` on the Llama-3-8B shape with random weights (`--load-format dummy`), decode steps
   eager and replayed from CUDA graphs (the start-up kernel check runs in its load);
3. kernels: decode attention bandwidth as % of the device's peak at batch 1/8/32/128 x context
   512/2k/8k, prefill-kernel TFLOP/s at 512/2k/8k tokens (Llama-3-8B heads: 32 / 8 KV, 128), and
   the Q4_1 / Q8_0 projections at Llama-3-8B's shapes beside fp16 at 1/8/32/128 rows;
4. a load test through the real server (supervisor, workers, rings) on that model;
5. transformers' own continuous batching (`generate_batch`, or `generate` where it is missing) on
   the same weights and the same request lengths, for the throughput ratio;
6. the kernels' registers and spills (NVRTC or nvcc; no GPU needed).

The device image lacks some wheels and has no network: `--prepare DIR` gathers them here (Python
3.12, manylinux; `tools/harness/gpu_check_wheels.py`) and `--wheels DIR` installs them offline first
(`tools/commands/device_check.sh` does both installs and the run). Every module the run needs is imported
before anything runs (`--dry-run` stops there); without a CUDA device it says so and exits 2; a
failed section makes it exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ringserve.tools.harness.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHAPE = "llama-3-8b"
LOAD_REQUESTS = 64
PROMPT_TOKENS = (128, 512, 1024, 2048)  # cycled over the requests
OUTPUT_TOKENS = 128
DTYPE = "bfloat16"


def _run(cmd: list[str], timeout_s: float, env: dict | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n(timed out after {timeout_s:.0f} s)", time.monotonic() - t0


def _last_json(text: str):
    """The last JSON object printed at the start of a line (bench tools print one; whatever they
    print after it, a table or a note, is not part of it)."""
    start = text.rfind("\n{")
    start = 0 if start < 0 else start + 1
    return json.JSONDecoder().raw_decode(text[start:])[0]


def environment() -> dict:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    for mod in ("cupy", "transformers", "msgspec"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if env["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        env.update(
            device=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
        )
    return env


def tests_status(rc: int, output: str) -> dict:
    """pytest's verdict, strict: ok only when it exited 0 with tests passed and none skipped (a run
    whose CUDA tests all skipped, or that collected nothing, proves nothing about the GPU)."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed|skipped)", line)), "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", last)}
    counts.setdefault("passed", 0)
    counts.setdefault("skipped", 0)
    why = None
    if rc != 0:
        why = f"pytest exited {rc}"
    elif counts["passed"] == 0:
        why = "no test passed"
    elif counts["skipped"]:
        why = f"{counts['skipped']} skipped: every GPU test must run"
    return {"status": "failed" if why else "ok", **({"why": why} if why else {}), **counts}


def gpu_tests(timeout_s: float = 200) -> dict:
    if not (REPO / "tests" / "gpu").is_dir():
        return {"status": "failed", "why": "tests/gpu not found: run gpu-check from a repository checkout"}
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rfEs", "--tb=line", "-p", "no:cacheprovider"]
    rc, out, s = _run(cmd, timeout_s)
    failures = [line[:400] for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {**tests_status(rc, out), "seconds": round(s, 1), "failures": failures[:30], "tail": out[-3000:]}


def kernels(timeout_s: float = 120) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "ringserve.tools.bench.kernels",
        "--json",
        "--skip-model",
        "--iters",
        "10",
        "--batches",
        "1,8,32,128",
        "--contexts",
        "512,2048,8192",
        "--kv-heads",
        "8",
        "--prefill-tokens",
        "512,2048,8192",
        "--quant-formats",
        "Q4_1,Q8_0",
    ]
    rc, out, s = _run(cmd, timeout_s)
    if rc != 0:
        return {"status": "failed", "seconds": round(s, 1), "tail": out[-3000:]}
    return {"status": "ok", "seconds": round(s, 1), **_last_json(out)}


def step(model_dir: str, timeout_s: float = 150) -> dict:
    out: dict = {"status": "ok"}
    for graphs in ("off", "on"):
        cmd = [
            sys.executable,
            "-m",
            "ringserve.tools.bench.step",
            "--json",
            "--device",
            "cuda",
            "--model",
            model_dir,
            "--load-format",
            "dummy",
            "--dtype",
            DTYPE,
            "--rows",
            "1,8,32",
            "--iters",
            "10",
            "--cuda-graphs",
            graphs,
        ]
        rc, text, s = _run(cmd, timeout_s / 2)
        if rc != 0:
            out["status"] = "failed"
            out[f"graphs_{graphs}"] = {"tail": text[-3000:]}
            continue
        report = _last_json(text)
        model = report["models"]["tiny"]  # "tiny" is bench step's name for the --model runner
        out[f"graphs_{graphs}"] = {r: {k: round(v, 3) for k, v in m.items()} for r, m in model.items()}
    return out


def _trace_file(tmp: str) -> str:
    path = Path(tmp) / "trace.jsonl"
    lines = [
        json.dumps({"prompt_tokens": PROMPT_TOKENS[i % len(PROMPT_TOKENS)], "output_tokens": OUTPUT_TOKENS})
        for i in range(LOAD_REQUESTS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def load_test(model_dir: str, tmp: str, timeout_s: float = 200) -> dict:
    """The server on the dummy 8B, every request of the trace sent at once (the throughput run)."""
    import urllib.request

    port = free_port()
    # The server's output goes to a file, not a pipe: nobody reads a pipe while it starts, and a
    # full one (64 KiB of start-up logs) would block it before it is ready.
    log_path = Path(tmp) / "load-server.log"
    log = log_path.open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringserve.cli",
            "serve",
            "--model",
            model_dir,
            "--load-format",
            "dummy",
            "--dtype",
            DTYPE,
            "--port",
            str(port),
            "--workers",
            "2",
            "--queue-limit-s",
            "600",
            "--max-rows",
            "64",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        deadline = started + timeout_s / 2
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                exited = server.poll() is not None
                return {
                    "status": "failed",
                    "why": f"server exited with {server.returncode} before it was ready"
                    if exited
                    else f"server not ready after {time.monotonic() - started:.0f} s",
                    "tail": log_path.read_bytes().decode(errors="replace")[-3000:],
                }
            time.sleep(1)
        vocab = "3:1000"
        cmd = [
            sys.executable,
            "-m",
            "ringserve.tools.harness.loadtest",
            "--url",
            url,
            "--json",
            "--trace",
            _trace_file(tmp),
            "--rates",
            "1000",
            "--requests",
            str(LOAD_REQUESTS),
            "--vocab",
            vocab,
            "--drain-s",
            "120",
        ]
        rc, out, s = _run(cmd, max(30.0, timeout_s - (time.monotonic() - started)))
        if rc != 0:
            return {"status": "failed", "tail": out[-3000:]}
        report = _last_json(out)
        return {"status": "ok", "seconds": round(s, 1), **report}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def hf_baseline(model_dir: str, timeout_s: float = 150) -> dict:
    rc, out, s = _run([sys.executable, "-m", "ringserve.tools.commands.gpu_check", "--hf-only", model_dir], timeout_s)
    if rc != 0:
        return {"status": "failed", "tail": out[-3000:]}
    return {"status": "ok", "seconds": round(s, 1), **_last_json(out)}


def _hf_only(model_dir: str) -> dict:
    """transformers on the same random weights (our dummy loader's, copied) and request lengths."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from ringserve.gpu_proc.model.loader import load_model
    from ringserve.tools.bench.sched_sim import prompt_ids_for

    ours = load_model(model_dir, "cuda", DTYPE, "dummy")
    state = {k: v for k, v in ours.state_dict().items()}
    del ours
    config = LlamaConfig.from_pretrained(model_dir)
    torch.set_default_dtype(getattr(torch, DTYPE))  # build in the serving dtype: no fp32 copy of 8B
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if [k for k in missing if not k.endswith("inv_freq")] or unexpected:
        raise RuntimeError(
            f"weights do not map onto transformers' Llama: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    hf.eval()
    del state
    prompts = [prompt_ids_for(i, PROMPT_TOKENS[i % len(PROMPT_TOKENS)], (3, 1000)) for i in range(LOAD_REQUESTS)]
    gen = GenerationConfig(
        max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    method, tokens, note = None, 0, None
    if hasattr(hf, "generate_batch"):
        try:
            with torch.inference_mode():
                outputs = hf.generate_batch(inputs=prompts, generation_config=gen)
            tokens = sum(len(getattr(o, "generated_tokens", []) or []) for o in outputs.values())
            method = "generate_batch (continuous batching)"
        except Exception as e:  # a version whose generate_batch wants other settings: say so, use generate
            note = f"generate_batch failed ({type(e).__name__}: {str(e)[:200]}); fell back to generate"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
    if method is None:
        method = "generate (static batches of 32, left-padded)"
        tokens = 0
        for i in range(0, len(prompts), 32):
            batch = prompts[i : i + 32]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            tokens += (out.shape[1] - width) * len(batch)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "method": method,
        "note": note,
        "requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
    }


def resources() -> dict:
    from ringserve.tools.commands import kernel_resources

    try:
        rows = kernel_resources.measure("sm_90")
    except RuntimeError as e:
        return {"status": "skipped", "why": str(e)[:300]}
    from dataclasses import asdict

    return {"status": "ok", "kernels": [asdict(r) for r in rows]}


def _table(report: dict) -> str:
    lines = [f"ringserve gpu-check: {report['env'].get('device', 'no CUDA device')}"]
    for name, sec in report["sections"].items():
        lines.append(f"  {name:<12} {sec.get('status', '?'):<8} {sec.get('why', '')}")
    k = report["sections"].get("kernels", {})
    for r in k.get("decode_attention", []):
        lines.append(
            f"    decode b{r['batch']:<4} ctx {r['ctx']:<5} {r['gbps']:>7.0f} GB/s  {r.get('pct_peak') or 0:>5.1f} % peak"
        )
    for r in k.get("prefill_attention", []):
        lines.append(
            f"    prefill {r['tokens']:<5} tokens {r['tflops']:>6.0f} TFLOP/s {r.get('pct_peak') or 0:>5.1f} % peak"
        )
    for r in k.get("quant_projection", []):
        lines.append(
            f"    {r['format']} {r['n']}x{r['k']} {r['rows']:>3} rows {r['ms']:.3f} ms, fp16 {r['fp16_ms']:.3f} ms "
            f"({r['speedup']:.2f}x), {r['block_gbps']:.0f} GB/s of blocks"
        )
    st = report["sections"].get("step", {})
    for rows in ("1", "8", "32"):
        off, on = st.get("graphs_off", {}).get(rows), st.get("graphs_on", {}).get(rows)
        if off and on:
            lines.append(
                f"    step {rows:>2} rows: forward {off['forward']:.2f} ms eager, {on['forward']:.2f} ms graphs"
            )
    lt, hf = report["sections"].get("load", {}), report["sections"].get("hf", {})
    if lt.get("rates") and hf.get("output_tok_s"):
        ours = lt["rates"][0].get("output_tok_s", 0.0)
        lines.append(
            f"    throughput: ringserve {ours:.0f} tok/s, transformers {hf['output_tok_s']:.0f} tok/s "
            f"({hf['method']}): {ours / hf['output_tok_s']:.2f}x"
        )
    return "\n".join(lines)


# Every module the GPU run imports (its sections' processes, the server's three kinds of process).
GPU_RUN_MODULES = (
    "torch",
    "cupy",
    "msgspec",
    "gguf",
    "transformers",
    "pytest",
    "hypothesis",
    "ringserve.supervisor",
    "ringserve.serve_cli",
    "ringserve.api.worker",
    "ringserve.gpu_proc.main",
    "ringserve.gpu_proc.executor",
    "ringserve.gpu_proc.cuda_graphs",
    "ringserve.gpu_proc.attention.cupy_backend",
    "ringserve.gpu_proc.attention.self_check",
    "ringserve.gpu_proc.quant_cuda",
    "ringserve.gpu_proc.lora_cuda",
    "ringserve.tools.bench.kernels",
    "ringserve.tools.bench.step",
    "ringserve.tools.harness.loadtest",
    "ringserve.tools.commands.make_dummy_model",
    "ringserve.tools.commands.kernel_resources",
)
# Sections in order of importance (correctness first), each with the seconds it may take; the
# report is rewritten after each, so a run cut off still returns the ones before.
SECTION_LIMITS = {"gpu_tests": 200, "step": 150, "kernels": 120, "load": 200, "hf": 150}
BUDGET_S = 450  # of the 8 minutes a lent H200 gives, the rest for the install and the start-up


def import_all() -> list[str]:
    """Import every module the GPU run needs; the ones that failed, with why."""
    import importlib

    failed = []
    for name in GPU_RUN_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a library that fails while loading
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return failed


def _write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out)


def _sections(report: dict, out: Path, budget_s: float) -> None:
    from ringserve.tools.commands.make_dummy_model import build_dummy_model

    sections = report["sections"]
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_dummy_model(SHAPE, Path(tmp) / SHAPE))
        runs = {
            "gpu_tests": gpu_tests,
            "step": lambda limit: step(model_dir, limit),
            "kernels": kernels,
            "load": lambda limit: load_test(model_dir, tmp, limit),
            "hf": lambda limit: hf_baseline(model_dir, limit),
        }
        for name, run in runs.items():
            left = deadline - time.monotonic()
            if left < 30:
                sections[name] = {"status": "skipped", "why": f"out of time ({budget_s:.0f} s budget)"}
            else:
                sections[name] = run(min(SECTION_LIMITS[name], left))
            _write(out, report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results/gpu-check.json", help="where to write the JSON")
    p.add_argument("--prepare", metavar="DIR", help="download the wheels the device image lacks into DIR, then exit")
    p.add_argument("--python-version", default="3.12", help="the device's Python, for --prepare (default 3.12)")
    p.add_argument("--wheels", metavar="DIR", help="install the wheels --prepare gathered, offline, first")
    p.add_argument("--dry-run", action="store_true", help="import everything the GPU run needs, then stop")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the GPU sections together")
    p.add_argument("--skip-resources", action="store_true", help="skip the register/occupancy section")
    p.add_argument("--hf-only", metavar="DIR", help=argparse.SUPPRESS)  # the transformers section's own process
    args = p.parse_args(argv)
    if args.hf_only:
        print(json.dumps(_hf_only(args.hf_only)))
        return 0
    if args.prepare:
        from ringserve.tools.harness.gpu_check_wheels import prepare

        pins = prepare(Path(args.prepare), args.python_version)
        print(f"gathered {len(pins)} wheels for Python {args.python_version} in {args.prepare}: {' '.join(pins)}")
        return 0
    if args.wheels:
        from ringserve.tools.harness.gpu_check_wheels import install

        install(Path(args.wheels))
    failed = import_all()
    if failed:
        print(
            "ringserve gpu-check: modules the GPU run needs do not import:\n  " + "\n  ".join(failed), file=sys.stderr
        )
        return 1
    print(f"ringserve gpu-check: imported the {len(GPU_RUN_MODULES)} modules the GPU run needs")
    t0 = time.monotonic()
    out = Path(args.out)
    report: dict = {"env": environment(), "sections": {}}
    sections = report["sections"]
    if not report["env"]["cuda_available"]:
        for name in SECTION_LIMITS:
            sections[name] = {"status": "skipped", "why": "no CUDA device"}
    elif not args.dry_run:
        _sections(report, out, args.budget_s)
    if not args.dry_run:
        sections["resources"] = {"status": "skipped", "why": "--skip-resources"} if args.skip_resources else resources()
    report["seconds"] = round(time.monotonic() - t0, 1)
    _write(out, report)
    print(_table(report))
    print(f"wrote {out} in {report['seconds']:.0f} s")
    if not report["env"]["cuda_available"]:
        print(
            "ringserve gpu-check: no CUDA device (torch.cuda.is_available() is False): the GPU sections did not run",
            file=sys.stderr,
        )
        return 2
    return 0 if all(s.get("status") in ("ok", "skipped") for s in sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())


def _output(proc: subprocess.Popen) -> str:
    """The end of what an exited child wrote to its stdout pipe."""
    return proc.stdout.read().decode(errors="replace")[-3000:] if proc.stdout is not None else ""
