"""LoRA adapters through the real server and the openai client (`--lora-modules`, gpu_proc/lora.py).

A tiny-model server with three PEFT adapters and two resident slots: `/v1/models` lists them with
their parent; a request naming one gets transformers + PEFT's greedy answer, and its `model`
back, on completions (plain and streamed) and chat; the base model and the adapters share steps,
and the same prompt under the base model and then under an adapter (its blocks in the prefix
cache) gets each one's own answer; an unknown model is a 404.
"""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from tests.helpers.lora_adapters import make_adapters, peft_greedy, served_greedy
from tests.helpers.server import ServerProcess

NAMES = ("attn-r4", "all-r8", "mlp-r16")
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    adapters = make_adapters(tiny_model_dir, root / "adapters", NAMES)
    modules = " ".join(f"{n}={p}" for n, p in adapters.items())
    with ServerProcess(
        tiny_model_dir, root / "shm", workers=1, dtype="float32", lora_modules=modules, max_loras=2
    ) as srv:
        yield srv, adapters


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _complete(client, model, prompt) -> list[int]:
    return served_greedy(client, model, prompt, NEW_TOKENS)


def _read_until(read, done, timeout_s: float = 10.0):
    """`read()` until `done(value)` or the timeout: the last value (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_models_lists_the_adapters_with_their_parent(served, tiny_model_dir):
    srv, _ = served
    client = _client(srv)
    models = {m.id: m for m in client.models.list().data}
    base = next(m for m in models.values() if not getattr(m, "parent", None))
    for name in NAMES:
        assert models[name].parent == base.id
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    assert refused.value.code == "model_not_found"


def test_each_adapter_is_peft_mixed_with_the_base_and_after_the_cache(served, tiny_model_dir):
    srv, adapters = served
    client = _client(srv)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in ("A crow sat on the branch of a tree " * 5, "Hello world")]
    assert len(prompts[0]) >= 32  # full blocks the prefix cache keeps
    want = {None: peft_greedy(tiny_model_dir, None, prompts, NEW_TOKENS)}
    want |= {n: peft_greedy(tiny_model_dir, adapters[n], prompts, NEW_TOKENS) for n in NAMES}
    base = client.models.list().data[0].id
    # the base model first: its prompt blocks are cached, and must not serve the adapters
    assert [_complete(client, base, p) for p in prompts] == want[None]
    jobs = [(name, i) for name in (None, *NAMES) for i in range(len(prompts))] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _complete(client, j[0] or base, prompts[j[1]]), jobs))
    assert got == [want[name][i] for name, i in jobs]


def test_streamed_and_chat_name_the_adapter(served):
    srv, _ = served
    client = _client(srv)
    chunks = list(client.completions.create(model="all-r8", prompt="Hello", max_tokens=4, temperature=0.0, stream=True))
    assert chunks and all(c.model == "all-r8" for c in chunks)
    chat = client.chat.completions.create(
        model="mlp-r16", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "mlp-r16"


def test_metrics_name_the_running_adapter_for_the_gateway(served):
    """While an adapter's request streams, `vllm:lora_requests_info` names it running (what the
    inference gateway's LoRA-affinity scorer reads) with max_lora 2, and its row is counted."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    srv, _ = served
    client = _client(srv)
    stream = client.completions.create(
        model="all-r8", prompt="Hello", max_tokens=1000, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))

    # NOTE: the GPU process publishes its stats after it has sent the step's tokens, so the first
    # token can arrive before the gauge names the adapter (it failed the fresh-clone CI once):
    # read until it does, bounded; the stream runs 1,000 tokens, far longer.
    def families() -> dict:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
            return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}

    def running(fams: dict) -> list[str]:
        return fams["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"].split(",")

    fams = _read_until(families, lambda f: "all-r8" in running(f))
    stream.close()
    [info] = fams["vllm:lora_requests_info"].samples
    assert info.labels["max_lora"] == "2" and "all-r8" in info.labels["running_lora_adapters"].split(",")
    rows = {s.labels["lora_name"]: s.value for s in fams["ringserve_lora_running_rows"].samples}
    assert rows["all-r8"] == 1 and set(rows) == set(NAMES)


def test_metrics_count_each_adapter_s_sequences_and_tokens(served):
    """`ringserve_lora_finished_sequences_total` and `..._generation_tokens_total` by adapter name
    count what ended under each adapter, and nothing of the base model's."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    srv, _ = served
    client = _client(srv)

    def counts() -> dict[tuple[str, str], float]:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for f in text_string_to_metric_families(text):
            if f.name in ("ringserve_lora_finished_sequences", "ringserve_lora_generation_tokens"):
                out |= {(f.name, s.labels["lora_name"]): s.value for s in f.samples if s.name.endswith("_total")}
            if f.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                out[(f.name, "")] = sum(s.value for s in f.samples)
        return out

    # NOTE: the stream an earlier test closed ends in the GPU process later, under its adapter:
    # counted after `before`, it failed CI once. Read `before` once nothing runs or waits.
    before = _read_until(
        counts, lambda c: not c.get(("vllm:num_requests_running", ""), 0) + c.get(("vllm:num_requests_waiting", ""), 0)
    )
    base = client.models.list().data[0].id
    for model in ("mlp-r16", "mlp-r16", base):
        _complete(client, model, [5, 6, 7])

    # NOTE: the GPU process publishes its stats after it has routed the step's finishes, so a
    # client can hold its answer before the counter moves: read until it does (bounded).
    def moved() -> dict[tuple[str, str], float]:
        after = counts()
        return {k: after[k] - before.get(k, 0.0) for k in after}

    delta = _read_until(moved, lambda d: d.get(("ringserve_lora_finished_sequences", "mlp-r16")) == 2)
    assert delta[("ringserve_lora_finished_sequences", "mlp-r16")] == 2
    assert delta[("ringserve_lora_generation_tokens", "mlp-r16")] == 2 * NEW_TOKENS
    assert all(v == 0 for (_, name), v in delta.items() if name not in ("mlp-r16", ""))


def test_responses_messages_and_embeddings_run_the_adapter(served):
    """The Responses API, Anthropic's Messages API (its own client) and embeddings name and run
    the adapter too: an adapter's embedding of a text is not the base model's."""
    import anthropic

    srv, _ = served
    client = _client(srv)
    base = client.models.list().data[0].id
    response = client.responses.create(model="all-r8", input="hi", max_output_tokens=4, temperature=0.0)
    assert response.model == "all-r8" and response.output_text is not None
    messages = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    message = messages.messages.create(model="mlp-r16", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert message.model == "mlp-r16" and message.content
    with pytest.raises(anthropic.NotFoundError):
        messages.messages.create(model="no-such-adapter", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    vectors = {m: client.embeddings.create(model=m, input="A crow sat").data[0].embedding for m in (base, "all-r8")}
    assert len(vectors[base]) == len(vectors["all-r8"]) and vectors[base] != vectors["all-r8"]
