"""Fixtures for the shared-memory tests: a private segment directory on tmpfs."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def shm_dir():
    """A fresh directory under /dev/shm, so segments live on tmpfs but never clash with others."""
    path = tempfile.mkdtemp(prefix="ringserve-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)
