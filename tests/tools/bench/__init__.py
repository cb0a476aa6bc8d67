"""Tests of tools/bench/."""
