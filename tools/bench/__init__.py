"""Benchmarks (`ringserve bench …`): each `bench` subcommand's module, and the peers, traces and batchers they replay."""
