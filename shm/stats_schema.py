"""The GPU process's published stats, declared once.

Each `GpuStat` is one float64 in the control block's GPU stats region (`layout.py` sizes the
region and folds the names into the schema checksum), one Prometheus metric on `/metrics`
(`api/metrics.py`), one field of `ringserve shm` (`tools/shm_inspect.py`) and one value of the
fake GPU's stats (`api/fake_gpu.py`). The GPU process publishes `Scheduler.stats()` (its fields
carry these names; a test keeps the two in step) plus the loop's own counters (`LOOP_STATS`).

Adding a GPU stat: one entry here, and the value where it is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPEC_POSITIONS = 16  # draft positions with an acceptance counter (config.MAX_SPECULATIVE_TOKENS)


@dataclass(frozen=True)
class GpuStat:
    """One published GPU-process stat."""

    name: str  # its key in the stats region
    kind: str  # "gauge" | "counter" (prometheus_client adds `_total` to a counter's name)
    metric: str  # the Prometheus name
    help: str
    label: tuple[str, str] | None = None  # (name, value): one series of a labelled family sharing `metric`

    def __post_init__(self) -> None:
        if self.kind not in ("gauge", "counter"):
            raise ValueError(f"stat {self.name}: kind must be gauge or counter, got {self.kind!r}")


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
        "Times the cost model found an estimate unusable and fell back to its configured constants.",
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
        for j in range(MAX_SPEC_POSITIONS)
    ),
    # the GPU loop's own counters (LOOP_STATS)
    GpuStat("step_ms", "gauge", "ringserve_step_ms", "Duration of the last GPU step, ms."),
    GpuStat("steps", "counter", "ringserve_steps", "Steps the GPU loop has run."),
    GpuStat("forward_ms", "gauge", "ringserve_forward_ms", "Forward and sampling time of the last step, ms."),
    GpuStat(
        "forward_est_ms",
        "gauge",
        "ringserve_forward_est_ms",
        "The cost model's estimate of the last step's forward and sampling time, ms (compare with forward_ms).",
    ),
    GpuStat(
        "rejected_429",
        "counter",
        "ringserve_rejected_429",
        "Requests refused with 429 (waiting GPU work over the limit).",
    ),
)

LOOP_STATS: tuple[str, ...] = (
    "step_ms",
    "steps",
    "forward_ms",
    "forward_est_ms",
    "rejected_429",
)  # counted by the GPU loop, not the scheduler
GPU_STAT_NAMES: tuple[str, ...] = tuple(s.name for s in GPU_STATS)
