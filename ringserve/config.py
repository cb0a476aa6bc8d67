"""The one `Config`: built once by the supervisor from flags and `RINGSERVE_*` environment, then
passed down explicitly to every process. Defaults are the design document's numbers
(`docs/design.md#limits-and-timeouts`)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ringserve.shm.messages import (
    MAX_LORA_ADAPTERS,
    MAX_LORA_NAME_CHARS,
    MAX_METRICS_TENANTS,
    MAX_SPECULATIVE_TOKENS,
    POOLING_TYPES,
)

# How far a step's measured time may run past its estimate (the cost model holds the median within
# [0.75, 1.33], docs/BENCHMARKS.md#cost-model): the derived step target leaves room for it.
STEP_ESTIMATE_TOLERANCE = 4.0 / 3.0


class ConfigError(ValueError):
    """A setting is out of range or of the wrong type; the message names it."""


@dataclass(frozen=True, kw_only=True)
class Config:
    # serving
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 0  # 0: derived from the CPU count
    # a checkpoint directory, a .gguf file, "tiny" or a known model name (ringserve/models.py);
    # None: the default model, SmolLM2-135M-Instruct, fetched and converted on first start
    model: str | None = None
    model_name: str | None = None  # the `model` id the API reports; default: the directory name
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto: the checkpoint's safetensors | dummy: random weights of its shape
    # auto: a converted GGUF's quantized weights served as their blocks (CPU kernels; gguf_blocks;
    # the default model's are) | none: every weight dequantized (the reference, what transformers
    # computes). auto by default: on the CPU the model's forward over the blocks is 1.5-5x the float
    # path's speed at 1-32 decode rows (docs/BENCHMARKS.md#quantized-weights-issue-35); where no kernel reads them
    # (CUDA for now) they are dequantized at load either way.
    quantization: str = "auto"
    # The KV cache's dtype: auto = the model's, except bfloat16 under a float32 model whose weights
    # the CPU kernels serve as GGUF blocks on a CPU with AVX512-BF16 (the default model here): half
    # the cache's bytes and what a decode step's attention reads (keys, values and the query rounded
    # to bfloat16, softmax and P.V in float32), served 1.15-1.3x faster at 1-32 streams with the held
    # text's loglikelihood as close to the reference (docs/BENCHMARKS.md, "A bfloat16 KV cache
    # under quantized weights"). bfloat16: the same under any float32 model on the CPU (opt-in
    # under float32 weights: no served gain measured there); float32: the model's float32, always.
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    # threads of the GPU process's CPU kernels (torch's intra-op count) when it computes on the CPU;
    # 0: one per CPU of the process's that other processes leave free, re-decided every 0.5 s
    # (gpu_proc/cpu_tuning.CpuShare). On the 2-core box both threads beat one by 1.2x at one stream
    # and 1.6x at 8 and 32 beside the API worker, but beside busy neighbours two ran 4-10x fewer
    # steps (docs/BENCHMARKS.md, "One model thread or two", "Model threads on a shared machine");
    # a count above the CPUs oversubscribes them, which slows every step.
    cpu_threads: int = 0
    # Replay decode-only steps from CUDA graphs captured at load (ignored on the CPU).
    cuda_graphs: bool = True
    # Attention on CUDA: auto = the CuPy kernels where CuPy imports, each op checked against the torch
    # reference on the device before READY and served by the reference where its check fails;
    # cupy = the same, but CuPy must import; reference = the torch reference, no kernels.
    attention_backend: str = "auto"
    # A failed kernel check (or CuPy missing) ends the start instead of falling back to the reference.
    require_kernels: bool = False
    # The marker probe (ringserve/probe.py): a greedy request every N s that must repeat a code from
    # its prompt; two failures in a row restart the GPU process. 0: off; -1 (auto): every 60 s on
    # CUDA with real weights, off on the CPU and for --load-format dummy.
    probe_interval_s: float = -1.0
    # bind the GPU process to its first cpu_threads CPUs (the API workers then run on the others),
    # as vLLM CPU does by default (nothing to bind with cpu_threads 0, every CPU); off: servers
    # started side by side would share the first CPU
    cpu_pin: bool = False
    # compiled CPU kernels (paged attention in place, fused norms/RoPE/SiLU, packed matmuls), built
    # once per machine at start-up; false: the torch reference path
    cpu_kernels: bool = True
    # The chat template file to serve instead of the model's (`--chat-template FILE`; a known model
    # may default to one ringserve ships, ringserve/chat_templates/); never one a client sends.
    chat_template: str | None = None
    # How a chat answer's tool calls are read (api/chat/tool_parsers.py): auto (from the template),
    # hermes (<tool_call> JSON blocks) or llama3_json
    tool_call_parser: str = "auto"
    # How a reasoning model's thinking is read from a chat answer (api/chat/reasoning_parsers.py):
    # deepseek_r1 or qwen3 (<think>...</think>); "" (default): every answer is content
    reasoning_parser: str = ""
    # How /v1/embeddings pools a prompt's final hidden states (api/embeddings/, gpu_proc/pooling.py):
    # last (the last prompt token's, vLLM's default for a decoder model) or mean
    embedding_pooling: str = "last"
    # LoRA adapters (gpu_proc/lora.py), vLLM's `--lora-modules name=path ...`: PEFT checkpoint
    # directories, each served as the model `name` beside the base model (space-separated pairs)
    lora_modules: str = ""
    max_loras: int = 4  # adapters resident at once, so at most this many in one step; others wait
    max_lora_rank: int = 16  # the largest adapter rank served (the resident slots are this wide)
    # Runtime adapters (`/v1/load_lora_adapter`): checkpoints under this directory only; None: off
    lora_dir: str | None = None
    api_keys_file: str | None = None
    metrics_keys_file: str | None = None  # keys for /metrics (one per line); None: /metrics is open
    # keys for the admin routes (/v1/load_lora_adapter, /v1/unload_lora_adapter), never a tenant's
    admin_keys_file: str | None = None
    # KV pool
    block_size: int = 16
    num_blocks: int = 0  # 0: sized from memory (GPU) or cpu_kv_blocks (CPU)
    cpu_kv_blocks: int = 2048
    gpu_memory_utilization: float = 0.9
    # scheduler (`docs/design.md#scheduler-pass`)
    max_rows: int = 32
    prefill_budget: int = 256
    context_limit: int = 8192
    # A cap on max_tokens below the context (the design's answers run to 1,000 tokens: 1000 gives
    # that limit); 0: none, a request may generate up to the context minus its prompt.
    max_tokens_limit: int = 0
    admission_margin: float = 0.05
    key_row_cap: int = 8
    # A request of a tenant below its fair share of rows that has waited more than this many
    # passes, with every row held, preempts the newest request of the tenant most over its share.
    fair_preempt_steps: int = 4
    # The first token promised to a tenant below its fair share (`docs/design.md#fairness`): its head
    # request joins within fair_preempt_steps + 1 passes and samples in the pass it joins, so with
    # each step held to step_target_ms its first token comes within (fair_preempt_steps + 2) steps.
    fair_ttft_s: float = 1.0
    # A step's estimated time (the cost model's) is held to this; prefill chunks are cut to fit.
    # 0: derived from fair_ttft_s, fair_preempt_steps and STEP_ESTIMATE_TOLERANCE (125 ms by default).
    step_target_ms: float = 0.0
    # What an output token weighs against a prompt token in fair queueing; 0: what the cost model
    # says one costs against the other on this machine (~12 on a GPU, ~1 on a CPU).
    output_token_weight: float = 0.0
    prefix_caching: bool = True  # reuse KV blocks of identical prompt prefixes
    # Reuse another tenant's cached blocks too. Off: the tenant (API key) salts the cache, so no key
    # can learn from timing or /metrics whether another sent a prompt; on only for one tenant's server.
    prefix_cache_across_tenants: bool = False
    # Speculative decoding (`docs/design.md#speculative-decoding`): off, or ngram (prompt lookup:
    # drafts of up to num_speculative_tokens from the row's own prompt and output, matched on a
    # suffix of ngram_min to ngram_max tokens, verified in one forward).
    speculative: str = "off"
    num_speculative_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    # admission
    queue_limit_s: float = 2.0
    c_prefill_ms: float = 0.1
    c_decode_ms: float = 1.25
    # streaming
    slow_reader_s: float = 30.0
    request_timeout_s: float = 600.0  # deadline for a request from its arrival
    max_body_bytes: int = 4 * 1024 * 1024
    # The logprob entries one response may carry (a token and its alternatives, echoed and prompt
    # tokens included, all choices): what a request may make a worker build (api/job_limits.py).
    max_response_logprobs: int = 500_000
    # Stored responses (/v1/responses with `store: true`, api/responses/store.py): kept this long,
    # at most this many bytes per tenant and in all (the oldest go first); 0 bytes: nothing stored.
    response_store_ttl_s: float = 3600.0
    response_store_tenant_bytes: int = 8 * 1024 * 1024
    response_store_bytes: int = 32 * 1024 * 1024
    # connections (docs/design.md#limits-and-timeouts): every state has a time limit
    header_timeout_s: float = 10.0  # a new connection's first request head must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive within this once its head has
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    listen_backlog: int = 2048  # the kernel caps it at net.core.somaxconn
    max_connections: int = 0  # per worker; 0: as many as its open-file limit allows
    # structured output (docs/design.md#structured-output, ringserve/rules.py): caps checked before
    # a schema or grammar is converted, and how long its conversion and check may take in one of
    # a worker's grammar processes (killed past it); the GPU process's compile gets twice that
    grammar_max_rules: int = 1000  # rules of a Lark or GBNF grammar
    grammar_max_patterns: int = 64  # patternProperties patterns in a JSON schema, all objects together
    grammar_timeout_s: float = 5.0
    grammar_procs: int = 2  # grammar processes per API worker, started when first needed
    # shared memory
    ring_bytes: int = 4 * 1024 * 1024
    # failure handling
    drain_timeout_s: float = 30.0
    # On SIGTERM, /ready fails this long before new requests are refused, so a load balancer's
    # health checks take the replica out while it still serves (docs/design.md#fleet);
    # 0: refuse at once (a single server, or one whose orchestrator waits first, like a preStop).
    unready_lead_s: float = 0.0
    watchdog_timeout_s: float = 10.0
    # A GPU-loop pass that is still computing (its thread's CPU time advances) keeps beating for
    # up to this long (gpu_proc/heartbeat.py): a slow step is not a hang, an endless one is.
    watchdog_step_cap_s: float = 60.0
    # 0: never give up on a crashing child (restart with capped backoff; the API answers 503 with
    # the last GPU error meanwhile); N: exit 1 after N crashes within restart_window_s, for a
    # service manager to restart the whole service (the systemd unit passes 5)
    restart_limit: int = 0
    restart_window_s: float = 60.0
    restart_hold_s: float = 30.0  # a request held across a GPU-process restart gets an error after this
    # A request in the step at two GPU-process deaths is not run again: neither resubmitted nor, if
    # its client resends it (same tenant, prompt and parameters), admitted for this long (422)
    quarantine_s: float = 600.0
    log_level: str = "info"
    # Request traces (api/request_trace.py, docs/operations.md#traces): an OTLP collector's URL
    # (http://host:4318 for OTLP/HTTP, its /v1/traces path added; host:4317 with the grpc
    # protocol); None: off. A client's W3C traceparent is honoured; sample_rate is the share of
    # requests without a sampled parent that are traced.
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "http/protobuf"
    otlp_traces_sample_rate: float = 1.0
    # Requests of at most this many API keys get their own `tenant` label on /metrics' per-tenant
    # series (the first keys seen, as hashes); the rest count as "other"
    metrics_tenants: int = 10

    def __post_init__(self) -> None:
        positive = (
            "block_size",
            "max_rows",
            "prefill_budget",
            "context_limit",
            "key_row_cap",
            "ring_bytes",
            "max_body_bytes",
            "max_response_logprobs",
            "cpu_kv_blocks",
            "watchdog_timeout_s",
            "watchdog_step_cap_s",
            "drain_timeout_s",
            "restart_window_s",
            "slow_reader_s",
            "request_timeout_s",
            "queue_limit_s",
            "header_timeout_s",
            "body_timeout_s",
            "keepalive_timeout_s",
            "listen_backlog",
            "restart_hold_s",
            "quarantine_s",
            "response_store_ttl_s",
            "num_speculative_tokens",
            "ngram_min",
            "fair_ttft_s",
            "grammar_max_rules",
            "grammar_max_patterns",
            "grammar_timeout_s",
            "grammar_procs",
            "max_loras",
            "max_lora_rank",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "fair_preempt_steps",
            "cpu_threads",
            "restart_limit",
            "max_connections",
            "max_tokens_limit",
            "unready_lead_s",
            "response_store_tenant_bytes",
            "response_store_bytes",
            "step_target_ms",
            "output_token_weight",
        ):  # 0 has a meaning: see the fields
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.otlp_traces_sample_rate <= 1.0:
            raise ConfigError(f"otlp_traces_sample_rate must be in [0, 1], got {self.otlp_traces_sample_rate}")
        if self.otlp_traces_protocol not in ("http/protobuf", "grpc"):
            raise ConfigError(f"otlp_traces_protocol must be http/protobuf or grpc, got {self.otlp_traces_protocol!r}")
        if self.otlp_traces_endpoint and self.otlp_traces_protocol == "grpc":
            import importlib.util

            if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
                raise ConfigError("otlp_traces_protocol grpc needs the otlp-grpc extra (pip install -e '.[otlp-grpc]')")
        if not 0 <= self.metrics_tenants <= MAX_METRICS_TENANTS:
            raise ConfigError(f"metrics_tenants must be in [0, {MAX_METRICS_TENANTS}], got {self.metrics_tenants}")
        if not 0.0 <= self.admission_margin < 1.0:
            raise ConfigError(f"admission_margin must be in [0, 1), got {self.admission_margin}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.response_store_bytes and self.response_store_tenant_bytes > self.response_store_bytes:
            raise ConfigError("response_store_tenant_bytes must not exceed response_store_bytes")
        if self.max_tokens_limit and self.max_tokens_limit >= self.context_limit:
            raise ConfigError("max_tokens_limit must be below context_limit")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.quantization not in ("auto", "none"):
            raise ConfigError(f"quantization must be auto or none, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"kv_cache_dtype must be auto, bfloat16 or float32, got {self.kv_cache_dtype!r}")
        if self.probe_interval_s < 0 and self.probe_interval_s != -1:
            raise ConfigError(f"probe_interval_s must be >= 0 (0: off) or -1 (auto), got {self.probe_interval_s}")
        if self.attention_backend not in ("auto", "cupy", "reference"):
            raise ConfigError(f"attention_backend must be auto, cupy or reference, got {self.attention_backend!r}")
        if self.tool_call_parser not in ("auto", "hermes", "llama3_json"):
            raise ConfigError(f"tool_call_parser must be auto, hermes or llama3_json, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("", "deepseek_r1", "qwen3"):
            raise ConfigError(
                f"reasoning_parser must be deepseek_r1 or qwen3 (or unset), got {self.reasoning_parser!r}"
            )
        if self.embedding_pooling not in POOLING_TYPES:
            raise ConfigError(f"embedding_pooling must be {' or '.join(POOLING_TYPES)}, got {self.embedding_pooling!r}")
        if self.speculative not in ("off", "ngram"):
            raise ConfigError(f"speculative must be off or ngram, got {self.speculative!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        self.loras  # noqa: B018  (parses lora_modules: a bad pair fails here, in the supervisor)
        if self.lora_dir and not self.admin_keys_file:
            raise ConfigError("lora_dir: loading adapters at runtime needs admin_keys_file (the routes' keys)")

    @property
    def loras(self) -> dict[str, str]:
        """`lora_modules` as {name: path}, in the order given."""
        out: dict[str, str] = {}
        for pair in self.lora_modules.split():
            name, sep, path = pair.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"lora_modules: {pair!r} is not name=path")
            if len(name) > MAX_LORA_NAME_CHARS:
                raise ConfigError(f"lora_modules: a name is at most {MAX_LORA_NAME_CHARS} characters")
            if name in out or name == self.model_name:
                raise ConfigError(f"lora_modules: the name {name!r} is taken (an adapter or the base model)")
            out[name] = path
        if len(out) > MAX_LORA_ADAPTERS:
            raise ConfigError(f"lora_modules: at most {MAX_LORA_ADAPTERS} adapters, got {len(out)}")
        return out

    @property
    def step_target(self) -> float:
        """The ms a step's estimated time is held to: `step_target_ms`, or derived (see the field)."""
        if self.step_target_ms:
            return self.step_target_ms
        return self.fair_ttft_s * 1000.0 / (self.fair_preempt_steps + 2) / STEP_ESTIMATE_TOLERANCE

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """How the supervisor hands the one Config to its children (environment variable)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Config:
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> Config:
        """Defaults, then `RINGSERVE_<FIELD>` variables, then explicit overrides (CLI flags)."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        values: dict[str, Any] = {}  # field name -> a value of that field's type (`_parse` made it)
        for f in fields(cls):
            raw = env.get(f"RINGSERVE_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# Every default as one value: what a part built without a Config (a test, a tool, the offline engine)
# starts from, so a default is written once, in the field above (gpu_proc's admission, cost model
# and KV sizing read theirs from here).
DEFAULTS = Config()


def _parse(f: dataclasses.Field, raw: str) -> object:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind == "bool":
        return parse_bool(raw, f"RINGSERVE_{f.name.upper()}")
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ConfigError(f"RINGSERVE_{f.name.upper()}={raw!r} is not a valid {kind}") from None
    return raw


def parse_bool(raw: str, name: str) -> bool:
    """on / off, true / false, yes / no, 1 / 0 (any case)."""
    value = raw.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected on or off")
