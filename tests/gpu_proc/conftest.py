"""Fixtures shared by the GPU-process tests."""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled CPU kernels, built on first use (tens of seconds once per machine, then cached).

    Skipped only where no C++ compiler exists; anywhere else a failed build fails the test, so a
    broken kernel build can never hide behind the torch reference fallback."""
    from ringserve.gpu_proc.cpu_ext import load_cpu_ops

    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    load_cpu_ops()
