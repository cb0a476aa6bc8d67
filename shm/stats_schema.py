"""Every published stat, declared once: the GPU process's and the API workers'.

Each `GpuStat` is one float64 in the control block's GPU stats region (`layout.py` sizes the
region and folds the names into the schema checksum), one Prometheus metric on `/metrics`
(`api/metrics.py`), one field of `ringserve shm` (`tools/commands/shm_inspect.py`) and one value of the
fake GPU's stats (`api/fake_gpu.py`). The GPU process publishes `Scheduler.stats()` (its fields
carry these names; a test keeps the two in step) plus the loop's own counters (`LOOP_STATS`).

Adding a GPU stat: one entry here, and the value where it is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.shm.messages import FINISH_REASONS, MAX_LORA_ADAPTERS, MAX_METRICS_TENANTS, MAX_SPECULATIVE_TOKENS

STEP_KINDS = ("decode", "prefill", "mixed")  # the cost model's audit (gpu_proc/cost_model.StepAudit)


@dataclass(frozen=True)
class GpuStat:
    """One published GPU-process stat."""

    name: str  # its key in the stats region
    kind: str  # "gauge" | "counter" (prometheus_client adds `_total` to a counter's name)
    metric: str  # the Prometheus name
    help: str
    label: tuple[str, str] | None = None  # (name, value): one series of a labelled family sharing `metric`
    loop: bool = False  # counted by the GPU loop itself, not by the scheduler (`LOOP_STATS`)

    def __post_init__(self) -> None:
        if self.kind not in ("gauge", "counter"):
            raise ValueError(f"stat {self.name}: kind must be gauge or counter, got {self.kind!r}")


# Per LoRA adapter: (stat prefix, kind, metric, help), one stat per stats index.
# Per tenant by its metrics slot (`Control.tenants` names slots 0..; the last slot,
# MAX_METRICS_TENANTS, counts every tenant without one: "other"): (stat prefix, kind, metric, help)
TENANT_STATS = (
    ("tenant_requests", "counter", "ringserve_tenant_requests", "Requests admitted, by tenant (an API key's hash)."),
    (
        "tenant_prompt_tokens",
        "counter",
        "ringserve_tenant_prompt_tokens",
        "Prompt tokens of admitted requests, by tenant.",
    ),
    ("tenant_generation_tokens", "counter", "ringserve_tenant_generation_tokens", "Tokens generated, by tenant."),
    ("tenant_running", "gauge", "ringserve_tenant_running_rows", "Rows running on the GPU, by tenant."),
    ("tenant_waiting", "gauge", "ringserve_tenant_waiting_requests", "Requests waiting for a row, by tenant."),
)
TENANT_SLOTS = MAX_METRICS_TENANTS + 1
LORA_STATS = (
    ("lora_running", "gauge", "ringserve_lora_running_rows", "Rows running this LoRA adapter."),
    ("lora_waiting", "gauge", "ringserve_lora_waiting_requests", "Requests for this LoRA adapter waiting for a row."),
    (
        "lora_finished",
        "counter",
        "ringserve_lora_finished_sequences",
        "Sequences (samples) of this LoRA adapter that have ended, since it was loaded.",
    ),
    (
        "lora_tokens",
        "counter",
        "ringserve_lora_generation_tokens",
        "Tokens generated under this LoRA adapter, since it was loaded.",
    ),
)

GPU_STATS: tuple[GpuStat, ...] = (
    GpuStat("queue_depth", "gauge", "ringserve_queue_depth", "Requests waiting for a row."),
    GpuStat(
        "queued_gpu_seconds",
        "gauge",
        "ringserve_queued_gpu_seconds",
        "Estimated GPU seconds of work that cannot start now (429 above the limit).",
    ),
    GpuStat("running_rows", "gauge", "ringserve_running_rows", "Rows in the running batch."),
    GpuStat("kv_blocks_free", "gauge", "ringserve_kv_blocks_free", "Free KV-cache blocks."),
    GpuStat("kv_blocks_total", "gauge", "ringserve_kv_blocks_total", "KV-cache blocks in the pool."),
    GpuStat(
        "kv_blocks_cached",
        "gauge",
        "ringserve_kv_blocks_cached",
        "Free KV-cache blocks still holding a cached prefix (part of the free ones).",
    ),
    GpuStat(
        "preemptions",
        "counter",
        "ringserve_preemptions",
        "Requests preempted (KV pool exhausted, or for a tenant below its fair share); they are recomputed later.",
    ),
    GpuStat(
        "fair_preemptions",
        "counter",
        "ringserve_fair_preemptions",
        "Of those, preempted so a tenant below its fair share of rows could start.",
    ),
    GpuStat(
        "cancelled_tokens", "counter", "ringserve_cancelled_tokens", "Tokens generated for requests later cancelled."
    ),
    GpuStat("prompt_tokens_total", "counter", "ringserve_gpu_prompt_tokens", "Prompt tokens prefilled."),
    GpuStat("generation_tokens_total", "counter", "ringserve_gpu_generation_tokens", "Tokens generated."),
    GpuStat("c_prefill_ms", "gauge", "ringserve_cost_prefill_ms", "Cost model: GPU ms per prompt token."),
    GpuStat("c_decode_ms", "gauge", "ringserve_cost_decode_ms", "Cost model: GPU ms per output token."),
    GpuStat(
        "cost_model_resets",
        "counter",
        "ringserve_cost_model_resets",
        "Times the cost model found an estimate unusable and fell back to its prior (the start-up calibration).",
    ),
    GpuStat("cost_base_ms", "gauge", "ringserve_cost_base_ms", "Cost model: what every step costs, ms."),
    GpuStat("cost_token_ms", "gauge", "ringserve_cost_token_ms", "Cost model: ms per token fed through the layers."),
    GpuStat("cost_logit_ms", "gauge", "ringserve_cost_logit_ms", "Cost model: ms per position with logits."),
    GpuStat("cost_read_us", "gauge", "ringserve_cost_read_us", "Cost model: microseconds per key an attention read."),
    GpuStat("step_target_ms", "gauge", "ringserve_step_target_ms", "The estimated time each step is held to, ms."),
    *(
        GpuStat(
            f"cost_ratio_{kind}",
            "gauge",
            "ringserve_cost_ratio",
            "Median measured / estimated time of the last 256 steps of this kind (0 before the first).",
            label=("kind", kind),
        )
        for kind in STEP_KINDS
    ),
    *(
        GpuStat(
            f"cost_steps_{kind}",
            "counter",
            "ringserve_cost_steps",
            "Steps of this kind (decode: no prefill chunk; prefill: no decode row; mixed: both).",
            label=("kind", kind),
        )
        for kind in STEP_KINDS
    ),
    GpuStat(
        "prefix_cache_queries",
        "counter",
        "ringserve_prefix_cache_queries",
        "Tokens looked up in the prefix cache when requests join.",
    ),
    GpuStat(
        "prefix_cache_hits", "counter", "ringserve_prefix_cache_hits", "Of those, tokens served from cached KV blocks."
    ),
    GpuStat(
        "spec_decode_num_drafts",
        "counter",
        "ringserve_spec_decode_num_drafts",
        "Speculative decoding: drafts verified (a row's guessed tokens in one step).",
    ),
    GpuStat(
        "spec_decode_num_draft_tokens", "counter", "ringserve_spec_decode_num_draft_tokens", "Draft tokens verified."
    ),
    GpuStat(
        "spec_decode_num_accepted_tokens",
        "counter",
        "ringserve_spec_decode_num_accepted_tokens",
        "Of those, draft tokens the model agreed with (kept).",
    ),
    *(
        GpuStat(
            f"spec_accepted_pos_{j}",
            "counter",
            "ringserve_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was kept.",
            label=("position", str(j)),
        )
        for j in range(MAX_SPECULATIVE_TOKENS)
    ),
    # LoRA adapters by their stats index (`Control.loras`), by which /metrics names them
    *(
        GpuStat(f"{prefix}_{i}", kind, metric, doc, label=("lora", str(i)))
        for prefix, kind, metric, doc in LORA_STATS
        for i in range(MAX_LORA_ADAPTERS)
    ),
    *(
        GpuStat(f"{prefix}_{i}", kind, metric, doc, label=("tenant_slot", str(i)))
        for prefix, kind, metric, doc in TENANT_STATS
        for i in range(TENANT_SLOTS)
    ),
    # the GPU loop's own counters (LOOP_STATS)
    GpuStat("step_ms", "gauge", "ringserve_step_ms", "Duration of the last GPU step, ms.", loop=True),
    GpuStat("steps", "counter", "ringserve_steps", "Steps the GPU loop has run.", loop=True),
    GpuStat(
        "forward_ms", "gauge", "ringserve_forward_ms", "Forward and sampling time of the last step, ms.", loop=True
    ),
    GpuStat(
        "forward_est_ms",
        "gauge",
        "ringserve_forward_est_ms",
        "The cost model's estimate of the last step's forward and sampling time, ms (compare with forward_ms).",
        loop=True,
    ),
    GpuStat(
        "cpu_threads",
        "gauge",
        "ringserve_cpu_threads",
        "Threads the model computes with on the CPU (cpu_threads 0: one per CPU the other processes leave "
        "free, re-decided as they change); 0 on a GPU.",
        loop=True,
    ),
)

LOOP_STATS: tuple[str, ...] = tuple(s.name for s in GPU_STATS if s.loop)
GPU_STAT_NAMES: tuple[str, ...] = tuple(s.name for s in GPU_STATS)


# The workers' stats: counters and fixed-bucket histograms, one stats region per worker slot
# (`layout.py`), summed over the workers for /metrics (`api/metrics.py`).


@dataclass(frozen=True)
class Histogram:
    """A fixed-bucket histogram: counts per upper bound (plus +Inf), a sum and a count."""

    name: str
    bounds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.bounds or any(a >= b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"histogram {self.name}: bounds must be non-empty and increasing")

    @property
    def field_names(self) -> tuple[str, ...]:
        buckets = tuple(f"{self.name}_bucket_{i}" for i in range(len(self.bounds) + 1))
        return buckets + (f"{self.name}_sum", f"{self.name}_count")

    def bucket_name(self, value: float) -> str:
        """The field that counts `value`: the first bucket whose bound is at least it, else +Inf."""
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                return f"{self.name}_bucket_{i}"
        return f"{self.name}_bucket_{len(self.bounds)}"

    def cumulative(self, stats) -> list[float]:
        """Cumulative counts per bound, then +Inf, from a stats snapshot ({field: value})."""
        running, out = 0.0, []
        for i in range(len(self.bounds) + 1):
            running += stats.get(f"{self.name}_bucket_{i}", 0.0)
            out.append(running)
        return out


TTFT_MS_BOUNDS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
TPOT_MS_BOUNDS = (5, 10, 20, 30, 40, 50, 70, 100, 150, 250, 500, 1000)
# The design's "latency split by prompt-length bucket" (`docs/design.md#limits-and-timeouts`): TTFT
# and TPOT again per bucket of prompt tokens, named `<base>_plen_<label>` (the worker observes
# them, /metrics labels them).
PROMPT_LEN_BOUNDS = (512, 2048, 8192)  # upper bounds, in prompt tokens; the last bucket has none
PROMPT_LEN_LABELS = tuple(f"{lo}_{hi}" for lo, hi in zip((0, *PROMPT_LEN_BOUNDS), PROMPT_LEN_BOUNDS)) + (
    f"{PROMPT_LEN_BOUNDS[-1]}_plus",
)

E2E_MS_BOUNDS = (50, 100, 250, 500, 1000, 2500, 5000, 10000, 20000, 30000, 60000, 120000, 300000, 600000)
TOKEN_COUNT_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# Per request (its samples each, but e2e and prompt tokens), as vLLM's request histograms
# (`api/metrics.py` renders them under vLLM's names only): from arrival to the last byte; the GPU
# process's queue wait, prefill (first join to first token), decode (first to last token) and both;
# the gaps between token arrivals; the prompt and generated token counts.
REQUEST_HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram("e2e_ms", E2E_MS_BOUNDS),
    Histogram("queue_ms", TTFT_MS_BOUNDS),
    Histogram("prefill_ms", TTFT_MS_BOUNDS),
    Histogram("decode_ms", E2E_MS_BOUNDS),
    Histogram("inference_ms", E2E_MS_BOUNDS),
    Histogram("itl_ms", TPOT_MS_BOUNDS),
    Histogram("prompt_tokens", TOKEN_COUNT_BOUNDS),
    Histogram("generation_tokens", TOKEN_COUNT_BOUNDS),
)

HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram("ttft_ms", TTFT_MS_BOUNDS),
    Histogram("tpot_ms", TPOT_MS_BOUNDS),
    Histogram("max_gap_ms", (25, 50, 100, 250, 500, 1000, 2500, 5000)),
    *REQUEST_HISTOGRAMS,
) + tuple(
    Histogram(f"{base}_plen_{label}", bounds)
    for base, bounds in (("ttft_ms", TTFT_MS_BOUNDS), ("tpot_ms", TPOT_MS_BOUNDS))
    for label in PROMPT_LEN_LABELS
)

WORKER_COUNTER_NAMES: tuple[str, ...] = (
    "requests_total",
    "requests_rejected_400",
    "requests_rejected_429",
    "refused_at_once",  # of those, answered before the body was read (api/refusals.py)
    "requests_rejected_other",
    "prompt_tokens_total",
    "completion_tokens_total",
    "open_streams",
    "slow_reader_cancels",
    "disconnects",
    # spans, when tracing is on (api/request_trace.py): accepted into the export queue or dropped
    # at its bound, then sent to the exporter, which exported them or failed to
    "trace_spans_accepted",
    "trace_spans_dropped",
    "trace_spans_sent",
    "trace_spans_exported",
    "trace_spans_failed",
) + tuple(f"finished_{reason}" for reason in FINISH_REASONS)

WORKER_STAT_NAMES: tuple[str, ...] = WORKER_COUNTER_NAMES + tuple(name for h in HISTOGRAMS for name in h.field_names)
