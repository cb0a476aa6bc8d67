"""Attention test cases on any device and the float64 oracle they are judged by.

Shared by the harness matrix (CPU) and the GPU sweep (`tests/gpu/test_attention_kernels.py`):
sequences of (cached, new) tokens with shuffled block tables over a pool whose unused slots hold
`fill` (NaN by default, so a kernel that reads or multiplies an unwritten slot fails loudly).
"""

from __future__ import annotations

import random

import torch

from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs

BS = 16
# atol, rtol per dtype: |got - oracle| <= atol + rtol * |oracle|
TOL = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2), torch.float32: (2e-5, 1e-4)}


def make_case(
    specs,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
    seed,
    device="cpu",
    shared_prefix_blocks=0,
    fill=float("nan"),
    logit_scale=1.0,
):
    """q, k_cache, v_cache, meta and the per-sequence dense (K, V) for sequences `specs` of
    (cached, new) tokens. With shared_prefix_blocks > 0 every sequence's first blocks are the first
    sequence's (n samples of one prompt). `logit_scale` multiplies q (large logits stress the
    softmax's range handling)."""
    device = torch.device(device)
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    need = sum((c + n + BS - 1) // BS for c, n in specs) + 1
    pool_shape = (need, num_kv_heads, BS, head_dim)
    k_cache = torch.full(pool_shape, fill, dtype=dtype, device=device)
    v_cache = torch.full(pool_shape, fill, dtype=dtype, device=device)
    ids = list(range(need))
    rng.shuffle(ids)
    steps, dense = [], []
    shared: list[int] = []
    shared_kv = None
    for i, (cached, new) in enumerate(specs):
        total = cached + new
        table = [ids.pop() for _ in range((total + BS - 1) // BS)]
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        if shared_prefix_blocks:
            n_shared = min(shared_prefix_blocks * BS, total)
            if i == 0:
                shared, shared_kv = table[:shared_prefix_blocks], (k[:n_shared], v[:n_shared])
            else:
                m = min(len(shared), len(table))
                table[:m] = shared[:m]
                n_copy = min(n_shared, shared_kv[0].shape[0], m * BS)
                k[:n_copy], v[:n_copy] = shared_kv[0][:n_copy], shared_kv[1][:n_copy]
        pos = torch.arange(total, device=device)
        blocks = torch.tensor(table, device=device)[pos // BS]
        k_cache[blocks, :, pos % BS] = k  # [total, kvh, d] into each token's slot
        v_cache[blocks, :, pos % BS] = v
        dense.append((k, v))
        steps.append(SeqStep(i, [0] * new, cached, table))
    meta = build_step_inputs(StepBatch(steps), BS, device).meta
    q = (torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen, device=device) * logit_scale).to(dtype)
    return q, k_cache, v_cache, meta, dense


def oracle(q, meta, dense, scale):
    """Dense float64 causal attention per sequence: the answer the paged kernels must give."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    qsl = meta.query_start_loc.tolist()
    for s, (k, v) in enumerate(dense):
        lo, hi = qsl[s], qsl[s + 1]
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [L, H, d]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[lo:hi].double(), kk) * scale
        qpos = meta.positions[lo:hi][:, None]
        scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > qpos, float("-inf"))
        out[lo:hi] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)
    return out


def strided_q(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q as a column slice of a fused qkv projection (row stride (H + 2 KVH) * D), NaN between rows."""
    t, h, d = q.shape
    fused = torch.full((t, (h + 2 * num_kv_heads) * d), float("nan"), dtype=q.dtype, device=q.device)
    view = fused[:, : h * d].view(t, h, d)
    view.copy_(q)
    return view


def max_error(got, want) -> float:
    return (got.double() - want).abs().max().item() if got.numel() else 0.0


def assert_close(got, want, dtype, what):
    """Every element within atol + rtol * |oracle|, and nothing non-finite."""
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got.double() - want).abs()
    worst = (err - (atol + rtol * want.abs())).max().item() if got.numel() else -1.0
    assert worst <= 0, f"{what}: max |err| {err.max().item():.3g} exceeds atol {atol} + rtol {rtol}*|ref|"


def decode_specs(batch, max_ctx, seed):
    """`batch` decode rows (one new token each), the first at `max_ctx`, the rest random below it."""
    rng = random.Random(seed)
    lens = [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]
    return [(n - 1, 1) for n in lens]
