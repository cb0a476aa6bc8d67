"""The fleet launcher's replica command lines (no process is started)."""

from __future__ import annotations

import os

from ringserve.tools.fleet.replicas import Fleet, build_parser, replica_cpu_threads


def _serve_args(argv: list[str], serve_args: list[str], tmp_path) -> list[str]:
    args = build_parser().parse_args(argv)
    args.serve_args = serve_args
    fleet = Fleet(args, tmp_path)
    try:
        return fleet._serve_args(fleet.replicas[0])
    finally:
        fleet.fanout.httpd.server_close()


def test_replicas_on_one_machine_split_its_cpus():
    """cpu_threads 0 would give every replica every core: three replicas on two CPUs get one each."""
    assert replica_cpu_threads(2, 3) == 1
    assert replica_cpu_threads(16, 2) == 8
    assert replica_cpu_threads(1, 1) == 1


def test_each_replica_gets_its_share_unless_told(tmp_path):
    argv = _serve_args(["--replicas", "2"], [], tmp_path)
    share = str(replica_cpu_threads(len(os.sched_getaffinity(0)), 2))
    assert argv[argv.index("--cpu-threads") + 1] == share
    told = _serve_args(["--replicas", "2"], ["--cpu-threads", "3"], tmp_path)
    assert told.count("--cpu-threads") == 1 and told[told.index("--cpu-threads") + 1] == "3"
