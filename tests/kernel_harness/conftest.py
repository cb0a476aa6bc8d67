"""The harness suite runs a quick matrix by default (`make test`); `make kernel-check` sets
RINGSERVE_KERNEL_CHECK=full for the full matrix and the planted-bug check."""

from __future__ import annotations

import os
import shutil

import pytest

FULL = os.environ.get("RINGSERVE_KERNEL_CHECK") == "full"


def pick(quick: list, full: list) -> list:
    """The quick cases, plus the full ones under `make kernel-check`."""
    return quick + full if FULL else quick


def pytest_collection_modifyitems(config, items):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        skip = pytest.mark.skip(reason="the kernel harness needs g++ (x86-64)")
        for item in items:
            if "kernel_harness" in str(item.fspath):
                item.add_marker(skip)
