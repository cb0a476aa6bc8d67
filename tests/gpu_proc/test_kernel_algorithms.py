"""The CUDA kernels' algorithms, run on CPU: a line-by-line numpy port of the loops in
`paged_decode.cu` and `paged_prefill.cu` (CTA grid, warps over KV blocks, lane groups per token,
online softmax, KV splits and their merge, query tiles found by scanning query_start_loc), checked
against dense float64 attention.

It checks the algorithm and every index expression, with the launcher's own planning constants; it
cannot check the CUDA code itself (tests/gpu does that on a GPU). Keep it in step with the .cu files.
Unused pool slots hold NaN, as in the GPU tests, so a read past a context fails here too.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from ringserve.gpu_proc.attention import cupy_backend as cb
from ringserve.gpu_proc.attention.metadata import build_step_inputs
from ringserve.gpu_proc.step import SeqStep, StepBatch

BS = cb.BLOCK_SIZE
NEG = np.float32(-np.inf)
WARPS = cb.DECODE_THREADS // 32


def _case(specs, heads, kv_heads, head_dim, seed):
    """fp32 pool (NaN where unused) with shuffled tables for sequences (cached, new); q and meta."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = sum((c + n + BS - 1) // BS for c, n in specs) + 1
    kc = torch.full((need, kv_heads, BS, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    ids = list(range(need))
    rng.shuffle(ids)
    steps, dense = [], []
    for i, (cached, new) in enumerate(specs):
        total = cached + new
        table = [ids.pop() for _ in range((total + BS - 1) // BS)]
        k, v = torch.randn(total, kv_heads, head_dim, generator=gen), torch.randn(total, kv_heads, head_dim, generator=gen)
        pos = torch.arange(total)
        blocks = torch.tensor(table)[pos // BS]
        kc[blocks, :, pos % BS], vc[blocks, :, pos % BS] = k, v
        dense.append((k, v))
        steps.append(SeqStep(i, [0] * new, cached, table))
    meta = build_step_inputs(StepBatch(steps), BS, torch.device("cpu")).meta
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=gen)
    return q, kc, vc, meta, dense


def _dense(q, meta, dense, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for s, (k, v) in enumerate(dense):
        lo, hi = qsl[s], qsl[s + 1]
        group = q.shape[1] // k.shape[1]
        kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[lo:hi].double(), kk) * scale
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > meta.positions[lo:hi][:, None], float("-inf"))
        out[lo:hi] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vv)
    return out


def _chunk_token(meta, t) -> bool:
    """rs_chunk_token: the token's sequence has more than one new token in this step."""
    s = int(meta.token_seq[t])
    return int(meta.query_start_loc[s + 1] - meta.query_start_loc[s]) != 1


def _decode(q, kc, vc, meta, scale, num_splits, single_only=False, out=None):
    """paged_decode.cu: grid (token, head group, split) of 4 warps; then rs_decode_merge. With
    single_only (mixed steps) chunk tokens are skipped and their rows of `out` left untouched."""
    t_count, heads, d = q.shape
    kvh_count = kc.shape[1]
    group = next(g for g in cb.DECODE_GROUPS if (heads // kvh_count) % g == 0)
    max_blocks = math.ceil(meta.max_seq_len / BS)
    bps = math.ceil(max_blocks / num_splits)
    num_splits = math.ceil(max_blocks / bps)
    qf, kf, vf = q.numpy().reshape(-1), kc.numpy().reshape(-1), vc.numpy().reshape(-1)
    bt, mb = meta.block_tables.numpy().reshape(-1), meta.block_tables.shape[1]
    pos, tseq = meta.positions.numpy(), meta.token_seq.numpy()
    tpt = d // 8
    tok_per_pass = 32 // tpt
    lane = np.arange(32)
    grp, li = lane // tpt, lane % tpt
    chan = li[:, None] * 8 + np.arange(8)  # [32, 8] channels each lane owns
    part = np.zeros((num_splits, t_count, heads, d + 2), np.float32)  # acc | m | l
    for t in range(t_count):
        if single_only and _chunk_token(meta, t):
            continue
        ctx = int(pos[t]) + 1
        nb = (ctx + BS - 1) // BS
        for c in range(heads // group):
            h0 = c * group
            kvh = h0 // (heads // kvh_count)
            qr = np.stack([qf[t * heads * d + (h0 + g) * d + chan] for g in range(group)]) * scale * cb._LOG2E
            for z in range(num_splits):
                b_begin, b_end = z * bps, min(nb, z * bps + bps)
                sm = []  # per warp: m [G], l [G], acc [G, D]
                for w in range(WARPS):
                    m = np.full(group, NEG)
                    l = np.zeros((group, 32), np.float32)
                    acc = np.zeros((group, 32, 8), np.float32)
                    for b in range(b_begin + w, b_end, WARPS):
                        base = (int(bt[int(tseq[t]) * mb + b]) * kvh_count + kvh) * BS * d
                        for p in range(BS // tok_per_pass):
                            tok = p * tok_per_pass + grp
                            valid = b * BS + tok < ctx
                            idx = np.where(valid[:, None], base + tok[:, None] * d + chan, 0)
                            kv = np.where(valid[:, None], kf[idx], 0)  # guarded loads: never NaN
                            vv = np.where(valid[:, None], vf[idx], 0)
                            for g in range(group):
                                partial = (qr[g] * kv).sum(1)
                                s = np.array([partial[grp == grp[x]].sum() for x in range(32)])
                                s = np.where(valid, s, NEG)
                                m_new = max(m[g], s.max())
                                alpha = 1.0 if m_new == NEG else np.exp2(m[g] - m_new)
                                pr = np.where(valid, np.exp2(s - m_new), 0.0)
                                l[g] = l[g] * alpha + pr
                                acc[g] = pr[:, None] * vv + acc[g] * alpha
                                m[g] = m_new
                    wl = np.array([[l[g][li == 0].sum()] for g in range(group)])[:, 0]
                    wacc = np.stack([np.concatenate([acc[g][li == j].sum(0) for j in range(tpt)]) for g in range(group)])
                    sm.append((m, wl, wacc))
                for g in range(group):
                    mx = max(sm[w][0][g] for w in range(WARPS))
                    total = np.zeros(d + 2, np.float32)
                    if mx != NEG:
                        for w in range(WARPS):
                            cw = np.exp2(sm[w][0][g] - mx)
                            total[:d] += sm[w][2][g] * cw
                            total[d + 1] += sm[w][1][g] * cw
                    total[d] = mx
                    part[z, t, h0 + g] = total
    out = np.full((t_count, heads, d), np.nan, np.float32) if out is None else out
    for t in range(t_count):
        if single_only and _chunk_token(meta, t):
            continue
        mx = part[:, t, :, d].max(0)  # [H]; split 0 always holds position 0
        weight = np.exp2(part[:, t, :, d] - mx)  # [S, H]
        num = (part[:, t, :, :d] * weight[..., None]).sum(0)
        den = (part[:, t, :, d + 1] * weight).sum(0)
        out[t] = num / den[..., None]
    return out


def _prefill(q, kc, vc, meta, scale, skip_single=False, out=None):
    """paged_prefill.cu: grid (tile upper bound, head); 32-row tiles, one KV block at a time. With
    skip_single, one-token sequences get no tile."""
    t_count, heads, d = q.shape
    kvh_count, rows = kc.shape[1], cb.PREFILL_ROWS
    num_seqs = meta.seq_lens.shape[0]
    qf, kf, vf = q.numpy().reshape(-1), kc.numpy().reshape(-1), vc.numpy().reshape(-1)
    bt, mb = meta.block_tables.numpy().reshape(-1), meta.block_tables.shape[1]
    qsl, pos = meta.query_start_loc.numpy(), meta.positions.numpy()
    out = np.full((t_count, heads, d), np.nan, np.float32) if out is None else out
    for tile in range(math.ceil(t_count / rows) + num_seqs):
        seq, seen = -1, 0
        for s in range(num_seqs):
            start, length = int(qsl[s]), int(qsl[s + 1] - qsl[s])
            tiles = 0 if skip_single and length == 1 else (length + rows - 1) // rows
            if tile < seen + tiles:
                seq, row0 = s, start + (tile - seen) * rows
                nrows = min(rows, start + length - row0)
                break
            seen += tiles
        if seq < 0:
            continue
        spos = np.array([pos[row0 + r] if r < nrows else -1 for r in range(rows)])
        max_pos = int(spos[nrows - 1])
        for h in range(heads):
            kvh = h // (heads // kvh_count)
            sq = np.zeros((rows, d), np.float32)
            for r in range(nrows):
                sq[r] = qf[(row0 + r) * heads * d + h * d + np.arange(d)] * scale * cb._LOG2E
            m, l = np.full(rows, NEG), np.zeros(rows, np.float32)
            acc = np.zeros((rows, d), np.float32)
            for kb in range(max_pos // BS + 1):
                base = (int(bt[seq * mb + kb]) * kvh_count + kvh) * BS * d
                kpos = kb * BS + np.arange(BS)
                live = kpos <= max_pos
                idx = np.where(live[:, None], base + np.arange(BS)[:, None] * d + np.arange(d), 0)
                sk, sv = np.where(live[:, None], kf[idx], 0), np.where(live[:, None], vf[idx], 0)
                sp = np.where(kpos[None, :] <= spos[:, None], sq @ sk.T, NEG)  # [rows, 16]
                for r in range(rows):
                    m_new = max(m[r], sp[r].max())
                    if m_new != NEG:
                        alpha = np.exp2(m[r] - m_new)
                        sp[r] = np.exp2(sp[r] - m_new)
                    else:
                        alpha, sp[r] = 1.0, 0.0
                    l[r], m[r] = l[r] * alpha + sp[r].sum(), m_new
                    acc[r] = acc[r] * alpha + sp[r] @ sv
            out[row0:row0 + nrows, h] = acc[:nrows] / l[:nrows, None]
    return out


CASES = [
    # (cached, new) per sequence, heads, kv heads, head_dim, forced decode splits
    ([(0, 1)], 4, 4, 32, 1),
    ([(16, 1), (5, 1), (40, 1)], 8, 2, 32, 1),
    ([(300, 1), (47, 1)], 8, 1, 64, 3),  # GQA 8 (two CTAs per KV head), empty split tails
    ([(600, 1)], 4, 4, 128, 5),
    ([(0, 40), (9, 7), (3, 1)], 4, 2, 32, 2),  # a prefill step through both kernels
    ([(0, 31), (0, 33), (15, 16), (16, 15)], 2, 1, 64, 1),  # tile and block edges
    ([(100, 70)], 2, 2, 128, 2),
    ([(40, 20), (45, 1), (3, 1), (0, 2)], 4, 1, 64, 3),  # mixed: decode rows among chunks, split
]


@pytest.mark.parametrize("specs,heads,kv_heads,head_dim,splits", CASES)
def test_kernel_algorithms_match_dense_attention(specs, heads, kv_heads, head_dim, splits):
    """Decode (split and merged), prefill, and the mixed-step pair (decode rows + prefill chunks,
    each skipping the other's rows) give dense attention, never touching NaN slots."""
    q, kc, vc, meta, dense = _case(specs, heads, kv_heads, head_dim, seed=len(specs) + heads + head_dim)
    scale = head_dim ** -0.5
    want = _dense(q, meta, dense, scale)
    mixed = _prefill(q, kc, vc, meta, scale, skip_single=True,
                     out=_decode(q, kc, vc, meta, scale, splits, single_only=True))
    for got in (_decode(q, kc, vc, meta, scale, splits), _prefill(q, kc, vc, meta, scale), mixed):
        got = torch.from_numpy(got)
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
