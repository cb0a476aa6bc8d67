"""Tests of tools/fleet/."""
