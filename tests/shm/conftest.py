"""Fixtures for the shared-memory tests: a private segment directory on tmpfs."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm, so segments live on tmpfs but never clash with others."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs when there is one
    path = tempfile.mkdtemp(prefix="ringserve-test-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)
