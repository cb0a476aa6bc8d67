"""A GGUF file's quantized tensors kept as blocks, for serving them quantized (`gpu_proc/quant.py`).

The conversion (`gguf_convert.py`) writes beside the dequantized `model.safetensors` a
`quantized.safetensors`: every tensor stored in a format the kernels read (`quant.BY_TYPE`), as
uint8 blocks `[N, K / 32, block_bytes]` under its Hugging Face name, in Hugging Face row order (the
q and k projections' rows are permuted back from llama.cpp's rotary order, as transformers does for
the float weights; a row permutation moves whole blocks). The safetensors metadata names each
tensor's format, and for a transcoded one the format it came from.

Formats the kernels do not read are transcoded to one they do (`TRANSCODED`), kept quantized:
Q4_K's sub-blocks of 32 are Q4_1 blocks (w = d sc n - dmin m: the same nibbles, the scale d sc and
offset -dmin m rounded to fp16, a relative 2^-11 of each), and Q5_K and Q6_K are requantized to
Q8_0 (per 32 weights, as llama.cpp's quantizer does: an error of at most half a step of 1/127 of
a block's largest weight and the fp16 rounding of that step, where their own steps are 1/31 of a
range or coarser). For the kernels' own formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), `dequantize` of a
block tensor here equals its float tensor there exactly; for a transcoded one it is within those
bounds. Other formats (Q2_K, Q3_K, the IQ ones) are only in `model.safetensors`, served
dequantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..quant import BLOCK, BY_TYPE, Q4_1, Q8_0, QuantFormat

QUANTIZED_FILE = "quantized.safetensors"

# GGML type -> (its name, the kernel format it is served as)
TRANSCODED = {12: ("Q4_K", Q4_1), 13: ("Q5_K", Q8_0), 14: ("Q6_K", Q8_0)}
_Q4_K = 12

_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor that can be held quantized, else None."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.weight"
    return None


def _unpermute_rotary(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row order (interleaved pairs per head) back to Hugging Face's (halves)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def transcode(ggml_type: int, rows: np.ndarray) -> tuple[QuantFormat, np.ndarray]:
    """A tensor's raw rows `[N, row bytes]` in a `TRANSCODED` format -> (the kernel format, its
    blocks `[N, K / 32, block bytes]`)."""
    import gguf

    name, fmt = TRANSCODED[ggml_type]
    qtype = getattr(gguf.GGMLQuantizationType, name)
    n = rows.shape[0]
    if ggml_type == _Q4_K:  # block: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        supers = rows.reshape(-1, 144)
        d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = gguf.quants.Q4_K.get_scale_min(supers[:, 4:16])
        # 4 runs of 32 bytes: low nibbles are sub-block 2j, high ones 2j+1
        qs = supers[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        nib = (qs & 0x0F).reshape(-1, 8, BLOCK)
        blocks = np.empty((supers.shape[0], 8, fmt.block_bytes), dtype=np.uint8)
        blocks[..., 0:2] = (d * sc.astype(np.float32)).astype(np.float16)[..., None].view(np.uint8)
        blocks[..., 2:4] = (-(dmin * mins.astype(np.float32))).astype(np.float16)[..., None].view(np.uint8)
        blocks[..., 4:] = nib[..., :16] | (nib[..., 16:] << 4)  # Q4_1: weights 0-15 low, 16-31 high
        return fmt, blocks.reshape(n, -1, fmt.block_bytes)
    values = gguf.quants.dequantize(rows, qtype)  # float32 [N, K]
    raw = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    return fmt, raw.reshape(n, -1, fmt.block_bytes)


def write_quantized(gguf_path: Path, out: Path) -> dict[str, str]:
    """Write `out` (a safetensors file) with the quantized tensors of `gguf_path`; returns
    {name: format} of what it wrote (empty: nothing in a kernel format, and no file written)."""
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    heads = int(reader.fields[f"{arch}.attention.head_count"].parts[-1][0])
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    kv_heads = int(kv_field.parts[-1][0]) if kv_field is not None else heads
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    sources: dict[str, str] = {}
    for t in reader.tensors:
        kind, name = int(t.tensor_type), hf_name(t.name)
        if name is None or (kind not in BY_TYPE and kind not in TRANSCODED):
            continue
        rows = np.asarray(t.data)  # [N, row bytes]
        if rows.dtype != np.uint8 or rows.ndim != 2:
            continue
        if kind in TRANSCODED:
            fmt, blocks = transcode(kind, rows)
            sources[name] = TRANSCODED[kind][0]
        else:
            fmt = BY_TYPE[kind]
            if rows.shape[1] % fmt.block_bytes:
                continue
            blocks = rows.reshape(rows.shape[0], rows.shape[1] // fmt.block_bytes, fmt.block_bytes)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            blocks = _unpermute_rotary(blocks, heads if "q_proj" in name else kv_heads)
        tensors[name] = torch.from_numpy(np.array(blocks))  # a copy: the reader's map is read-only
        formats[name] = fmt.name
    if tensors:
        meta = {"format": "pt", "ringserve_formats": json.dumps(formats), "ringserve_sources": json.dumps(sources)}
        save_file(tensors, str(out), metadata=meta)
    return formats


def read_formats(path: Path, key: str = "ringserve_formats") -> dict[str, str]:
    """{name: format} of a quantized.safetensors file (key "ringserve_sources": {name: the GGUF
    format it was transcoded from}, for those that were)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as reader:
        return json.loads((reader.metadata() or {}).get(key, "{}"))
