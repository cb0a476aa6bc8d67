"""GGUF-quantized weights served as their blocks: the CPU kernel (`csrc/cpu_quant.cpp`) against its
torch reference (`gpu_proc/quant.py`), the blocks a conversion keeps, and the model served from them.

Tolerances: the kernel equals `qlinear_reference` (exact integer block dots, float scales) within
float32 summation order (rtol 1e-5); against the float matmul of the dequantized weight it differs
by the int8 quantization of the activations, as llama.cpp's does (here under 2 % of the largest
output). Batch invariance is exact: a row's output is the same bits alone and in any batch.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ringserve.gpu_proc import quant
from ringserve.gpu_proc.cpu_ext import load_cpu_ops
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.gguf_blocks import QUANTIZED_FILE, read_formats
from ringserve.gpu_proc.model.gguf_convert import convert_gguf
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import GREEDY, OfflineRequest, generate, loglikelihood
from tests.helpers.gguf_files import write_llama_gguf

gguf = pytest.importorskip("gguf")
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    load_cpu_ops()


def _blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights quantized by gguf-py as llama.cpp does: (blocks [n, k/32, bytes], the bytes)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, fmt))
    return torch.from_numpy(raw.copy()).reshape(n, k // 32, -1), raw


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_ggmls(fmt):
    blocks, raw = _blocks(fmt, 40, 128)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, fmt))
    assert quant.format_of(blocks).name == fmt
    assert torch.equal(quant.dequantize(blocks), torch.from_numpy(want.astype(np.float32)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_spec_runs_on_the_blocks_device(fmt):
    """dequantize and as_q8_0 make no tensor on the CPU of their own: on a GPU they run on CUDA
    blocks (the kernels' start-up check, the dequantized fallback). The meta device stands in for
    CUDA here (a stray CPU tensor fails the same way). Q5's high-bit shifts were made on the CPU
    and failed every Q5 check on the H200."""
    blocks = _blocks(fmt, 4, 64)[0].to("meta")
    assert quant.dequantize(blocks).device.type == "meta"
    assert quant.as_q8_0(blocks).device.type == "meta"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
# 3 blocks a row (an odd last one), 18 (one run of 16 in the AVX-512 kernel's grouped layout and
# two as stored), 33 (two runs and an odd one)
@pytest.mark.parametrize("k", (96, 576, 1056))
def test_kernel_matches_its_reference(fmt, dtype, k):
    blocks, _ = _blocks(fmt, 72, k)
    bias = torch.randn(72).to(dtype)
    layer = quant.QuantLinear(blocks, bias)
    for t in (0, 1, 3, 4, 5, 17):
        x = (torch.randn(t, k) * 3).to(dtype)
        got = layer(x)
        want = quant.qlinear_reference(x, blocks, bias)
        assert got.dtype == dtype and got.shape == (t, 72)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(
            got.float(), want.float(), rtol=tol, atol=tol * (want.abs().max().item() if t else 1.0)
        )
        if t:  # the int8 activations cost accuracy, as llama.cpp's do: a bounded amount
            exact = x.float() @ quant.dequantize(blocks).T + bias.float()
            assert (got.float() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_is_the_same_alone_and_in_any_batch(fmt):
    blocks, _ = _blocks(fmt, 50, 1056, seed=1)
    layer = quant.QuantLinear(blocks)
    x = torch.randn(37, 1056)
    whole = layer(x)
    for lo, hi in ((0, 1), (5, 6), (3, 11), (36, 37), (1, 37)):
        assert torch.equal(layer(x[lo:hi].contiguous()), whole[lo:hi])


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_embedding_row_from_the_repacked_blocks_is_the_dequantized_row(fmt):
    blocks, _ = _blocks(fmt, 30, 1056, seed=2)
    packed = quant.repack(blocks)
    assert packed.shape == blocks.shape
    ids = torch.tensor([0, 29, 7, 7, 12])
    assert torch.equal(quant.embedding(packed, ids), quant.dequantize(blocks)[ids])
    with pytest.raises(RuntimeError, match="outside"):
        quant.embedding(packed, torch.tensor([30]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_as_q8_0_are_exact_where_q8_0_holds_them(fmt):
    """A fusion group of mixed formats is read as Q8_0 (`quant.as_q8_0`): Q4_0 and Q5_0 become it
    exactly (the same scale, the integer shifted), Q4_1 and Q5_1 within half a Q8_0 step."""
    blocks, _ = _blocks(fmt, 20, 256, seed=4)
    lifted = quant.as_q8_0(blocks)
    assert quant.format_of(lifted).name == "Q8_0" and lifted.shape[:2] == blocks.shape[:2]
    want, got = quant.dequantize(blocks), quant.dequantize(lifted)
    if fmt in ("Q8_0", "Q4_0", "Q5_0"):
        assert torch.equal(got, want)
    else:
        step = want.reshape(20, 8, 32).abs().amax(-1, keepdim=True) / 127
        assert ((got - want).reshape(20, 8, 32).abs() <= step * (0.5 + 128 * 2.0**-11)).all()


def test_the_kernel_refuses_what_it_cannot_read():
    blocks, _ = _blocks("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="K = 32"):
        quant.QuantLinear(blocks)(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="no format"):
        torch.ops.ringserve_cpu.qlinear.default(torch.randn(2, 64), torch.zeros(8, 2, 30, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="not a quantized weight"):
        quant.QuantLinear(torch.zeros(8, 2, 30, dtype=torch.uint8))


def _convert(tiny_model_dir, tmp_path, name, **kw):
    path = write_llama_gguf(tiny_model_dir, tmp_path / f"{name}.gguf", **kw)
    return convert_gguf(path, tmp_path / name, say=lambda line: None)


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant")
    return {
        "Q8_0": _convert(tiny_model_dir, tmp, "q8", quant="Q8_0"),
        "Q4_1": _convert(tiny_model_dir, tmp, "q41", quant="Q4_1"),
        # a group of mixed formats (q Q8_0, k/v Q4_0) is held as Q8_0; the rest stays as it is
        "mixed": _convert(tiny_model_dir, tmp, "mixed", quant="Q4_0", overrides={"q_proj.weight": "Q8_0"}),
    }


def test_a_conversion_keeps_the_blocks_that_dequantize_to_its_weights(converted):
    from safetensors.torch import load_file

    for fmt in ("Q8_0", "Q4_1"):
        d = converted[fmt]
        blocks = load_file(str(d / QUANTIZED_FILE))
        floats = load_file(str(d / "model.safetensors"))
        # every projection, the embedding and the head (hidden 128 and intermediate 352 split into blocks)
        assert len(blocks) == 4 * 7 + 2 and set(read_formats(d / QUANTIZED_FILE).values()) == {fmt}
        for name, b in blocks.items():  # q/k rows back in Hugging Face's rotary order, as transformers'
            assert torch.equal(quant.dequantize(b), floats[name]), name


def _runner(model_dir, quantization="auto"):
    model = load_model(model_dir, "cpu", quantization=quantization)
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, 128, a.num_kv_heads, a.head_dim))


@pytest.mark.parametrize("fmt", ("Q8_0", "Q4_1", "mixed"))
def test_the_model_is_served_from_its_blocks(converted, fmt):
    """`--quantization auto` holds the projections, embedding and head as blocks (their float
    parameters never allocated), and its loglikelihood of a text stays near the dequantized
    reference's (`none`); greedy output is the same alone and in a batch."""
    d = converted[fmt]
    q, ref = _runner(d), _runner(d, "none")
    file_bytes = (d / QUANTIZED_FILE).stat().st_size
    assert ref.model.quantized_bytes == 0
    if fmt == "mixed":  # k and v lifted from Q4_0 (18 bytes a block) to Q8_0 (34), exactly
        layers = q.model.args.num_layers
        assert q.model.weights_served()["transcoded_from"] == {"Q4_0": 2 * layers}
        assert file_bytes < q.model.quantized_bytes < 1.25 * file_bytes
    else:  # every block, once (the file adds its header)
        assert 0.99 * file_bytes < q.model.quantized_bytes <= file_bytes
    meta = [n for n, p in q.model.named_parameters() if p.is_meta]
    assert any("q_proj" in n for n in meta) and any("gate_proj" in n for n in meta)
    ids = list(range(3, 200, 3))
    lq, lr = loglikelihood(q, ids), loglikelihood(ref, ids)
    assert abs(lq - lr) <= 0.01 * abs(lr), (lq, lr)
    prompts = [list(range(5, 5 + n)) for n in (1, 17, 40)]
    reqs = [OfflineRequest(prompt_ids=p, max_tokens=12, sampling=GREEDY) for p in prompts]
    together = generate(q, reqs, eos_token_ids=frozenset())
    for r, want in zip(reqs, together):
        assert generate(q, [r], eos_token_ids=frozenset())[0].token_ids == want.token_ids


def test_quantization_none_and_unknown_values(converted):
    with pytest.raises(ValueError, match="quantization 'int4'"):
        load_model(converted["Q8_0"], "cpu", quantization="int4")
    marker = json.loads((converted["Q8_0"] / "ringserve-model.json").read_text())
    assert marker["format"] >= 2


def test_a_second_setup_keeps_the_blocks_and_a_non_fused_one_dequantizes_them(converted):
    """The executor sets the model up again with the attention backend it chose: a fused setup
    keeps the repacked blocks (not repacked twice), one that does not run fused (the reference
    attention) gets the float weights back, equal to the dequantized checkpoint's."""
    from ringserve.gpu_proc.attention import reference_backend

    d = converted["Q4_1"]
    q, ref = _runner(d), _runner(d, "none")
    served = [b.data_ptr() for b in q.model.served_blocks]
    q.model.setup("cpu", q.model.backend)
    assert [b.data_ptr() for b in q.model.served_blocks] == served
    ids = list(range(3, 90, 2))
    before = loglikelihood(q, ids)
    q.model.setup("cpu", reference_backend())
    ref.model.setup("cpu", reference_backend())
    assert not q.model.fused and q.model.weights_served()["quantization"] == "none"
    for (name, a), (_, b) in zip(q.model.state_dict().items(), ref.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert abs(loglikelihood(q, ids) - before) <= 0.01 * abs(before)


def _k_quant_rows(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random rows of K-quant super-blocks (gguf-py dequantizes them but cannot make them): random
    integers and 6-bit scales, fp16 super-block scales of a real weight's size."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    size, bytes_ = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // size, bytes_), dtype=np.uint8)
    scales = rng.uniform(1e-4, 4e-4, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin first
        blocks[:, 0:4] = scales
    else:  # Q6_K: d last
        blocks[:, -2:] = scales[:, 0:2]
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind", ("Q4_K", "Q5_K", "Q6_K"))
def test_other_formats_are_transcoded_to_the_kernels_within_their_bounds(kind):
    """Q4_K's sub-blocks are Q4_1 blocks up to fp16 rounding of their scale and offset; Q5_K and
    Q6_K are requantized to Q8_0: at most half a step of 1/127 of a 32-block's largest
    weight away, plus the fp16 rounding of the step (`gguf_blocks.TRANSCODED`)."""
    from ringserve.gpu_proc.model.gguf_blocks import transcode

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    rows = _k_quant_rows(kind, 24, 512)
    want = torch.from_numpy(gguf.quants.dequantize(rows, qtype).astype(np.float32))
    fmt, blocks = transcode(int(qtype), rows)
    got = quant.dequantize(torch.from_numpy(blocks))
    assert fmt.name == ("Q4_1" if kind == "Q4_K" else "Q8_0") and got.shape == want.shape == (24, 512)
    err = (got - want).abs()
    if kind == "Q4_K":
        assert err.max() <= 2.0**-10 * want.abs().max()
    else:
        block_max = want.reshape(24, 16, 32).abs().amax(-1, keepdim=True)
        step = block_max / 127  # its fp16 rounding: 2^-11 relative, 2^-25 absolute below fp16's normals
        assert (err.reshape(24, 16, 32) <= step / 2 + 127 * torch.clamp(step * 2.0**-11, min=2.0**-25) * 1.01).all()
    # and the kernel reads them as any other blocks
    x = torch.randn(3, 512)
    torch.testing.assert_close(
        quant.QuantLinear(torch.from_numpy(blocks))(x),
        quant.qlinear_reference(x, torch.from_numpy(blocks)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_a_gguf_with_k_quants_is_kept_quantized(tmp_path):
    """A Q4_K / Q6_K file (the common Q4_K_M mix) keeps those tensors as blocks, says which formats
    they came from, and undoes the rotary row order of q as for the kernels' own formats."""
    from ringserve.gpu_proc.model.gguf_blocks import write_quantized

    rows = {
        "blk.0.attn_q.weight": ("Q4_K", _k_quant_rows("Q4_K", 64, 256, 1)),
        "blk.0.ffn_down.weight": ("Q6_K", _k_quant_rows("Q6_K", 32, 512, 2)),
    }
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_head_count(4)
    w.add_head_count_kv(2)
    for name, (kind, r) in rows.items():
        w.add_tensor(name, r, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / QUANTIZED_FILE
    formats = write_quantized(tmp_path / "k.gguf", out)
    assert formats == {"model.layers.0.self_attn.q_proj.weight": "Q4_1", "model.layers.0.mlp.down_proj.weight": "Q8_0"}
    assert set(read_formats(out, "ringserve_sources").values()) == {"Q4_K", "Q6_K"}
    from safetensors.torch import load_file

    q = quant.dequantize(load_file(str(out))["model.layers.0.self_attn.q_proj.weight"])
    want = gguf.quants.dequantize(rows["blk.0.attn_q.weight"][1], gguf.GGMLQuantizationType.Q4_K)
    want = want.reshape(4, 8, 2, 256).swapaxes(1, 2).reshape(64, 256)  # llama.cpp's rotary order undone
    assert (q - torch.from_numpy(want)).abs().max() <= 2.0**-10 * abs(want).max()
