"""The numbers the scheduler publishes every step (`Scheduler.stats()`): one frozen record whose
fields are the scheduler's stats in `shm/stats_schema.py` (`tests/api/test_metrics.py` keeps the
two in step)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ringserve.shm.messages import MAX_LORA_ADAPTERS, MAX_METRICS_TENANTS, MAX_SPECULATIVE_TOKENS

__all__ = ["SCHEDULER_STAT_NAMES", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the GPU process publishes every step; each field is a stat that
    `shm/stats_schema.py` declares (a test keeps the two in step)."""

    queue_depth: int  # requests waiting for a row (siblings waiting for their prompt included)
    queued_gpu_seconds: float  # estimated GPU work that cannot start now
    running_rows: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_cached: int  # free blocks still holding a cached prefix (part of kv_blocks_free)
    preemptions: int  # requests preempted, for KV blocks or for fairness
    fair_preemptions: int  # of those, preempted so a tenant below its fair share could start
    cancelled_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    c_prefill_ms: float
    c_decode_ms: float
    cost_model_resets: int  # estimates found unusable and replaced by the prior
    cost_base_ms: float  # the step cost model's coefficients (`cost_model.py`)
    cost_token_ms: float
    cost_logit_ms: float
    cost_read_us: float
    step_target_ms: float
    cost_ratio_decode: float  # median measured / estimated of the last steps of each kind
    cost_ratio_prefill: float
    cost_ratio_mixed: float
    cost_steps_decode: int
    cost_steps_prefill: int
    cost_steps_mixed: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache at each join (recompute too)
    prefix_cache_hits: int  # of those, tokens served from cached blocks
    spec_decode_num_drafts: int  # speculative decoding: drafts verified (vLLM's names)
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # published as spec_accepted_pos_<j>
    # per LoRA adapter, by stats index: rows running it, requests waiting for it, sequences ended
    # and tokens generated under it since it was loaded; lora_running_<i>, lora_waiting_<i>, ...
    lora_running: tuple[int, ...] = ()
    lora_waiting: tuple[int, ...] = ()
    lora_finished: tuple[int, ...] = ()
    lora_tokens: tuple[int, ...] = ()
    # per tenant, by metrics slot (`tenant_book.py`): tenant_requests_<i>, ...
    tenant_requests: tuple[int, ...] = ()
    tenant_prompt_tokens: tuple[int, ...] = ()
    tenant_generation_tokens: tuple[int, ...] = ()
    tenant_running: tuple[int, ...] = ()
    tenant_waiting: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {name: getattr(self, name) for name in _STAT_FIELDS}
        for prefix, per, n in _PER_INDEX:
            values = getattr(self, per)
            for j in range(n):
                out[f"{prefix}_{j}"] = values[j] if j < len(values) else 0
        return out


# tuple fields published as one stat per index: (stat prefix, field, stats)
_PER_INDEX = (
    ("spec_accepted_pos", "spec_decode_accepted_per_position", MAX_SPECULATIVE_TOKENS),
    ("lora_running", "lora_running", MAX_LORA_ADAPTERS),
    ("lora_waiting", "lora_waiting", MAX_LORA_ADAPTERS),
    ("lora_finished", "lora_finished", MAX_LORA_ADAPTERS),
    ("lora_tokens", "lora_tokens", MAX_LORA_ADAPTERS),
    *(
        (name, name, MAX_METRICS_TENANTS + 1)  # the last slot: every tenant without its own ("other")
        for name in (
            "tenant_requests",
            "tenant_prompt_tokens",
            "tenant_generation_tokens",
            "tenant_running",
            "tenant_waiting",
        )
    ),
)
_STAT_FIELDS = tuple(f.name for f in fields(SchedulerStats) if f.name not in {p[1] for p in _PER_INDEX})
SCHEDULER_STAT_NAMES = _STAT_FIELDS + tuple(f"{prefix}_{j}" for prefix, _, n in _PER_INDEX for j in range(n))
