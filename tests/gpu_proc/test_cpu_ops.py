"""The fused CPU ops against their torch references (a sweep of sizes and both dtypes), and the fused
forward of the Llama against its unfused, reference-attention forward."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ringserve.gpu_proc import cpu_ops
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch

pytestmark = pytest.mark.usefixtures("cpu_kernels")

SIZES = [1, 8, 40, 64, 100, 576]  # multiples of 16 and not (the kernels' vector and tail loops)
# float32: summation order only. bfloat16: one rounding of the output apart at most.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_rms_norm_and_add_rms_norm(n, dtype):
    """rms_norm and the fused residual add + norm give the references' rows and residual."""
    x, res, w = _rand(7, n, dtype=dtype), _rand(7, n, dtype=dtype, seed=1), _rand(n, dtype=dtype, seed=2)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_reference(x, w, 1e-5), **TOL[dtype])
    want, want_res = cpu_ops.add_rms_norm_reference(x, res, w, 1e-5)
    got, got_res = x.clone(), res.clone()
    cpu_ops.add_rms_norm_(got, got_res, w, 1e-5)
    assert torch.equal(got_res, want_res)  # one add, rounded once, in both
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 40, 64, 128])
def test_rope_on_views_of_a_fused_projection(head_dim, dtype):
    """q and k rotated in place inside one qkv tensor equal the reference; v is untouched."""
    t, h, kvh = 9, 4, 2
    qkv = _rand(t, (h + 2 * kvh) * head_dim, dtype=dtype)
    q = qkv[:, : h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim : (h + kvh) * head_dim].view(t, kvh, head_dim)
    v_before = qkv[:, (h + kvh) * head_dim :].clone()
    pos = torch.tensor([0, 1, 2, 7, 100, 3, 4000, 5, 6])
    freqs = torch.outer(torch.arange(4096.0), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    want_q, want_k = (cpu_ops.rope_reference(x, cos[pos], sin[pos]) for x in (q, k))
    cpu_ops.rope_(q, k, pos, cos, sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(qkv[:, (h + kvh) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_silu_mul(n, dtype):
    """silu(gate) * up from the fused [gate | up] rows, including large negative and positive gates."""
    gu = _rand(5, 2 * n, dtype=dtype) * 6
    torch.testing.assert_close(cpu_ops.silu_mul(gu), cpu_ops.silu_mul_reference(gu), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 32, 64, 65, 130, 286, 1000, 1032])
def test_packed_linear_equals_f_linear(rows, dtype):
    """The packed weight computes F.linear (with and without bias); where oneDNN cannot pack the
    dtype on this CPU, PackedLinear is F.linear itself."""
    w, b, x = _rand(96, 80, dtype=dtype), _rand(96, dtype=dtype, seed=3), _rand(rows, 80, dtype=dtype, seed=4)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(cpu_ops.PackedLinear(w)(x), F.linear(x, w), **tol)
    torch.testing.assert_close(cpu_ops.PackedLinear(w, b)(x), F.linear(x, w, b), **tol)
    assert (cpu_ops.PackedLinear(w).packed is not None) == cpu_ops.packs(dtype)


def test_a_cpu_where_onednn_cannot_pack_bfloat16_runs_the_unfused_forward(tiny_model_dir, monkeypatch):
    """oneDNN's bfloat16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only EPYC refused
    it ("bf16 path needs the cpu support ...") and the model failed to load. Told that it cannot
    pack, the model loads unfused and its logits equal the module-by-module forward's."""
    monkeypatch.setitem(cpu_ops._PACKS, torch.bfloat16, False)
    model, plain = load_model(tiny_model_dir, dtype=torch.bfloat16), load_model(tiny_model_dir, dtype=torch.bfloat16)
    model.setup("cpu")
    plain.setup("cpu", cpu_kernels=False)
    assert not model.fused and model.packed_head is None
    assert cpu_ops.PackedLinear(model.lm_head.weight).packed is None
    a = model.args
    runners = [
        ModelRunner(m, KVPool(a.num_layers, 8, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16))
        for m in (model, plain)
    ]
    for step in _steps():
        got, want = (r.execute(step) for r in runners)
        torch.testing.assert_close(got, want, atol=0.25, rtol=0.25)


def test_matmul_shapes_are_few_whatever_the_token_count():
    """Decode-sized matmuls run whole; larger ones as pieces of 8 sizes per power of two (at most
    4, largest first), the last one padded when that adds at most 1/32 of the rows: oneDNN caches
    a primitive per shape, so a 16k-token step budget makes at most 128 shapes per weight, not 16k
    (an hour's soak grew the process by hundreds of MB)."""
    shapes = set()
    for t in range(1, 16385):
        pieces = cpu_ops.matmul_pieces(t)
        assert t <= sum(pieces) <= t + t // 32 and len(pieces) <= 4, (t, pieces)
        assert pieces == sorted(pieces, reverse=True) and (t > 64 or pieces == [t])
        shapes.update(pieces)
    assert shapes >= set(range(1, 65)) and len(shapes) == 128
    assert cpu_ops.matmul_pieces(0) == [0]  # one empty call: a step whose rows all score or sample nothing
    assert cpu_ops.matmul_pieces(286) == [288]  # a 256-token prefill budget and 30 decode rows
    assert cpu_ops.matmul_pieces(1032) == [1024, 8]


# (fan_in, the targets' output columns, rank per target): vector and tail loops in both products,
# ranks not a multiple of the 4-rank tile, one target and three side by side.
LORA_SHAPES = [(40, (24, 8, 8), 3), (576, (576,), 16), (64, (100, 100), 5), (8, (17,), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fan_in,segs,r", LORA_SHAPES)
def test_lora_add_is_its_reference(fan_in, segs, r, dtype):
    """The gathered low-rank product adds each slot's delta to its rows only (tiles of 1 to 4 rows,
    rows in any order, tokens of the base model untouched), block-diagonal over the targets."""
    slots_n, t, rank = 3, 23, r * len(segs)
    x, y = _rand(t, fan_in, dtype=dtype), _rand(t, sum(segs), dtype=dtype, seed=1)
    a = (_rand(slots_n, rank, fan_in, dtype=torch.float32, seed=2) / fan_in**0.5).to(dtype)  # deltas of O(1)
    bt = torch.zeros(slots_n, rank, sum(segs), dtype=dtype)
    col = 0
    for g, n in enumerate(segs):  # block-diagonal, as LoraSlots stacks a fused group
        bt[:, g * r : (g + 1) * r, col : col + n] = _rand(slots_n, r, n, dtype=torch.float32, seed=3 + g) / r**0.5
        col += n
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(4))
    rows = (perm[:9], perm[9:10], perm[10:14])  # 9 rows (4 + 4 + 1), 1, 4; perm[14:] run the base
    slots = (2, 0, 1)
    # The kernel rounds once, at the end: the reference in float32 on the same inputs, rounded.
    want, got = y.float(), y.clone()
    cpu_ops.lora_add_reference(x.float(), want, a.float(), bt.float(), rows, slots, segs)
    cpu_ops.lora_add_(x, got, a, bt, rows, slots, segs)
    torch.testing.assert_close(got, want.to(dtype), **TOL[dtype])
    assert torch.equal(got[perm[14:]], y[perm[14:]])


def test_lora_add_refuses_what_it_cannot_run():
    x, y = torch.zeros(4, 16), torch.zeros(4, 24)
    a, bt = torch.zeros(2, 6, 16), torch.zeros(2, 6, 24)
    rows = (torch.tensor([0, 1]),)
    with pytest.raises(ValueError, match="two slots"):
        cpu_ops.lora_add_(x, y, a, bt, (torch.tensor([0, 1]), torch.tensor([1])), (0, 1), (24,))
    with pytest.raises(ValueError, match="below 4"):
        cpu_ops.lora_add_(x, y, a, bt, (torch.tensor([4]),), (0,), (24,))
    with pytest.raises(ValueError, match="segments"):
        cpu_ops.lora_add_(x, y, a, bt, rows, (0,), (12, 8))
    with pytest.raises(ValueError, match="slots"):
        cpu_ops.lora_add_(x, y, a, bt, rows, (2,), (24,))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_ops.lora_add_(x, y, a, torch.zeros(2, 6, 20), rows, (0,), (24,))


def test_launchers_refuse_mismatched_inputs():
    """Wrong dtype, a non-contiguous last dimension or a weight of the wrong size is a ValueError."""
    x = torch.zeros(2, 16)
    with pytest.raises(ValueError, match="dtype"):
        cpu_ops.rms_norm(x.double(), torch.zeros(16, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="16"):
        cpu_ops.rms_norm(x, torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.silu_mul(torch.zeros(16, 2).t())
    with pytest.raises(ValueError, match="differs"):
        cpu_ops.add_rms_norm_(x, torch.zeros(3, 16), torch.zeros(16), 1e-5)


def _steps():
    """A prefill step (two prompts, one longer than a 16-token tile; 70 tokens, so the matmuls run
    padded) then a decode step."""
    prefill = StepBatch(
        [
            SeqStep(0, list(range(3, 68)), 0, [0, 1, 2, 4, 5], RowSampling()),
            SeqStep(1, list(range(50, 55)), 0, [3], RowSampling()),
        ]
    )
    decode = StepBatch([SeqStep(0, [7], 65, [0, 1, 2, 4, 5], RowSampling()), SeqStep(1, [9], 5, [3], RowSampling())])
    return prefill, decode


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.25)])
def test_fused_forward_matches_the_unfused_forward(tiny_model_dir, dtype, tol):
    """The fused CPU forward (packed projections, fused small ops, compiled attention) gives the
    logits of the module-by-module forward over the reference attention."""
    if not cpu_ops.packs(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (no AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    fused, plain = load_model(tiny_model_dir, dtype=dtype), load_model(tiny_model_dir, dtype=dtype)
    plain.setup("cpu", cpu_kernels=False)
    assert fused.fused and fused.backend.name == "cpu" and not plain.fused
    a = fused.args
    runners = [ModelRunner(m, KVPool(a.num_layers, 8, a.num_kv_heads, a.head_dim, dtype=dtype)) for m in (fused, plain)]
    for step in _steps():
        got, want = (r.execute(step) for r in runners)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert set(fused.state_dict()) == set(plain.state_dict())  # fused weights keep the checkpoint's names


@pytest.mark.parametrize("vocab", [1, 7, 16, 100, 1805, 49152])
def test_argmax_rows_is_torch_argmax_with_ties_and_nan(vocab):
    """The first maximum of each row, ties and NaN included, whatever the vocabulary size."""
    x = _rand(6, vocab, dtype=torch.float32)
    x[1] = 3.0  # all tied: index 0
    x[2, vocab // 2 :] = 1e9  # a tie from the middle: its first index
    x[3, vocab - 1] = float("nan")  # NaN counts as the maximum
    x[4] = float("-inf")
    got = cpu_ops.argmax_rows(x)
    assert got.tolist() == x.argmax(-1).tolist()
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.argmax_rows(x.double())


def test_block_checks_its_inputs_before_the_kernels_run(tiny_model_dir):
    """A block call with a cache the kernels cannot read (float16: only float32 or bfloat16, and
    float32 activations over a bfloat16 cache), or too few positions, is a ValueError."""
    from ringserve.gpu_proc.step_inputs import build_step_inputs

    model = load_model(tiny_model_dir)
    a = model.args
    inputs = build_step_inputs(_steps()[0], 16, torch.device("cpu"))
    pool = KVPool(a.num_layers, 8, a.num_kv_heads, a.head_dim, dtype=torch.float16)
    x = model.model.embed_tokens(inputs.input_ids)
    meta = inputs.meta
    step = (meta.positions, model.rope_cos, model.rope_sin, meta.slot_mapping, pool.k[0], pool.v[0], meta)
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU caches, got torch.float16"):
        cpu_ops.block(x, None, model.block_weights[0], step)
    pool = KVPool(a.num_layers, 8, a.num_kv_heads, a.head_dim)
    step = (meta.positions[:3], model.rope_cos, model.rope_sin, meta.slot_mapping, pool.k[0], pool.v[0], meta)
    with pytest.raises(ValueError, match="positions"):
        cpu_ops.block(x, None, model.block_weights[0], step)
