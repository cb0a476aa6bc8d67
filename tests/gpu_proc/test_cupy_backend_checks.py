"""The CuPy backend's launch checks (cupy_checks.py), run on CPU tensors: every bad argument is named before launch."""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.attention import cupy_backend as cb
from ringserve.gpu_proc.attention import cupy_checks as checks
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs

CPU = torch.device("cpu")


def _args(dtype=torch.float16, heads=8, kv_heads=2, head_dim=64):
    """q, k_cache, v_cache and the metadata of a step with a decode row and a 3-token chunk."""
    meta = build_step_inputs(StepBatch([SeqStep(0, [1], 20, [4, 2]), SeqStep(1, [1, 2, 3], 0, [7])]), 16, CPU).meta
    kc = torch.zeros(8, kv_heads, 16, head_dim, dtype=dtype)
    q = torch.zeros(meta.num_tokens, heads, head_dim, dtype=dtype)
    return q, kc, torch.zeros_like(kc), meta


def test_valid_arguments_pass():
    """A well-formed step passes every check, in all three dtypes and head dims."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in checks.HEAD_DIMS:
            q, kc, vc, meta = _args(dtype, head_dim=head_dim)
            assert checks.check_attention_args(q, kc, vc, meta) == CPU
            k = torch.zeros(meta.num_tokens, 2, head_dim, dtype=dtype)
            checks.check_write_kv_args(k, k, kc, vc, meta.slot_mapping)


def test_strided_rows_from_a_fused_projection_pass():
    """k as a column slice of a fused qkv output (row stride > heads x head_dim) is accepted."""
    q, kc, vc, meta = _args()
    fused = torch.zeros(meta.num_tokens, 3 * 2 * 64, dtype=torch.float16)
    k = fused[:, 128:256].view(meta.num_tokens, 2, 64)
    checks.check_write_kv_args(k, k, kc, vc, meta.slot_mapping)


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda a: a.update(q=a["q"].float()), TypeError, "q: dtype torch.float32 does not match"),
        (
            lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
            TypeError,
            "float64 unsupported",
        ),
        (lambda a: a.update(q=a["q"][:, :5]), ValueError, "not a multiple of num_kv_heads"),
        (lambda a: a.update(q=a["q"][..., :32]), ValueError, r"q: expected \[T, 8, 64\]"),
        (
            lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
            ValueError,
            "k_cache: must be contiguous",
        ),
        (lambda a: a.update(k_cache=torch.zeros(8, 2, 8, 64, dtype=torch.float16)), ValueError, "block_size|16"),
        (lambda a: a.update(v_cache=a["v_cache"][:4]), ValueError, "v_cache does not match"),
        (lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q: strides"),
        (lambda a: a["meta"].__setattr__("positions", a["meta"].positions.int()), TypeError, "meta.positions"),
        (
            lambda a: a["meta"].__setattr__("block_tables", a["meta"].block_tables[:, :1].contiguous()),
            ValueError,
            "too few for max_seq_len",
        ),
        (lambda a: a["meta"].__setattr__("token_seq", a["meta"].token_seq[:2]), ValueError, "meta.token_seq"),
    ],
)
def test_attention_rejects_bad_arguments(mutate, error, match):
    """Wrong dtype, shape, layout or metadata raises before any launch, naming the argument."""
    q, kc, vc, meta = _args()
    a = dict(q=q, k_cache=kc, v_cache=vc, meta=meta)
    mutate(a)
    with pytest.raises(error, match=match):
        checks.check_attention_args(a["q"], a["k_cache"], a["v_cache"], a["meta"])


def test_unsupported_head_dim_names_the_supported_ones():
    """head_dim 96 has no kernel; the error lists the ones that exist."""
    q, kc, vc, meta = _args(head_dim=96)
    with pytest.raises(ValueError, match=r"head_dim 96 unsupported; kernels exist for \(32, 64, 128\)"):
        checks.check_attention_args(q, kc, vc, meta)


def test_write_kv_rejects_mismatched_rows_and_slots():
    """k/v row counts and the slot mapping must agree."""
    q, kc, vc, meta = _args()
    k = torch.zeros(meta.num_tokens, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="v has 3 rows"):
        checks.check_write_kv_args(k, k[:3], kc, vc, meta.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping: expected shape"):
        checks.check_write_kv_args(k, k, kc, vc, meta.slot_mapping[:2])
    with pytest.raises(TypeError, match="slot_mapping: expected torch.int64"):
        checks.check_write_kv_args(k, k, kc, vc, meta.slot_mapping.int())


def test_launchers_refuse_cpu_tensors():
    """The kernels run on CUDA only; CPU tensors get a clear error instead of a crash."""
    q, kc, vc, meta = _args()
    with pytest.raises(ValueError, match="k_cache must be a CUDA tensor"):
        cb.paged_attention(q, kc, vc, meta, 0.125)
    with pytest.raises(ValueError, match="k_cache must be a CUDA tensor"):
        cb.write_kv(q[:, :2], q[:, :2], kc, vc, meta.slot_mapping)


@pytest.mark.parametrize(
    "num_ctas,max_seq_len,ctas_per_sm,expected",
    [
        (32 * 32, 1024, 4, 1),  # batch 32 x 32 heads fills the 132 x 4 resident CTAs: no split
        (32, 8192, 4, 17),  # batch 1 x 32 heads, 8k: ceil(132 * 4 / 32) = 17 splits (cap 512 / 16 = 32)
        (32, 8192, 8, 32),  # twice the occupancy wants 33 splits: capped at 16 blocks per split
        (256, 8192, 8, 5),  # batch 8 x 32 heads: ceil(1056 / 256)
        (32, 300, 4, 1),  # too short to split (under 2 x 16 blocks)
        (1, 1024, 4, 4),  # one CTA, 64 blocks: at most 64 / 16 = 4 splits
    ],
)
def test_decode_split_plan(num_ctas, max_seq_len, ctas_per_sm, expected):
    """Splits fill one wave of resident CTAs (SMs x CTAs per SM from the kernel's occupancy), each
    keeping >= 16 blocks; a batch that fills the wave is not split."""
    assert cb.plan_decode_splits(num_ctas, max_seq_len, sm_count=132, ctas_per_sm=ctas_per_sm) == expected


@pytest.mark.parametrize(
    "regs,smem,threads,expected",
    [
        (124, 8320, 128, 4),  # fp16 d128 group-4 decode before the unconditional loads: 25 % occupancy
        (144, 8320, 128, 3),  # fp32 d128 group-4: register-bound at 19 %
        (48, 2080, 128, 10),  # group 1: 48 registers
        (32, 0, 128, 16),  # thread-bound: 2048 / 128
        (32, 60000, 128, 3),  # shared-memory-bound: 228 KiB / (60000 + 1 KiB)
        (255, 0, 1024, 1),  # never below one
    ],
)
def test_resident_ctas_follow_the_occupancy_calculator(regs, smem, threads, expected):
    """CTAs per SM from registers (256-register granules per warp), shared memory and threads."""
    from ringserve.gpu_proc.attention.cupy_executor import resident_ctas

    assert resident_ctas(regs, smem, threads) == expected


def test_block_ids_outside_the_pool_are_rejected():
    """A block id past the pool (or negative) in any table entry is refused before a launch."""
    q, kc, vc, meta = _args()
    checks.check_block_tables(meta, kc.shape[0])  # ids 4, 2, 7 in a pool of 8
    for bad in (8, -1):
        q, kc, vc, meta = _args()
        meta.block_tables[1, 0] = bad
        with pytest.raises(ValueError, match=f"block id {bad}, outside the pool of 8 blocks"):
            checks.check_block_tables(meta, kc.shape[0])


def test_positions_past_the_block_table_are_rejected():
    """A position whose block would lie past the table's columns is refused."""
    q, kc, vc, meta = _args()
    meta.positions[0] = meta.block_tables.shape[1] * 16
    with pytest.raises(ValueError, match="outside the 2 block-table columns"):
        checks.check_block_tables(meta, kc.shape[0])


def test_block_tables_are_checked_once_per_step():
    """Every layer shares the step's metadata: after one pass the check is remembered for the pool size."""
    q, kc, vc, meta = _args()
    checks.check_block_tables(meta, 8)
    assert meta.checked_num_blocks == 8
    meta.block_tables[0, 0] = 99  # not re-read for the same pool ...
    checks.check_block_tables(meta, 8)
    with pytest.raises(ValueError, match="block id 99"):  # ... but a different pool checks again
        checks.check_block_tables(meta, 16)
