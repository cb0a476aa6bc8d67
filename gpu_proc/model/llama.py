"""The Llama family (Llama 2 multi-head, Llama 3 / Mistral grouped-query) over a paged KV cache.

gpt-fast in shape: `ModelArgs`, `RMSNorm`, `Attention`, `FeedForward`, `TransformerBlock`, and a
flat token batch instead of `[batch, seq]`: the forward takes T new tokens from many sequences at
once with no padding, writes their keys and values into the KV pool and attends through each
sequence's block table (see `attention/reference.py`). Module names follow Hugging Face checkpoints
(`model.layers.0.self_attn.q_proj.weight`, ...) so a state dict loads without renaming.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from .. import cpu_ops
from ..attention import AttentionBackend, get_backend
from ..attention.metadata import AttentionMetadata
from ..kv_pool import KVPool
from ..lora import LoraStep
from ..quant import Q8_0, QuantLinear, as_q8_0, dequantize, embedding, format_of


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """The architecture numbers a forward needs, read from a checkpoint's config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # items of the config's dict
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_inv_freq(self, torch.device("cpu"))  # fail now on an unsupported scaling type


def rope_inv_freq(args: ModelArgs, device: torch.device) -> torch.Tensor:
    """Rotary inverse frequencies `[head_dim / 2]`, with Llama 3 or linear scaling when configured."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if args.rope_scaling is None:
        return inv_freq
    cfg = dict(args.rope_scaling)
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / _number(cfg, "factor")
    if kind == "llama3":
        factor = _number(cfg, "factor")
        low, high = _number(cfg, "low_freq_factor"), _number(cfg, "high_freq_factor")
        old_ctx = _number(cfg, "original_max_position_embeddings")
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _fuse(projs: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the projections' weights (and biases) along the output dimension and point
    each projection's parameters at its slice, so the fused and the separate weights share memory."""
    weight = torch.cat([p.weight for p in projs])
    bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
    lo = 0
    for p in projs:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(weight[lo : lo + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[lo : lo + n], requires_grad=False)
        lo += n
    return weight, bias


Projection = cpu_ops.PackedLinear | QuantLinear


def _projection(projs: tuple[nn.Linear, ...], blocks: dict[nn.Module, torch.Tensor]) -> Projection:
    """The projections as one weight for the CPU matmul: their GGUF blocks concatenated when all
    of them are held quantized in one format (`quant.QuantLinear`; `Llama._one_format_per_group`
    makes a mixed group one), else the float weights fused and packed (`_fuse`), dequantizing any
    that were held quantized."""
    held = [blocks.get(p) for p in projs]
    if all(b is not None for b in held) and len({b.shape[2] for b in held if b is not None}) == 1:
        bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
        return QuantLinear(torch.cat([b for b in held if b is not None]), bias)
    for p, b in zip(projs, held):
        if b is not None:
            p.weight = nn.Parameter(dequantize(b).to(p.weight.dtype), requires_grad=False)
    if len(projs) == 1:
        return cpu_ops.PackedLinear(projs[0].weight, projs[0].bias)
    return cpu_ops.PackedLinear(*_fuse(projs))


def _set_rows(projs: tuple[nn.Linear, ...], weight: torch.Tensor) -> None:
    """The projections' weights as consecutive row ranges of `weight` (an unfused `_projection`)."""
    lo = 0
    for p in projs:
        n = p.out_features
        p.weight = nn.Parameter(weight[lo : lo + n].contiguous(), requires_grad=False)
        lo += n


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over repacked GGUF blocks `[vocab, hidden / 32, bytes]` (`quant.repack`,
    shared with a tied head): the rows a step reads, dequantized (the dequantized checkpoint's
    embedding, bit for bit)."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed, self.dtype = packed, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embedding(self.packed, input_ids).to(self.dtype)


def _number(cfg: dict[str, object], name: str) -> float:
    value = cfg.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"rope_scaling field {name!r} must be a number, got {value!r}")
    return float(value)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementation does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, head_dim]`, cos/sin `[T, head_dim]` (the non-interleaved "rotate half" form)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [T, 1, head_dim]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(h, args.num_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, h, bias=bias)
        self.scale = args.head_dim**-0.5
        self.qkv: Projection | None = None  # set by fuse_projections
        self.o: Projection | None = None

    def fuse_projections(self, blocks: dict[nn.Module, torch.Tensor]) -> tuple[Projection, Projection]:
        """One `[(heads + 2 kv_heads) * head_dim, hidden]` weight for q, k and v (the three
        projections keep their names, so state dicts are unchanged, as views into it), and the
        projections packed for the CPU matmul, or read from their GGUF `blocks`: (qkv, o)."""
        self.qkv = qkv = _projection((self.q_proj, self.k_proj, self.v_proj), blocks)
        self.o = o = _projection((self.o_proj,), blocks)
        return qkv, o

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        lora: LoraStep | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:  # the adapters' deltas on the fused q|k|v output, as the fused block adds them
            qkv = torch.cat((q, k, v), dim=1)
            lora.delta(layer, "qkv", x, qkv)
            q, k, v = qkv.split((q.shape[1], k.shape[1], v.shape[1]), dim=1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = backend.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, head_dim]
        o = o.reshape(t, self.num_heads * self.head_dim)
        y = self.o_proj(o)
        if lora is not None:
            lora.delta(layer, "o", o, y)
        return y


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up: Projection | None = None  # set by fuse_projections
        self.down: Projection | None = None

    def fuse_projections(self, blocks: dict[nn.Module, torch.Tensor]) -> tuple[Projection, Projection]:
        """One `[2 * intermediate, hidden]` weight for gate and up (views keep the old names),
        packed for the CPU matmul like down_proj, or read from their GGUF `blocks`: (gate_up, down)."""
        self.gate_up = gate_up = _projection((self.gate_proj, self.up_proj), blocks)
        self.down = down = _projection((self.down_proj,), blocks)
        return gate_up, down

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None, layer: int = 0) -> torch.Tensor:
        if lora is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=1)
        lora.delta(layer, "gate_up", x, gate_up)
        gate, up = gate_up.chunk(2, dim=1)
        act = F.silu(gate) * up
        y = self.down_proj(act)
        lora.delta(layer, "down", act, y)
        return y


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x, cos, sin, meta, k_cache, v_cache, backend, lora=None, layer=0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache, backend, lora, layer)
        return x + self.mlp(self.post_attention_layernorm(x), lora, layer)


class Transformer(nn.Module):
    """Embedding, blocks and final norm: the `model.` prefix of a checkpoint."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Llama(nn.Module):
    """A Llama causal LM whose forward runs one flat step against a `KVPool`.

    Build on the meta device, load weights with `load_state_dict(..., assign=True)`, then call
    `setup(device)` once to create the rotary tables and pick the attention backend.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.backend: AttentionBackend | None = None
        self.fused = False
        self.packed_head: Projection | None = None  # the fused CPU forward's lm_head
        # GGUF blocks of weights served quantized (name -> blocks, `quant.py`), set by the loader;
        # their parameters stay on the meta device unless setup has to dequantize them.
        self.quantized: dict[str, torch.Tensor] = {}
        self.quantized_formats: dict[str, int] = {}  # served blocks: tensors per format (set by setup)
        self.transcoded: dict[str, str] = {}  # {name: the GGUF format its blocks were transcoded from}
        self.served_blocks: list[torch.Tensor] = []  # the repacked blocks the forward reads
        self.device_blocks: list[torch.Tensor] = []  # blocks as stored, read by quant_kernels' modules
        self.quant_kernels = None  # quant_cuda.QuantKernels of the device blocks
        self.block_weights: list[tuple] = []  # per block, cpu_ops.BlockWeights.args()
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def setup(
        self,
        device: torch.device | str,
        backend: AttentionBackend | None = None,
        cpu_kernels: bool = True,
        quant_kernels=None,
    ) -> None:
        """Rotary tables for every position up to max_position_embeddings, and the attention backend.

        GGUF blocks are served where kernels read them: repacked for the fused CPU forward, as
        stored on the device by `quant_kernels` (`quant_cuda.QuantKernels`; on CUDA with the CuPy
        attention kernels, CuPy's by default) for the module forward; else dequantized.

        With the compiled CPU backend (`attention/cpu_backend.py`) the forward also runs fused, one
        compiled call per block (`cpu_ops.block`): one matmul for q/k/v and one for gate/up (the
        separate weights become views into the concatenated ones), every projection's weight packed
        once for oneDNN. NOTE: the packed copies double the projections' weight memory (the plain
        weights stay, for state dicts and the reference path)."""
        device = torch.device(device)
        inv_freq = rope_inv_freq(self.args, device)
        pos = torch.arange(self.args.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.rope_cos, self.rope_sin = emb.cos().contiguous(), emb.sin().contiguous()
        self.backend = backend or get_backend(device, self.dtype, cpu_kernels=cpu_kernels)
        # The fused forward runs oneDNN-packed matmuls: only where oneDNN packs this dtype here.
        fused = self.backend.name == "cpu" and cpu_ops.packs(self.dtype)
        if quant_kernels is None and self.backend.name != "reference":
            if self.quant_kernels is not None:  # a second setup (the checked backend) keeps them
                quant_kernels = self.quant_kernels
            elif device.type == "cuda" and self.backend.name.startswith("cupy"):
                from ..quant_cuda import default_kernels

                quant_kernels = default_kernels()
        if not fused:  # the fused CPU forward reads repacked blocks; the CUDA kernels the blocks as stored
            self._dequantize_served()
            if quant_kernels is not None and self.quantized:
                from ..quant_cuda import serve_on_device

                self.quant_kernels, self.device_blocks = quant_kernels, serve_on_device(self, quant_kernels)
            elif quant_kernels is None and self.device_blocks:
                self.dequantize_device_blocks()
            if self.quantized:
                self._dequantize_all()
            self.fused, self.packed_head = False, None
        elif not self.served_blocks:  # NOTE: blocks are repacked once; a second setup keeps them
            self.fused, self.packed_head = True, None
            self._setup_fused()

    def _setup_fused(self) -> None:
        """The blocks of the fused forward: projections packed (or their GGUF blocks concatenated
        and repacked, `_projection`), the embedding and head read from blocks where they are held
        so (one repacked copy when tied). `quantized` is emptied: the forward holds the blocks."""
        self._one_format_per_group()
        modules = dict(self.named_modules())
        blocks = {modules[n.removesuffix(".weight")]: b for n, b in self.quantized.items()}
        self.block_weights = [
            self._block_weights(cast(TransformerBlock, layer), blocks).args() for layer in self.model.layers
        ]
        embed = self.quantized.get("model.embed_tokens.weight")
        head = self.quantized.get("lm_head.weight", embed if self.args.tie_word_embeddings else None)
        self.packed_head = QuantLinear(head) if head is not None else _projection((self.lm_head,), blocks)
        if embed is not None:
            tied = head is embed and isinstance(self.packed_head, QuantLinear)
            packed = cast(torch.Tensor, self.packed_head.packed) if tied else QuantLinear(embed).packed
            self.model.embed_tokens = QuantEmbedding(packed, self.dtype)  # type: ignore[assignment]
        served = [w[3] for w in self.block_weights] + [w[5] for w in self.block_weights]
        served += [w[7] for w in self.block_weights] + [w[9] for w in self.block_weights]
        served += [self.packed_head.packed]
        if embed is not None:
            served.append(cast(QuantEmbedding, self.model.embed_tokens).packed)
        self.served_blocks = [t for t in served if t is not None and t.dtype == torch.uint8]
        for b in self.quantized.values():
            name = format_of(b).name
            self.quantized_formats[name] = self.quantized_formats.get(name, 0) + 1
        self.quantized = {}  # the originals: the repacked copies above replace them

    def _one_format_per_group(self) -> None:
        """A fusion group (q/k/v, gate/up) held in blocks of mixed formats, such as a Q4_K_M file's
        Q5_0 q and k beside a Q8_0 v, held as Q8_0 (`quant.as_q8_0`, exact but for Q4_1 / Q5_1):
        one kernel call reads one format, and Q8_0 blocks are a quarter of the float weights."""
        groups = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
        for i in range(self.args.num_layers):
            for group in groups:
                names = [f"model.layers.{i}.{g}.weight" for g in group]
                held = [self.quantized.get(n) for n in names]
                if any(b is None for b in held) or len({b.shape[2] for b in held if b is not None}) == 1:
                    continue
                for name, b in zip(names, held):
                    if b is not None and format_of(b) is not Q8_0:
                        self.transcoded.setdefault(name, format_of(b).name)
                        self.quantized[name] = as_q8_0(b)

    def _dequantize_served(self) -> None:
        """The blocks a fused setup serves, back as float parameters (a later setup on a backend
        that does not run fused: `--attention-backend reference`, a failed kernel check)."""
        if not self.served_blocks:
            return
        for layer in self.model.layers:
            a, m = cast(TransformerBlock, layer).self_attn, cast(TransformerBlock, layer).mlp
            groups = (
                ((a.q_proj, a.k_proj, a.v_proj), a.qkv),
                ((a.o_proj,), a.o),
                ((m.gate_proj, m.up_proj), m.gate_up),
                ((m.down_proj,), m.down),
            )
            for projs, lin in groups:
                if isinstance(lin, QuantLinear):
                    _set_rows(projs, self._rows(lin.packed))
        embed = self.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            self.model.embed_tokens = nn.Embedding(self.args.vocab_size, self.args.hidden_size)
            self.model.embed_tokens.weight = nn.Parameter(self._rows(embed.packed), requires_grad=False)
        if isinstance(self.packed_head, QuantLinear) and not self.args.tie_word_embeddings:
            _set_rows((self.lm_head,), self._rows(self.packed_head.packed))
        if self.args.tie_word_embeddings:
            self.tie_weights()
        self.served_blocks, self.quantized_formats = [], {}

    def dequantize_device_blocks(self) -> None:
        """The device blocks' layers back as float layers (a failed quantized-kernel check)."""
        from ..quant_cuda import dequantize_on_device

        dequantize_on_device(self)
        self.device_blocks, self.quant_kernels = [], None

    def _rows(self, packed: torch.Tensor) -> torch.Tensor:
        return embedding(packed, torch.arange(packed.shape[0])).to(self.dtype)

    def _dequantize_all(self) -> None:
        for name, b in self.quantized.items():
            module = self.get_submodule(name.removesuffix(".weight"))
            module.weight = nn.Parameter(dequantize(b).to(self.dtype).to(self.device), requires_grad=False)
        if self.args.tie_word_embeddings:
            self.tie_weights()
        self.quantized = {}

    def weights_served(self) -> dict:
        """What /health and the model card say of the weights: `quantization` "gguf" (some served
        as their blocks) or "none", the blocks' formats with their tensor counts, the GGUF formats
        some were transcoded from (with counts), and the dtype of everything else."""
        formats = dict(self.quantized_formats)
        dtype = str(self.dtype).removeprefix("torch.")
        transcoded = dict(Counter(self.transcoded.values())) if formats else {}
        served = {"quantization": "gguf" if formats else "none", "formats": formats, "dtype": dtype}
        return served | ({"transcoded_from": transcoded} if transcoded else {})

    @property
    def quantized_bytes(self) -> int:
        """Bytes of the weights held as GGUF blocks (a tied embedding and head counted once)."""
        held = self.served_blocks + self.device_blocks
        storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in held}
        return sum(storages.values()) + sum(b.numel() for b in self.quantized.values())

    def _block_weights(self, layer: TransformerBlock, blocks: dict[nn.Module, torch.Tensor]) -> cpu_ops.BlockWeights:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = attn.fuse_projections(blocks)
        gate_up, down = mlp.fuse_projections(blocks)
        return cpu_ops.BlockWeights(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            self.args.rms_norm_eps,
            qkv,
            o,
            gate_up,
            down,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.scale,
        )

    # NOTE: read from the final norm, never held quantized (the head's weight may be on meta)
    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVPool,
        logits_indices: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Run T new tokens; return float32 logits `[R, vocab]` for the tokens at `logits_indices`
        (`lora`: the step's adapter rows, `lora.py`)."""
        return self.head(self.final_hidden(input_ids, meta, kv_pool, logits_indices, lora))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits `[R, vocab]` of final hidden states `h` `[R, hidden]`."""
        if self.packed_head is not None:
            return self.packed_head(h).float()
        return self.lm_head(h).float()

    def final_hidden(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVPool,
        indices: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Run T new tokens; return the final norm's output `[R, hidden]` for the tokens at
        `indices` (what the head reads, and what an embedding pools)."""
        if self.backend is None or self.rope_cos is None or self.rope_sin is None:
            raise RuntimeError("Llama.setup(device) must run before the first forward")
        if self.packed_head is not None:  # the fused CPU forward (setup packed it)
            return self._hidden_fused(input_ids, meta, kv_pool, indices, self.rope_cos, self.rope_sin, lora)
        cos, sin = self.rope_cos[meta.positions], self.rope_sin[meta.positions]  # [T, head_dim]
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_pool.k[i], kv_pool.v[i], self.backend, lora, i)
        # The final norm (and the head) only for tokens that sample: a prefill chunk needs one row.
        return self.model.norm(x[indices])  # [R, hidden]

    def _hidden_fused(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_pool: KVPool,
        indices: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """`final_hidden` with the CPU kernels: the same math, each block in one compiled call
        (`cpu_ops.block`). The residual stream is carried beside the block output so each add is
        fused into the next norm. The first block's inputs are checked; the others have the same
        shapes, dtypes and strides."""
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, weights in enumerate(self.block_weights):
            step = (meta.positions, rope_cos, rope_sin, meta.slot_mapping, kv_pool.k[i], kv_pool.v[i], meta)
            rows = (lora.args(i), lora.rows, lora.slots) if lora is not None else ([], (), ())
            x, residual = cpu_ops.block(x, residual, weights, step, check=i == 0, lora=rows)
        if residual is None:
            raise RuntimeError("a model without layers has no residual stream")
        # NOTE: always gathered, even when there are as many indices as tokens: scored prompt
        # positions follow the sampling rows, so the order can differ from the tokens'.
        x, residual = x[indices], residual[indices]
        return cpu_ops.add_rms_norm_(x, residual, self.model.norm.weight, self.args.rms_norm_eps)  # [R, hidden]
