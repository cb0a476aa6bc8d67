"""KV pool sizing from GPU memory: the arithmetic of docs/design.md#sizing, the utilization knob, and clear failures."""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.kv_sizing import (
    FIXED_ACTIVATION_OVERHEAD,
    KVSizingError,
    estimate_activation_bytes,
    kv_block_bytes,
    plan_kv_blocks,
    plan_kv_blocks_on_device,
)

GB = 10**9
DESIGN_BLOCK = kv_block_bytes(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype_bytes=2)


def test_block_bytes_match_the_seed():
    """A 7B block (32 layers, 32 KV heads, head dim 128, 16 tokens, fp16) is 8.39 MB."""
    assert DESIGN_BLOCK == 8_388_608


def test_seed_pool_is_7152_blocks():
    """80 GB with 14 GB of weights in use and a 6 GB reserve leaves 60 GB: 7,152 blocks."""
    plan = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=66 * GB,
        utilization=1.0,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    assert plan.num_blocks == 7152
    assert plan.num_blocks * 16 == 114_432
    assert plan.pool_bytes <= 60 * GB


def test_utilization_caps_the_share_of_the_device():
    """At 0.9 the pool loses exactly 10 % of the device (8 GB, 953 blocks' worth)."""
    full = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=66 * GB,
        utilization=1.0,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    part = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=66 * GB,
        utilization=0.9,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    assert part.num_blocks == (52 * GB) // DESIGN_BLOCK == 6198
    assert full.num_blocks - part.num_blocks == 954


def test_memory_used_by_other_processes_counts_against_the_pool():
    """Whatever the driver reports as used (weights, other processes) comes out of the budget."""
    alone = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=66 * GB,
        utilization=0.9,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    shared = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=56 * GB,
        utilization=0.9,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    assert alone.num_blocks - shared.num_blocks == pytest.approx(10 * GB / DESIGN_BLOCK, abs=1)


def test_no_room_raises_an_actionable_error():
    """When weights and the reserve exceed the allowed share, the error says what to change."""
    with pytest.raises(KVSizingError, match="gpu-memory-utilization"):
        plan_kv_blocks(
            total_bytes=24 * GB,
            free_bytes=10 * GB,
            utilization=0.6,
            block_bytes=DESIGN_BLOCK,
            activation_reserve_bytes=2 * GB,
        )


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_utilization_out_of_range_is_rejected(utilization):
    """gpu_memory_utilization outside (0, 1] is an input error, not a silent clamp."""
    with pytest.raises(KVSizingError, match="gpu_memory_utilization"):
        plan_kv_blocks(
            total_bytes=80 * GB,
            free_bytes=66 * GB,
            utilization=utilization,
            block_bytes=DESIGN_BLOCK,
            activation_reserve_bytes=0,
        )


def test_inconsistent_device_numbers_are_rejected():
    """Free memory above total (a broken query) is reported, not turned into a huge pool."""
    with pytest.raises(KVSizingError, match="free="):
        plan_kv_blocks(
            total_bytes=10 * GB,
            free_bytes=11 * GB,
            utilization=0.9,
            block_bytes=DESIGN_BLOCK,
            activation_reserve_bytes=0,
        )


def test_zero_sized_dimensions_are_rejected():
    """A zero dimension in the block shape names the bad field."""
    with pytest.raises(KVSizingError, match="num_kv_heads"):
        kv_block_bytes(num_layers=32, num_kv_heads=0, head_dim=128, block_size=16, dtype_bytes=2)


def test_activation_reserve_grows_with_the_step_and_keeps_the_floor():
    """The reserve is the fixed overhead plus a per-token and per-row term that scales with the step."""
    small = estimate_activation_bytes(
        max_step_tokens=288, max_rows=32, hidden_size=4096, intermediate_size=11008, vocab_size=32000, dtype_bytes=2
    )
    big = estimate_activation_bytes(
        max_step_tokens=2 * 288, max_rows=32, hidden_size=4096, intermediate_size=11008, vocab_size=32000, dtype_bytes=2
    )
    per_token = (4 * 4096 + 3 * 11008) * 2
    assert small == FIXED_ACTIVATION_OVERHEAD + 288 * per_token + 32 * 32000 * 12
    assert big - small == 288 * per_token


def test_describe_names_the_inputs():
    """The start-up log line carries block count, device size and the reserve."""
    plan = plan_kv_blocks(
        total_bytes=80 * GB,
        free_bytes=66 * GB,
        utilization=0.9,
        block_bytes=DESIGN_BLOCK,
        activation_reserve_bytes=6 * GB,
    )
    text = plan.describe()
    assert "6198 blocks" in text and "x 0.9" in text and "reserve" in text


@pytest.mark.gpu
def test_device_plan_fits_in_free_memory():
    """On a real GPU the planned pool fits in what the driver reports free."""
    plan = plan_kv_blocks_on_device("cuda", utilization=0.5, block_bytes=DESIGN_BLOCK, activation_reserve_bytes=GB)
    free, _ = torch.cuda.mem_get_info()
    assert 0 < plan.pool_bytes <= free
