"""Write GGUF files for tests: a Hugging Face Llama checkpoint (the tiny model) in llama.cpp's layout.

What llama.cpp's converter does for a Llama: tensors renamed (`blk.N.attn_q.weight`, ...), the q
and k projections' rows permuted from the Hugging Face rotary layout (halves) to llama.cpp's
(interleaved pairs), the config as `llama.*` metadata, and the byte-level BPE vocabulary as
`tokenizer.ggml.*` arrays with the chat template. Converting such a file back must give the
original checkpoint exactly (float32 tensors), which is what the GGUF tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _interleave_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotary layout [heads, 2 halves, d/2] -> llama.cpp's [heads, d/2, 2] per head's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def write_llama_gguf(
    model_dir: Path,
    path: Path,
    *,
    architecture: str = "llama",
    quant: str | None = None,
    overrides: dict[str, str | None] | None = None,
) -> Path:
    """`model_dir` (a Llama checkpoint with a byte-level BPE tokenizer.json) as the GGUF `path`.
    `quant` ("Q8_0", "Q4_1", ...) quantizes every matrix whose rows split into 32-weight blocks, as
    llama.cpp's quantizer does; `overrides` gives a tensor (by the end of its Hugging Face name,
    e.g. "k_proj.weight") another type, or None for float32."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny test llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    if "chat_template" in tok_cfg:
        w.add_chat_template(tok_cfg["chat_template"])

    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            t = _interleave_rotary(t, heads)
        elif name.endswith("k_proj.weight"):
            t = _interleave_rotary(t, kv_heads)
        kind = quant
        for suffix, other in (overrides or {}).items():
            kind = other if name.endswith(suffix) else kind
        t = np.ascontiguousarray(t, dtype=np.float32)
        if kind is not None and t.ndim == 2 and t.shape[1] % 32 == 0:
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), t)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
