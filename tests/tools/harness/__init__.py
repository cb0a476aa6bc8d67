"""Tests of tools/harness/."""
