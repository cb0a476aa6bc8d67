"""The wheels a lent GPU box lacks: found here, carried in a folder, installed there offline.

The device image has Python 3.12, torch with CUDA 13, cupy-cuda13x, aiohttp, uvloop, transformers,
tokenizers, jinja2, psutil and prometheus-client (IMAGE), and no network. What the GPU run needs
beyond that is the closure of ringserve's requirements and the test tools the `tests/gpu` section
runs (RUN_TOOLS), less everything the image's packages already bring: computed from the metadata
of this machine's environment (every one of those packages is installed here), pinned to the
versions installed here, and downloaded for the device's Python and platform with `--no-deps`
(so no resolver ever pulls a CUDA torch). `requirements.txt` in the folder names them;
`install` installs exactly those, offline.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

IMAGE = (
    "torch",
    "cupy-cuda13x",
    "aiohttp",
    "uvloop",
    "transformers",
    "tokenizers",
    "jinja2",
    "psutil",
    "prometheus-client",
)
# What `gpu-check` runs beyond the package: pytest for tests/gpu (tests/conftest.py imports hypothesis;
# the LoRA tests make their adapters with PEFT).
RUN_TOOLS = ("pytest", "pytest-timeout", "hypothesis", "peft")
# What `pip install --no-build-isolation -e .` builds the checkout with (a Python 3.12 venv has
# neither), carried whatever the image has.
BUILD_TOOLS = ("setuptools", "wheel")
# NOTE: the device's glibc takes manylinux up to 2_39; llguidance ships 2_31 wheels only.
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
REQUIREMENTS = "requirements.txt"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(roots, environment: dict, skip_missing: bool = False) -> dict[str, str]:
    """name -> installed version of `roots` and everything they require (markers evaluated for
    `environment`, extras ignored)."""
    seen: dict[str, str] = {}
    todo = [_norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if skip_missing:
                continue
            raise RuntimeError(f"{name} is not installed here, so its wheel cannot be pinned (make install)") from None
        seen[name] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({**environment, "extra": ""}):
                continue
            todo.append(_norm(req.name))
    return seen


def _environment(python_version: str) -> dict:
    env = dict(default_environment())
    env.update(python_version=python_version, python_full_version=f"{python_version}.0", sys_platform="linux")
    return env


def carried(python_version: str = "3.12") -> dict[str, str]:
    """The packages to carry: what the run needs, less what the image (and its dependencies) has.
    The image's CUDA-only packages are not installed here; their dependencies count as present."""
    env = _environment(python_version)
    needs = _closure(["ringserve", *RUN_TOOLS], env)
    image = _closure([*IMAGE, "cupy-cuda12x"], env, skip_missing=True)
    wanted = {n: v for n, v in needs.items() if n not in image and n != "ringserve"}
    wanted.update((n, md.version(n)) for n in BUILD_TOOLS)  # their own needs are the image's
    return dict(sorted(wanted.items()))


def prepare(dest: Path, python_version: str = "3.12") -> list[str]:
    """Download the carried wheels for `python_version` on manylinux x86-64 into `dest` (files
    already there are kept) and write its requirements.txt; returns the pinned requirements."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={v}" for n, v in carried(python_version).items()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    proc = subprocess.run([*cmd, *pins], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    (dest / REQUIREMENTS).write_text("\n".join(pins) + "\n")
    return pins


def install(wheels: Path) -> str:
    """Install the carried wheels offline into this interpreter (nothing from an index, no other
    package touched); returns pip's output."""
    reqs = wheels / REQUIREMENTS
    if not reqs.is_file():
        raise RuntimeError(f"{reqs}: not found (make the folder with `ringserve gpu-check --prepare {wheels}`)")
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(wheels)]
    proc = subprocess.run([*cmd, "-r", str(reqs)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"offline install failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout
