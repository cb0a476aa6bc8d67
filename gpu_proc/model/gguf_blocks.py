"""A GGUF file's quantized tensors kept as blocks, for serving them quantized (`gpu_proc/quant.py`).

The conversion (`gguf_convert.py`) writes beside the dequantized `model.safetensors` a
`quantized.safetensors`: every tensor stored in a format the kernels read (`quant.BY_TYPE`), as
uint8 blocks `[N, K / 32, block_bytes]` under its Hugging Face name, in Hugging Face row order (the
q and k projections' rows are permuted back from llama.cpp's rotary order, as transformers does for
the float weights; a row permutation moves whole blocks). The safetensors metadata names each
tensor's format. Tensors of other formats (the K-quants, ...) are only in `model.safetensors`,
served dequantized. `dequantize` of a block tensor here equals its float tensor there exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..quant import BY_TYPE

QUANTIZED_FILE = "quantized.safetensors"

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
    for t in reader.tensors:
        fmt = BY_TYPE.get(int(t.tensor_type))
        name = hf_name(t.name)
        if fmt is None or name is None:
            continue
        rows = np.asarray(t.data)  # [N, row bytes]
        if rows.dtype != np.uint8 or rows.shape[1] % fmt.block_bytes:
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            rows = _unpermute_rotary(rows, heads if "q_proj" in name else kv_heads)
        blocks = rows.reshape(rows.shape[0], rows.shape[1] // fmt.block_bytes, fmt.block_bytes)
        tensors[name] = torch.from_numpy(np.array(blocks))  # a copy: the reader's map is read-only
        formats[name] = fmt.name
    if tensors:
        save_file(tensors, str(out), metadata={"format": "pt", "ringserve_formats": json.dumps(formats)})
    return formats


def read_formats(path: Path) -> dict[str, str]:
    """{name: format} of a quantized.safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as reader:
        return json.loads((reader.metadata() or {}).get("ringserve_formats", "{}"))
