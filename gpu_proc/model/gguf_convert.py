"""A GGUF file (llama.cpp's format) -> a Hugging Face checkpoint directory the loader serves.

transformers' GGUF loader does the format work: it dequantizes every tensor (Q4_1, Q8_0, ...),
undoes llama.cpp's rotary row permutation of the q/k projections, renames the tensors, and
rebuilds the tokenizer and the chat template from the file's metadata. This module checks the
architecture first (`read_gguf_header`, a few bytes, so a wrong file fails in milliseconds with
what it is), then writes what `loader.py` and the API workers read:

    model.safetensors       every tensor in the stored dtype (float32 unless asked otherwise)
    quantized.safetensors   the tensors in a format the CPU kernels read, as their GGUF blocks
                            (`gguf_blocks.py`; served unless `--quantization none`)
    config.json             LlamaConfig, without the quantization entry
    tokenizer.json          the fast tokenizer built from the GGUF vocabulary
    tokenizer_config.json   special tokens and the chat template
    generation_config.json  BOS / EOS / pad ids
    ringserve-model.json    the marker, written last (`ringserve.models.is_converted`)

Why float32 by default: dequantized Q4_1 / Q8_0 weights are an fp16 scale times a small integer
(plus an fp16 offset), computed in float32; most of them are not representable in bfloat16 or
float16, so storing half precision would round them a second time, and the CPU path serves
float32 anyway. A CUDA deployment of a large GGUF can store bfloat16 (`--dtype`) to halve the disk.

Everything is written into a temporary sibling directory that is renamed into place at the end,
so an interrupted conversion never leaves a directory that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ringserve.models import CONVERSION_FORMAT, MARKER

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral")
STORE_DTYPES = ("float32", "bfloat16", "float16")
_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types: fixed sizes by type id (8: string, 9: array are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    """The file cannot be converted; the message names the file and what was found."""


@dataclass(frozen=True)
class GgufHeader:
    version: int
    tensor_count: int
    architecture: str | None
    name: str | None


def read_gguf_header(path: Path) -> GgufHeader:
    """The GGUF version, tensor count, `general.architecture` and `general.name`, read from the
    metadata without touching the tensors (both keys come first in files llama.cpp writes)."""
    wanted: dict[str, str | None] = {"general.architecture": None, "general.name": None}
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise GgufError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF')")
        (version,) = struct.unpack("<I", _read(f, 4, path))
        if version not in (2, 3):
            raise GgufError(f"{path}: GGUF version {version}; versions 2 and 3 are supported")
        tensor_count, kv_count = struct.unpack("<QQ", _read(f, 16, path))
        for _ in range(kv_count):
            key = _read_string(f, path)
            (kind,) = struct.unpack("<I", _read(f, 4, path))
            if key in wanted and kind == _STRING:
                wanted[key] = _read_string(f, path)
                if all(v is not None for v in wanted.values()):
                    break
            else:
                _skip_value(f, kind, path)
    return GgufHeader(version, tensor_count, wanted["general.architecture"], wanted["general.name"])


def _read(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GgufError(f"{path}: truncated GGUF metadata")
    return data


def _read_string(f: BinaryIO, path: Path) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8, path))
    return _read(f, n, path).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, kind: int, path: Path) -> None:
    if kind in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[kind], os.SEEK_CUR)
    elif kind == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8, path))
        f.seek(n, os.SEEK_CUR)
    elif kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", _read(f, 12, path))
        if item_kind in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[item_kind] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item_kind, path)
    else:
        raise GgufError(f"{path}: unknown GGUF metadata value type {kind}")


def check_architecture(path: Path) -> GgufHeader:
    header = read_gguf_header(path)
    if header.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        name = f" ({header.name})" if header.name else ""
        raise GgufError(
            f"{path}: a GGUF of architecture {header.architecture!r}{name}; ringserve serves "
            f"Llama-family models (GGUF general.architecture "
            f"{' or '.join(map(repr, SUPPORTED_GGUF_ARCHITECTURES))})"
        )
    return header


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    source: dict | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """Convert `gguf_path` into the checkpoint directory `out_dir` (replaced if it exists).

    `source` is recorded in the marker (where the file came from); `say` gets one line per phase.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .gguf_blocks import QUANTIZED_FILE, write_quantized

    if dtype not in STORE_DTYPES:
        raise GgufError(f"dtype {dtype!r}: choose one of {', '.join(STORE_DTYPES)}")
    gguf_path, out = Path(gguf_path), Path(out_dir)
    header = check_architecture(gguf_path)
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # transformers reads a GGUF as (directory, file name); a directory holding only a link to
        # it keeps any config.json or tokenizer.json lying beside the file out of the picture.
        link_dir = work / "source"
        link_dir.mkdir()
        (link_dir / "model.gguf").symlink_to(gguf_path.resolve())
        say(f"reading the tokenizer and chat template from {gguf_path.name}")
        tokenizer = AutoTokenizer.from_pretrained(str(link_dir), gguf_file="model.gguf")
        say(f"dequantizing {header.tensor_count} tensors to {dtype}")
        model = AutoModelForCausalLM.from_pretrained(str(link_dir), gguf_file="model.gguf")
        config = model.config.to_dict()
        tensors = _state_dict(model, getattr(torch, dtype), gguf_path, tied=bool(config.get("tie_word_embeddings")))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        say(f"writing model.safetensors ({size / 2**20:.0f} MiB)")
        save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
        del model, tensors
        kept = write_quantized(gguf_path, work / QUANTIZED_FILE)
        if kept:
            say(f"kept {len(kept)} tensors as GGUF blocks ({', '.join(sorted(set(kept.values())))})")
        _write_config(
            work,
            config,
            type_name="LlamaForCausalLM" if header.architecture == "llama" else "MistralForCausalLM",
            dtype=dtype,
        )
        _write_tokenizer(work, tokenizer, config)
        shutil.rmtree(link_dir)
        _write_json(
            work / MARKER,
            {
                "format": CONVERSION_FORMAT,
                "dtype": dtype,
                "architecture": header.architecture,
                "name": header.name,
                "source": source or {"path": str(gguf_path.resolve())},
                "converted_s": round(time.monotonic() - started, 1),
            },
        )
        _make_readable(work)
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _state_dict(model, dtype, path: Path, *, tied: bool) -> dict:
    """The model's tensors in `dtype`, refusing anything still packed in GGUF blocks."""
    out = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # the loader ties it back to the embedding
        if not t.is_floating_point():
            raise GgufError(
                f"{path}: transformers left tensor {name!r} quantized ({t.dtype}); "
                "this transformers version cannot dequantize the file"
            )
        out[name] = t.detach().to(dtype).contiguous()
    return out


def _write_config(work: Path, config: dict, *, type_name: str, dtype: str) -> None:
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "_commit_hash",
        "transformers_version",
        "id2label",
        "label2id",
    ):
        config.pop(key, None)
    config["architectures"] = [type_name]
    config["dtype"] = config["torch_dtype"] = dtype  # transformers 5 reads dtype, 4.x torch_dtype
    _write_json(work / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    _write_json(work / "generation_config.json", generation)


def _write_tokenizer(work: Path, tokenizer, config: dict) -> None:
    tokenizer.backend_tokenizer.save(str(work / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings"),
    }
    for name, token in tokenizer.special_tokens_map.items():
        if isinstance(token, str):
            tokenizer_config[name] = token
    if tokenizer.chat_template is not None:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    _write_json(work / "tokenizer_config.json", tokenizer_config)


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a model cache is as readable as the umask
    allows, like any file the user writes (a service user may serve it)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for f in directory.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
