"""Paged attention against dense attention on random block tables: the case builder the reference
tests and the compiled CPU backend's tests share."""

from __future__ import annotations

import torch

from ringserve.gpu_proc.attention.reference import paged_attention, write_kv
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs

BS = 16


def dense_attention(q, k, v, scale, start):
    """Plain causal attention of new queries q [n, H, d] over one sequence's full k, v [L, KVH, d];
    query i sits at position start + i."""
    n, h, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [L, H, d]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    pos = torch.arange(start, start + n)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).float()


def run_case(
    seqs_spec,
    num_heads,
    num_kv_heads,
    head_dim,
    num_blocks,
    rng,
    shared_prefix=0,
    dtype=torch.float32,
    fill=0.0,
    attention=paged_attention,
    q_dtype=None,
):
    """Build sequences (cached, new) with random block tables, write their K/V through write_kv, and
    return (paged output, dense output). With shared_prefix > 0, every sequence reuses the first
    sequence's first `shared_prefix` blocks (and their contents), as n samples of one prompt do.
    Slots never written hold `fill`; `attention` is the function under test; `q_dtype` (default
    `dtype`): the query's and the new keys' dtype, over a cache of `dtype`."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pool = KVPool(1, num_blocks, num_kv_heads, head_dim, dtype=dtype)
    pool.k_all.fill_(fill)
    pool.v_all.fill_(fill)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    full_k, full_v, steps, qs = [], [], [], []
    shared_blocks: list[int] = []
    shared_k = shared_v = None
    for i, (cached, new) in enumerate(seqs_spec):
        total = cached + new
        nblocks = (total + BS - 1) // BS
        table = [ids.pop() for _ in range(nblocks)]
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        if shared_prefix:
            if i == 0:
                shared_blocks = table[:shared_prefix]
                shared_k, shared_v = k[: shared_prefix * BS].clone(), v[: shared_prefix * BS].clone()
            else:
                ids.extend(table[:shared_prefix])  # give the unused private ids back
                table[:shared_prefix] = shared_blocks
                k[: shared_prefix * BS], v[: shared_prefix * BS] = shared_k, shared_v
        # The cached prefix is written as an earlier step would have (shared blocks rewritten with
        # identical values is harmless).
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(cached)], dtype=torch.long)
        if cached:
            write_kv(k[:cached], v[:cached], pool.k[0], pool.v[0], slots)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
        steps.append(SeqStep(i, [0] * new, cached, table))
    inputs = build_step_inputs(StepBatch(steps), BS, torch.device("cpu"))
    new_k = torch.cat([k[s.start_pos :] for k, s in zip(full_k, steps)])
    new_v = torch.cat([v[s.start_pos :] for v, s in zip(full_v, steps)])
    write_kv(new_k, new_v, pool.k[0], pool.v[0], inputs.meta.slot_mapping)
    scale = head_dim**-0.5
    paged = attention(torch.cat(qs).to(q_dtype or dtype), pool.k[0], pool.v[0], inputs.meta, scale).float()
    dense = torch.cat([dense_attention(q, k, v, scale, s.start_pos) for q, k, v, s in zip(qs, full_k, full_v, steps)])
    return paged, dense
