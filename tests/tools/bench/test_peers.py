"""`ringserve bench peers`: the closed-loop client, its figures and checks, against a real ringserve."""

from __future__ import annotations

import json
import math

from ringserve.tools.bench import peers as bench_peers
from ringserve.tools.bench.peer_servers import find_llama_server, probe_vllm, vllm_settings
from ringserve.tools.bench.peer_workloads import copy_prompts, flops_per_token, text_prompts
from ringserve.tools.bench.peers import Answer, agreement, failures, palindrome, summarize


def test_summary_counts_tokens_and_flags_short_answers():
    """tok/s is completion tokens over wall time; an answer of the wrong length is counted."""
    good = Answer(status=200, times=[0.1, 0.2, 0.3, 0.4], tokens=4)
    short = Answer(status=200, times=[0.1, 0.3], tokens=2)
    failed = Answer(status=429, error="queue full")
    s = summarize([good, short, failed], wall_s=2.0, want_tokens=4)
    assert (s["requests"], s["ok"], s["wrong_length"], s["output_tokens"]) == (3, 2, 1, 6)
    assert s["tok_s"] == 3.0 and s["errors"] == ["queue full"]
    assert math.isclose(s["tpot_ms_p50"], (100.0 + 200.0) / 2)  # (0.3/3 and 0.2/1 s) -> median


def test_agreement_finds_where_answers_part():
    """Identical answers are counted; a differing one reports its first differing token."""
    a = [Answer(token_ids=[1, 2, 3]), Answer(token_ids=[4, 5, 6])]
    b = [Answer(token_ids=[1, 2, 3]), Answer(token_ids=[4, 9, 6])]
    assert agreement(a, b) == {"identical": 1, "compared": 2, "by": "token ids", "first_difference_at": [[1, 1]]}


def test_answers_ended_by_eos_are_not_the_wrong_length():
    """The copy workload lets EOS end an answer: no length is wanted."""
    s = summarize([Answer(status=200, times=[0.1, 0.2], tokens=2)], wall_s=1.0, want_tokens=None)
    assert s["wrong_length"] == 0 and s["output_tokens"] == 2


def test_every_engine_runs_twice_in_palindrome_order():
    """A B C D D C B A: each engine's two runs bracket the others'."""
    assert palindrome(["r", "v"]) == [("r", 0), ("v", 0), ("v", 1), ("r", 1)]


def test_float32_greedy_disagreement_fails_the_run():
    """Below 95 % identical greedy answers between two engines fails a float32 run, not a bf16 one."""
    pair = {"identical": 18, "compared": 20, "by": "token ids", "first_difference_at": [[3, 40], [7, 12]]}
    entry = {"pins": {"none": {"engines": {}, "agreement": {"text/c1 ringserve vs vllm": pair}}}}
    report = {"dtype": "float32", "models": {"m": entry}}
    assert failures(report) == ["m none text/c1 ringserve vs vllm: 18/20 greedy answers identical"]
    assert not failures({**report, "dtype": "bfloat16"})
    pair["identical"] = 19
    assert not failures(report)


def test_text_and_copy_prompts_have_the_stated_lengths(tiny_model_dir):
    """Text prompts are exactly --prompt-tokens long and all different; a copy prompt holds its
    passage, which is real text of --copy-tokens tokens."""
    prompts = text_prompts(str(tiny_model_dir), 6, 40, seed=1)
    assert [len(p) for p in prompts] == [40] * 6 and len({tuple(p) for p in prompts}) == 6
    copies = copy_prompts(str(tiny_model_dir), 2, 30, seed=1)
    passages = text_prompts(str(tiny_model_dir), 2, 30, seed=1)
    for c, p in zip(copies, passages):
        assert any(c[i : i + 30] == p for i in range(len(c) - 29)) and len(c) > 30


def test_flops_per_token_of_smollm2_shape(tmp_path):
    """2 FLOPs per weight: SmolLM2-135M's dense layers are 106M weights, its head 28M."""
    cfg = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dense, head = flops_per_token(str(tmp_path))
    assert (round(dense / 2e6), round(head / 2e6)) == (106, 28)


def test_vllm_settings_are_read_from_its_log():
    """The non-default arguments, the engine config's settings and the OpenMP binding."""
    log = (
        "(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'dtype': 'float32', 'max_num_seqs': 32}\n"
        "(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m', "
        "speculative_config=SpeculativeConfig(method='ngram', model=None, num_spec_tokens=4), dtype=torch.float32, "
        "max_seq_len=8192, enable_prefix_caching=True, enable_chunked_prefill=True, foo=1\n"
        "(EngineCore pid=2) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
        "(EngineCore pid=2) INFO [torch_utils.py:295] Reducing Torch threads from 2 to 1 for serving.\n"
    )
    got = vllm_settings(log)
    assert got["dtype"] == "torch.float32" and got["enable_prefix_caching"] == "True"
    assert got["speculative_config"].startswith("SpeculativeConfig(method='ngram'")
    assert got["omp_binding"] == ["local_rank=0, core ids=[0]"] and got["torch_threads"] == 1
    assert "'max_num_seqs': 32" in got["non_default_args"]


def test_missing_vllm_is_skipped_with_the_reason(tmp_path):
    """No --vllm-python, or one that is not a file, gives a reason instead of an error."""
    assert probe_vllm(None)[1].startswith("no vLLM Python given")
    assert "no such file" in probe_vllm(str(tmp_path / "python"))[1]


def test_drives_ringserve_and_checks_every_answer(tiny_model_dir, capsys):
    """A small run against a real ringserve, plain and with speculation: every engine twice, every
    request answered (text: with exactly the requested tokens), greedy answers identical, the
    resolved settings and the GEMM peak recorded, vLLM skipped and said so, JSON for machines."""
    rc = bench_peers.main(
        [
            "--json",
            "--models",
            str(tiny_model_dir),
            "--engines",
            "ringserve,ringserve+ngram,vllm",
            "--concurrency",
            "1,3",
            "--copy-concurrency",
            "2",
            "--requests",
            "3",
            "--prompt-tokens",
            "20",
            "--output-tokens",
            "6",
            "--copy-tokens",
            "16",
            "--copy-output-tokens",
            "12",
            "--warmup",
            "1",
            "--settle-s",
            "0",
            "--ringserve-arg=--workers=1",
        ]
    )
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert rc == 0, out.err[-2000:]
    assert report["vllm_skipped"] and "vLLM skipped" in out.err and "passed" in out.err
    pin = report["models"][tiny_model_dir.name]["pins"]["none"]
    assert set(pin["engines"]) == {"ringserve", "ringserve+ngram"}
    plain, spec = pin["engines"]["ringserve"], pin["engines"]["ringserve+ngram"]
    assert spec["settings"]["speculative"] == "ngram" and plain["settings"]["speculative"] == "off"
    assert plain["settings"]["max_rows"] == 32 and len(spec["start_s"]) == 1  # its two runs share a start
    for eng in (plain, spec):
        assert [set(r) for r in eng["runs"]] == [{"text/c1", "text/c3", "copy/c2"}] * 2
        for run in eng["runs"]:
            for key, s in run.items():
                assert s["ok"] == s["requests"] == 3 and s["wrong_length"] == 0, key
                assert s["tok_s"] > 0 and s["ttft_ms_p95"] >= s["ttft_ms_p50"] > 0
    assert pin["gemm_gflops"][0]["peak"] > 0
    assert pin["combined"]["text/c1"]["ringserve"]["tok_s"]["median"] > 0
    agree = pin["agreement"]["copy/c2 ringserve vs ringserve+ngram"]
    assert agree["identical"] == agree["compared"] == 3
    assert report["commit"] and len(report["loadavg_start"]) == 3


def test_missing_llama_server_is_skipped_with_the_reason(tmp_path, monkeypatch):
    """No llama-server given nor on PATH, or a path that is not an executable, gives a reason."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server(None)[1].startswith("no llama-server")
    (tmp_path / "llama-server").write_text("")
    assert "not an executable" in find_llama_server(str(tmp_path / "llama-server"))[1]


def test_greedy_disagreement_on_a_gguf_is_reported_not_gated():
    """Two engines' quantized kernels round differently: on a GGUF file agreement never fails a run."""
    pair = {"identical": 3, "compared": 20, "by": "text", "first_difference_at": [[0, 4]]}
    entry = {"gguf": True, "pins": {"none": {"engines": {}, "agreement": {"text/c1 ringserve vs llamacpp": pair}}}}
    assert not failures({"dtype": "float32", "models": {"m": entry}})


def test_a_gguf_file_is_served_quantized_and_llamacpp_skipped_without_a_binary(tiny_model_dir, tmp_path, capsys):
    """`--models FILE.gguf`: ringserve serves the file (its blocks), the prompts come from its
    conversion, llama.cpp is skipped with the reason when no binary is found."""
    from tests.helpers.gguf_files import write_llama_gguf

    gguf = write_llama_gguf(tiny_model_dir, tmp_path / "tiny-q8.gguf", quant="Q8_0")
    argv = ["--json", "--models", str(gguf), "--engines", "ringserve,llamacpp", "--workloads", "text"]
    argv += ["--concurrency", "2", "--requests", "2", "--prompt-tokens", "12", "--output-tokens", "4"]
    argv += ["--warmup", "0", "--settle-s", "0", "--ringserve-arg=--workers=1", "--llama-server", str(tmp_path / "no")]
    rc = bench_peers.main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    report = json.loads(out.out)
    entry = report["models"]["tiny-q8"]
    assert entry["gguf"] and "llamacpp" in entry["skipped"] and report["llamacpp_skipped"]
    assert set(entry["pins"]["none"]["engines"]) == {"ringserve"}
    assert "--model" in (cmd := entry["pins"]["none"]["engines"]["ringserve"]["command"])
    assert cmd[cmd.index("--model") + 1] == str(gguf)
