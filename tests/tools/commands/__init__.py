"""Tests of tools/commands/."""
