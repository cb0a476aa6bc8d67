"""32-bit index overflow at the largest KV pool `kv_sizing` can plan on a 141 GB GPU.

The harness cannot allocate such a pool, but it can map one: the caches are sparse anonymous
mappings (MAP_NORESERVE; untouched pages cost nothing), passed to the kernels by address. The
smallest block kv_sizing can size (1 layer, 1 KV head, head_dim 32, fp16: 2 KiB) gives the most
blocks: 61 million, so a block's element offset passes 2^34 where a 32-bit product would wrap. The
sequences' blocks sit at the top of that pool, and KV append, decode (split and not), prefill and the
mixed step must equal the torch reference there.
"""

from __future__ import annotations

import mmap

import pytest
import torch

from ringserve.gpu_proc.attention import reference
from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels
from ringserve.gpu_proc.kv_sizing import plan_for_model
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs

from .cases import TOL
from .executor import HarnessExecutor

H200_BYTES = 141 * 10**9
HEADS, KV_HEADS, D, BS = 4, 1, 32, 16


def _largest_pool() -> int:
    plan = plan_for_model(
        total_bytes=H200_BYTES,
        free_bytes=H200_BYTES,
        utilization=1.0,
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=D,
        hidden_size=HEADS * D,
        intermediate_size=256,
        vocab_size=256,
        dtype_bytes=2,
        block_size=BS,
        max_rows=32,
        prefill_budget=256,
    )
    return plan.num_blocks


def _sparse(num_elements: int) -> torch.Tensor:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    try:
        buf = mmap.mmap(-1, num_elements * 2, flags=flags)
    except (OSError, OverflowError) as exc:
        pytest.skip(f"this kernel refuses a {num_elements * 2 / 1e9:.0f} GB sparse mapping: {exc}")
    return torch.frombuffer(buf, dtype=torch.float16)


@pytest.mark.parametrize("capability", [(9, 0), (7, 5)], ids=["tensor-core prefill", "CUDA-core prefill"])
def test_kernels_index_the_top_of_the_largest_pool(capability):
    num_blocks = _largest_pool()
    per_block = KV_HEADS * BS * D
    assert num_blocks < 2**31  # block ids fit the int32 tables
    assert (num_blocks - 1) * per_block > 2**34  # ... but element offsets do not fit 32 bits
    shape = (num_blocks, KV_HEADS, BS, D)
    k_cache = _sparse(num_blocks * per_block).view(shape)
    v_cache = _sparse(num_blocks * per_block).view(shape)
    top = num_blocks - 1
    gen = torch.Generator().manual_seed(0)
    specs = [(40, 1), (17, 1), (30, 20)]  # (cached, new): two decode rows and a chunk
    steps, cached_slots = [], []
    next_block = top
    for i, (cached, new) in enumerate(specs):
        table = list(range(next_block, next_block - (cached + new + BS - 1) // BS, -1))
        next_block = table[-1] - 1
        steps.append(SeqStep(i, [0] * new, cached, table))
        cached_slots += [table[p // BS] * BS + p % BS for p in range(cached)]
    slots = torch.tensor(cached_slots)
    kv = torch.randn(2, len(cached_slots), KV_HEADS, D, generator=gen).half()
    reference.write_kv(kv[0], kv[1], k_cache, v_cache, slots)
    meta = build_step_inputs(StepBatch(steps), BS, torch.device("cpu")).meta
    t = meta.num_tokens
    new_k, new_v = torch.randn(2, t, KV_HEADS, D, generator=gen).half()
    kernels = AttentionKernels(HarnessExecutor(order="random", seed=1, capability=capability))
    kernels.write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    blocks, offsets = meta.slot_mapping // BS, meta.slot_mapping % BS
    assert torch.equal(k_cache[blocks, :, offsets], new_k) and torch.equal(v_cache[blocks, :, offsets], new_v)

    q = torch.randn(t, HEADS, D, generator=gen).half()
    scale = D**-0.5
    want = reference.paged_attention(q, k_cache, v_cache, meta, scale).double()
    atol, rtol = (2 * x for x in TOL[torch.float16])
    for what, got in (
        ("mixed", kernels.paged_attention(q, k_cache, v_cache, meta, scale)),
        ("prefill", kernels.paged_prefill(q, k_cache, v_cache, meta, scale)),
        ("decode", kernels.paged_decode(q, k_cache, v_cache, meta, scale)),
        ("decode split", kernels.paged_decode(q, k_cache, v_cache, meta, scale, num_splits=3)),
    ):
        err = (got.double() - want).abs()
        assert torch.isfinite(got).all() and (err <= atol + rtol * want.abs()).all(), f"{what}: {err.max()}"
