"""Loading a local Hugging Face Llama checkpoint: config, safetensors weights, special tokens.

Weights go straight to the target device and dtype: the model is built on the meta device, each
tensor is read by safetensors, cast on the CPU if needed, copied to the device, checked against the
shape the config implies, and assigned (`load_state_dict(assign=True)`), so there is never a second
full copy, and no tensor of the checkpoint's dtype on the device when it is cast.
Everything that can be wrong with a checkpoint raises `CheckpointError` naming the file and field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .gguf_blocks import QUANTIZED_FILE, read_formats
from .llama import Llama, ModelArgs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Buffers some older checkpoints saved; we recompute them, so they are skipped, not an error.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served; the message names the file and the field."""


def _read_json(path: Path, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: file not found (a Hugging Face checkpoint directory needs it)")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _field(cfg: dict, path: Path, name: str, kind: type, default=None):
    value = cfg.get(name, default)
    if value is None:
        raise CheckpointError(f"{path}: required field {name!r} is missing")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CheckpointError(f"{path}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def model_args_from_config(cfg: dict, path: Path) -> ModelArgs:
    """Validate a config.json dict and turn it into `ModelArgs`."""
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and cfg.get("model_type") not in ("llama", "mistral"):
        raise CheckpointError(
            f"{path}: field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: field 'hidden_act' is {act!r}; only 'silu' is supported")
    hidden = _field(cfg, path, "hidden_size", int)
    heads = _field(cfg, path, "num_attention_heads", int)
    max_pos = _field(cfg, path, "max_position_embeddings", int, 8192)
    window = cfg.get("sliding_window")
    if window is not None and window < max_pos:
        raise CheckpointError(
            f"{path}: field 'sliding_window' is {window}; sliding-window attention is "
            f"not supported (it must be null or >= max_position_embeddings {max_pos})"
        )
    # transformers 5 nests theta and scaling under `rope_parameters`; 4.x has them at top level.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"{path}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    try:
        return ModelArgs(
            vocab_size=_field(cfg, path, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_field(cfg, path, "intermediate_size", int),
            num_layers=_field(cfg, path, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_field(cfg, path, "num_key_value_heads", int, heads),
            head_dim=_field(cfg, path, "head_dim", int, hidden // heads if heads else 0),
            max_position_embeddings=max_pos,
            rms_norm_eps=_field(cfg, path, "rms_norm_eps", float, 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=None
            if scaling is None
            else tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (dict, list)))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def checkpoint_dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def resolve_dtype(
    requested: str | torch.dtype | None, cfg: dict, device: torch.device, cuda_bf16: bool | None = None
) -> torch.dtype:
    """A requested dtype wins. `auto` serves half precision on CUDA: a float32 checkpoint (every GGUF
    we convert is stored so) runs in bfloat16, or float16 on a GPU without bfloat16 (`cuda_bf16`;
    None: ask torch), at half the weight memory and twice the speed of float32; on the CPU it runs
    float32, whatever the checkpoint (CPU half matmuls are slow; the CPU path is for tests and
    development). The KV cache takes the model's dtype."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested not in (None, "auto"):
        if requested not in _DTYPES:
            raise CheckpointError(f"dtype {requested!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[requested]
    dtype = checkpoint_dtype(cfg) or torch.float32
    if device.type == "cpu":
        return torch.float32
    if device.type == "cuda" and dtype != torch.float16:
        bf16 = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        return torch.bfloat16 if bf16 else torch.float16
    return dtype


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the ones a sharded index names, or model.safetensors, or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (_read_json(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: field 'weight_map' is missing or empty")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: file not found (named by {index.name} 'weight_map')")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{model_dir}: no *.safetensors weights found (.bin/.pt checkpoints are not "
            "supported; convert them with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


_INITIALIZERS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "none")


@contextmanager
def _no_initial_values():
    """Modules built on the meta device hold no values, so torch's initializers have nothing to
    do; skipped. (Run anyway, the first one makes torch import its compiler stack, about 800
    modules and seconds in which loading shows no progress.)"""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: str | torch.dtype | None = "auto",
    load_format: str = "auto",
    progress: Callable[[], None] | None = None,
    cpu_kernels: bool = True,
    quantization: str = "none",
    quant_kernels=None,
) -> Llama:
    """Load a checkpoint directory onto `device` in `dtype`, ready for `forward` (setup done; on the
    CPU with the compiled kernels unless `cpu_kernels` is False, see `Llama.setup`).
    `load_format="dummy"` reads only config.json and makes random weights (dummy_weights.py).
    `quantization="auto"` serves the GGUF blocks of a converted GGUF (`gguf_blocks.py`) as they
    are where the fused CPU forward or the CUDA kernels run (`quant_kernels`: launchers on another
    executor, the CPU harness in tests); "none" serves the dequantized weights. `progress()`, if given, is called after each tensor is read."""
    from safetensors import SafetensorError, safe_open

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found")
    device = torch.device(device)
    config_path = model_dir / "config.json"
    cfg = _read_json(config_path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    args = model_args_from_config(cfg, config_path)
    dtype = resolve_dtype(dtype, cfg, device)
    if load_format == "dummy":
        from .dummy_weights import random_model

        return random_model(args, device, dtype, cpu_kernels=cpu_kernels)
    if load_format != "auto":
        raise CheckpointError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    # Blocks are kept where kernels read them: the fused CPU forward's, the CUDA kernels' (or the
    # harness's, `quant_kernels`); Llama.setup dequantizes them where it finds none.
    keep = device.type == "cuda" or quant_kernels is not None or (device.type == "cpu" and cpu_kernels)
    quantized = _read_quantized(model_dir) if quantization == "auto" and keep else {}

    with torch.device("meta"), _no_initial_values():
        model = Llama(args)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if args.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        try:
            # NOTE: read on the CPU and cast there, then copied once: a float32 checkpoint served in
            # bfloat16 never has a float32 tensor in GPU memory (an 8B model's embedding is 2 GB).
            with safe_open(str(f), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (args.tie_word_embeddings and name == "lm_head.weight"):
                        continue
                    if name in quantized:  # served from its blocks: the float copy is never read
                        continue
                    if name not in expected:
                        raise CheckpointError(
                            f"{f}: unexpected tensor {name!r} (not part of a Llama model "
                            f"with {args.num_layers} layers per config.json)"
                        )
                    shape = tuple(reader.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{f}: tensor {name!r} has shape {shape}, config.json implies "
                            f"{expected[name]} (check hidden_size, heads, head_dim, vocab_size)"
                        )
                    state[name] = reader.get_tensor(name).to(dtype).to(device)
                    if progress is not None:
                        progress()
        except SafetensorError as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    for name, blocks in quantized.items():
        rows, cols = expected.get(name, (0, 0))
        if blocks.shape[0] != rows or blocks.shape[1] * 32 != cols:
            raise CheckpointError(
                f"{model_dir / QUANTIZED_FILE}: tensor {name!r} holds blocks {tuple(blocks.shape)}, "
                f"config.json implies a [{rows}, {cols}] weight"
            )
    missing = sorted(set(expected) - set(state) - set(quantized))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{model_dir}: tensor {missing[0]!r}{more} missing from the safetensors files")
    model.load_state_dict(state, strict=not (args.tie_word_embeddings or quantized), assign=True)
    if args.tie_word_embeddings:
        model.tie_weights()
    model.quantized = quantized
    if quantized:  # {name: the GGUF format it was transcoded from} (gguf_blocks.TRANSCODED)
        model.transcoded = read_formats(model_dir / QUANTIZED_FILE, "ringserve_sources")
    model.eval().requires_grad_(False)
    model.setup(device, cpu_kernels=cpu_kernels, quant_kernels=quant_kernels)
    if progress is not None:
        progress()
    return model


def _read_quantized(model_dir: Path) -> dict[str, torch.Tensor]:
    """The GGUF blocks a conversion kept (`gguf_blocks.QUANTIZED_FILE`), by name; {} if none."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = model_dir / QUANTIZED_FILE
    if not path.is_file():
        return {}
    try:
        blocks = load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    for name, b in blocks.items():
        if b.dtype != torch.uint8 or b.dim() != 3:
            raise CheckpointError(f"{path}: tensor {name!r} is {b.dtype} {tuple(b.shape)}, not GGUF blocks")
    return blocks


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None
    eos_token_ids: frozenset[int]


def read_special_tokens(model_dir: str | Path) -> SpecialTokens:
    """BOS and the EOS set from generation_config.json and config.json, else tokenizer_config.json's
    token strings looked up in tokenizer.json (which must exist: the API workers tokenize with it)."""
    model_dir = Path(model_dir)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path}: file not found (the server tokenizes with it)")
    eos: set[int] = set()
    bos = None
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(model_dir / name, required=False) or {}
        value = cfg.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else value or [])
        bos = bos if bos is not None else cfg.get("bos_token_id")
    if not eos:
        tcfg = _read_json(model_dir / "tokenizer_config.json", required=False) or {}
        token = tcfg.get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            from tokenizers import Tokenizer

            tid = Tokenizer.from_file(str(tok_path)).token_to_id(token)
            if tid is None:
                raise CheckpointError(
                    f"{model_dir / 'tokenizer_config.json'}: field 'eos_token' {token!r} is not in tokenizer.json"
                )
            eos.add(tid)
    if not eos:
        raise CheckpointError(
            f"{model_dir}: no EOS token: set 'eos_token_id' in generation_config.json "
            f"or config.json, or 'eos_token' in tokenizer_config.json"
        )
    return SpecialTokens(bos_token_id=bos, eos_token_ids=frozenset(eos))
