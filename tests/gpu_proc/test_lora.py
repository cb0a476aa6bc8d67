"""LoRA adapters (gpu_proc/lora.py) against transformers + PEFT on the same checkpoint and adapter.

The adapters are made here with PEFT (random A and B, `init_lora_weights=False`, so each changes
the model's answers) in its own saved format, of different ranks, targets and scalings. Greedy
tokens must equal PEFT's, for each adapter alone and with four adapters and the base model mixed
in one step, through the fused CPU block and the module-by-module forward.
"""

from __future__ import annotations

import json

import pytest

from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.lora import AdapterError, LoraRegistry, load_adapter
from ringserve.gpu_proc.model.loader import load_model, read_special_tokens
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, generate
from ringserve.shm.messages import SamplingParams
from tests.helpers.lora_adapters import ADAPTERS, make_adapters, peft_greedy

NEW_TOKENS = 12


def _prompts(model_dir) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = ["The", "Hello world, this is", "def f(x):\n    return", "A crow sat on the branch of a tree " * 4]
    return [tok.encode(t).ids for t in texts]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    prompts = _prompts(tiny_model_dir)
    want = {name: peft_greedy(tiny_model_dir, adapters.get(name), prompts, NEW_TOKENS) for name in [None, *ADAPTERS]}
    return prompts, want


def _runner(model_dir, adapters, cpu_kernels=True, max_loras=4) -> ModelRunner:
    model = load_model(model_dir, device="cpu", cpu_kernels=cpu_kernels)
    a = model.args
    loras = LoraRegistry(a, max_loras, 16, model.device, model.dtype)
    for name, path in adapters.items():
        loras.load(name, path)
    return ModelRunner(model, KVPool(a.num_layers, 256, a.num_kv_heads, a.head_dim), loras)


def _run(runner, model_dir, jobs: list[tuple[str | None, list[int]]], **kw) -> list[list[int]]:
    eos = read_special_tokens(model_dir).eos_token_ids
    requests = [
        OfflineRequest(
            prompt_ids=ids, max_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0, ignore_eos=True), lora=lora
        )
        for lora, ids in jobs
    ]
    return [r.token_ids for r in generate(runner, requests, eos_token_ids=frozenset(eos), **kw)]


def test_every_adapter_changes_the_answers(expected):
    """Otherwise equal outputs below would prove nothing about the adapters."""
    _, want = expected
    for name in ADAPTERS:
        assert want[name] != want[None], name


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused", "modules"])
def test_each_adapter_alone_is_peft(tiny_model_dir, adapters, expected, cpu_kernels):
    prompts, want = expected
    runner = _runner(tiny_model_dir, adapters, cpu_kernels)
    for name in [None, *ADAPTERS]:
        got = _run(runner, tiny_model_dir, [(name, p) for p in prompts], max_rows=1)
        assert got == want[name], name


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused", "modules"])
def test_four_adapters_and_the_base_mixed_in_one_step_are_peft(tiny_model_dir, adapters, expected, cpu_kernels):
    """Every (adapter, prompt) pair in one run: decode rows and prefill chunks of five models share steps."""
    prompts, want = expected
    runner = _runner(tiny_model_dir, adapters, cpu_kernels)
    jobs = [(name, p) for p in prompts for name in [None, *ADAPTERS]]
    got = _run(runner, tiny_model_dir, jobs, max_rows=len(jobs), prefill_budget=64)
    assert got == [want[name][prompts.index(p)] for name, p in jobs]


def test_more_adapters_than_slots_swap_and_stay_exact(tiny_model_dir, adapters, expected):
    """Two slots for four adapters: the scheduler keeps at most two in the running rows, the
    registry swaps them in least recently used first, and nothing changes in the answers."""
    prompts, want = expected
    runner = _runner(tiny_model_dir, adapters, max_loras=2)
    jobs = [(name, p) for name in ADAPTERS for p in prompts[:2]]
    got = _run(runner, tiny_model_dir, jobs, max_rows=8)
    assert got == [want[name][prompts.index(p)] for name, p in jobs]
    assert runner.loras is not None and runner.loras.swaps >= len(ADAPTERS)


def test_a_bad_adapter_is_refused_naming_the_field(tiny_model_dir, adapters, tmp_path):
    from ringserve.gpu_proc.model.loader import model_args_from_config

    cfg_path = tiny_model_dir / "config.json"
    args = model_args_from_config(json.loads(cfg_path.read_text()), cfg_path)
    with pytest.raises(AdapterError, match="r 16 exceeds --max-lora-rank 8"):
        load_adapter("x", adapters["mlp-r16"], args, max_rank=8)
    with pytest.raises(AdapterError, match="adapter_config.json: not found"):
        load_adapter("x", tmp_path, args, max_rank=16)
    bad = tmp_path / "dora"
    bad.mkdir()
    cfg = json.loads((adapters["attn-r4"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        load_adapter("x", bad, args, max_rank=16)


def test_seeded_samples_of_an_adapter_do_not_depend_on_the_step_s_adapter_mix(tiny_model_dir, adapters, expected):
    """A seeded request of `all-r8` samples the same tokens alone and beside rows of three other
    adapters and the base model (the deltas of a row read only its own tokens)."""
    prompts, _ = expected
    runner = _runner(tiny_model_dir, adapters)
    eos = frozenset(read_special_tokens(tiny_model_dir).eos_token_ids)
    seeded = SamplingParams(temperature=1.0, seed=1234, ignore_eos=True)

    def run(names):
        reqs = [
            OfflineRequest(prompt_ids=prompts[i % len(prompts)], max_tokens=NEW_TOKENS, sampling=seeded, lora=n)
            for i, n in enumerate(names)
        ]
        return [r.token_ids for r in generate(runner, reqs, eos_token_ids=eos, max_rows=len(reqs))]

    alone = run(["all-r8"])[0]
    mixed = run(["all-r8", "attn-r4", None, "mlp-r16", "o-r2", "all-r8"])
    assert mixed[0] == alone and mixed[5] != alone  # the last one has another prompt


def test_an_adapter_unloaded_while_its_requests_run_stays_until_they_end(tiny_model_dir, adapters):
    """Unloading takes the name away at once (the table the workers read drops it) but keeps the
    weights, slot and stats index while a queued or running request runs the adapter; a load
    reads its checkpoint off the loop and is answered once served."""
    import time

    from ringserve.gpu_proc.lora_admin import LoraAdmin
    from ringserve.shm import messages as M

    runner = _runner(tiny_model_dir, {"attn-r4": adapters["attn-r4"]})
    registry = runner.loras
    published, replies, live = [], [], {1}

    class Control:
        def set_loras(self, entries):
            published.append([e.name for e in entries])

    class Scheduler:
        lora_index: dict = {}

        def lora_ids(self):
            return set(live)

    admin = LoraAdmin(registry, Control(), Scheduler(), wake=lambda: None)
    admin.handle(M.UnloadLora(rid=1, name="attn-r4"), replies.append)
    assert published[-1] == [] and "attn-r4" not in registry.ids and type(replies[-1]) is M.Accepted
    registry.slots_for({1})  # a running row still runs it
    admin.poll()
    assert 1 in registry.adapters and 1 in registry.index
    live.clear()
    admin.poll()
    assert 1 not in registry.adapters and not registry.index
    admin.handle(M.LoadLora(rid=2, name="all-r8", path=str(adapters["all-r8"])), replies.append)
    admin.handle(M.LoadLora(rid=3, name="all-r8", path=str(adapters["all-r8"])), replies.append)
    assert type(replies[-1]) is M.Rejected and "being loaded" in replies[-1].message
    for _ in range(200):
        admin.poll()
        if len(replies) == 3:
            break
        time.sleep(0.01)
    assert type(replies[-1]) is M.Accepted and replies[-1].rid == 2
    assert published[-1] == ["all-r8"] and registry.ids["all-r8"] == 2  # ids are never reused
    admin.close()


def test_slot_fills_are_timed_for_the_loop_and_the_scheduler(tiny_model_dir, adapters):
    runner = _runner(tiny_model_dir, adapters, max_loras=2)
    registry = runner.loras
    assert registry.take_fill_ms() == 0.0 and registry.fill_ms == 0.0
    registry.slots_for({1, 2})
    assert registry.resident == {1, 2} and registry.fill_ms > 0
    assert registry.take_fill_ms() > 0 and registry.take_fill_ms() == 0.0
    registry.slots_for({1, 2})  # resident: nothing copied
    assert registry.take_fill_ms() == 0.0
