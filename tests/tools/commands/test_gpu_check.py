"""`ringserve gpu-check` without a GPU: a run whose GPU tests skipped never reports ok, and the install
path of a lent device works from a venv holding only the device image's packages.

The device image is Python 3.12 with torch (CUDA 13), CuPy and a few more (`gpu_check_wheels.IMAGE`);
this box has Python 3.11, so the image is stood in for by a venv of this Python with those packages
(the pinned CPU torch for the CUDA one, cupy-cuda13x itself), built once per machine and cached
(~/.cache/ringserve/gpu-check-*). The test then does what a device run does: a fresh venv that sees
the image's packages (a .pth into the image venv, as an image's system site-packages), the wheels
`gpu-check --prepare` gathered (for 3.11 here, 3.12 for the device; cached too) installed offline,
this checkout installed with --no-deps, and `gpu-check --dry-run`: every module the GPU run needs
imports, and only then it stops with "no CUDA device".
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from ringserve.tools.commands import gpu_check
from ringserve.tools.harness.gpu_check_wheels import IMAGE, carried

REPO = Path(__file__).resolve().parents[3]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.mark.parametrize(
    "rc,tail,why",
    [
        (0, "12 passed in 30.1s", None),
        (0, "40 skipped in 2.0s", "no test passed"),
        (0, "30 passed, 10 skipped in 20.0s", "10 skipped: every GPU test must run"),
        (1, "3 failed, 9 passed in 20.0s", "pytest exited 1"),
        (5, "no tests ran in 0.01s", "pytest exited 5"),
    ],
)
def test_gpu_tests_are_ok_only_when_every_test_ran_and_passed(rc, tail, why):
    """A GPU-test run is ok only with tests passed, none skipped, pytest exiting 0."""
    got = gpu_check.tests_status(rc, "collected\n" + tail + "\n")
    assert got["status"] == ("ok" if why is None else "failed") and got.get("why") == why


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-CUDA behaviour")
def test_a_run_whose_gpu_tests_all_skip_is_a_failure():
    """Here every tests/gpu test skips (no CUDA): the section fails, it is never reported ok."""
    section = gpu_check.gpu_tests(timeout_s=300)
    assert section["status"] == "failed" and section["passed"] == 0 and section["skipped"] > 0, section["tail"]


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ringserve"


def _image_pins() -> list[str]:
    """The image's packages at the versions this environment has (torch: the pinned CPU build)."""
    pins = []
    for name in IMAGE:
        if name == "cupy-cuda13x":
            pins.append("cupy-cuda13x==14.2.0")
        else:
            pins.append(f"{name}=={md.version(name).split('+')[0]}")
    return pins


def _image_venv() -> Path:
    """A venv of this Python holding only the image's packages (built once, then reused)."""
    pins = _image_pins()
    home = _cache() / f"gpu-check-image-py{PY}-{hashlib.sha256(' '.join(pins).encode()).hexdigest()[:10]}"
    done = home / ".complete"
    if not done.exists():
        venv.create(home, with_pip=True, clear=True)
        cmd = [str(home / "bin" / "python"), "-m", "pip", "install", "-q", *pins]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        done.touch()
    return home


def _site_packages(env: Path) -> Path:
    return env / "lib" / f"python{PY}" / "site-packages"


@pytest.mark.timeout(1800)
def test_a_server_not_ready_in_time_reports_its_log(tiny_model_dir, tmp_path):
    """The load test's server writes to a file (a pipe nobody reads could fill and block it) and a
    start that runs past the limit says so with the log's tail: the H200 run's "server did not
    become ready" came with no log at all."""
    report = gpu_check.load_test(str(tiny_model_dir), str(tmp_path), timeout_s=2)
    assert report["status"] == "failed" and report["why"].startswith("server not ready after")
    assert "GPU process started" in report["tail"]


def test_dry_run_installs_offline_and_imports_everything_from_an_image_like_venv(tmp_path):
    """The device's install path, end to end: image packages only, carried wheels offline, the
    checkout with --no-deps, then `gpu-check --dry-run` imports all the GPU run needs and exits 2
    with "no CUDA device" only after that."""
    image = _image_venv()
    wheels = _cache() / f"gpu-check-wheels-py{PY}"
    proc = subprocess.run(
        [sys.executable, "-m", "ringserve.cli", "gpu-check", "--prepare", str(wheels), "--python-version", PY],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    assert {r.split("==")[0] for r in (wheels / "requirements.txt").read_text().split()} == set(carried(PY))

    device = tmp_path / "device-venv"
    venv.create(device, with_pip=True)
    (_site_packages(device) / "image.pth").write_text(str(_site_packages(image)) + "\n")
    python = str(device / "bin" / "python")
    before = subprocess.run([python, "-c", "import msgspec"], capture_output=True, text=True)
    assert before.returncode != 0, "the image stand-in must lack msgspec, or the test proves nothing"

    env = {**os.environ, "PYTHON": python}
    env.pop("VIRTUAL_ENV", None)
    out = tmp_path / "gpu-check.json"
    run = subprocess.run(
        ["bash", str(REPO / "tools" / "commands" / "device_check.sh"), str(wheels), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 2, text
    imported = text.index(f"imported the {len(gpu_check.GPU_RUN_MODULES)} modules the GPU run needs")
    assert imported < text.index("no CUDA device"), text
    where = subprocess.run(
        [python, "-c", "import ringserve, msgspec; print(ringserve.__file__)"], capture_output=True, text=True
    )
    assert where.stdout.strip().startswith(str(REPO)), where.stdout + where.stderr
