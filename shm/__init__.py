"""Shared-memory IPC: segments, rings, doorbells, messages. Knows no caller."""
