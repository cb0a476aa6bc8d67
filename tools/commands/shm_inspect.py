"""`ringserve shm [--json] [--clean] [--watch [S]] [--dir DIR]`: list ringserve shared-memory segments.

For each ring: capacity, head, tail, bytes in use, generation, heartbeat ages, producer and
consumer pids, and the owner pid with whether it is alive; for each control segment: the GPU
generation, state, heartbeat age and model facts, KV pool use, queue depth and running rows, every
GPU stat `shm/stats_schema.py` declares, and every worker slot (pid, generation, heartbeat age). `--clean` removes segments whose owner is
dead; `--watch` redraws every S seconds (default 1) until Ctrl-C (with `--json`: one object per
line). Segments are mapped read-only; nothing here writes to a live instance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ringserve.shm import layout as L
from ringserve.shm.control import Control, ControlError, TornReadError
from ringserve.shm.ring import Ring, RingError
from ringserve.shm.segment import Segment, SegmentInfo, cleanup_stale, list_segments, pid_alive
from ringserve.shm.stats_schema import GPU_STATS


def _describe(info: SegmentInfo, directory: str) -> dict:
    entry = {
        "name": info.name,
        "instance": info.instance,
        "part": info.part,
        "size": info.size,
        "owner_pid": info.owner_pid,
        "owner_alive": info.owner_alive,
        "kind": "unknown",
    }
    try:
        seg = Segment.attach(info.name, directory, writable=False)
    except (OSError, ValueError) as e:
        entry["error"] = str(e)
        return entry
    try:
        magic = L.U64.unpack_from(seg.buf, 0)[0] if seg.size >= 8 else 0
        if magic == L.RING_MAGIC:
            ring = Ring(seg.buf)
            snap = ring.snapshot()
            snap["producer_alive"] = pid_alive(snap["producer_pid"])
            snap["consumer_alive"] = pid_alive(snap["consumer_pid"])
            try:
                ring.check_integrity()
                snap["integrity"] = "ok"
            except RingError as e:  # may be a record mid-write on a live ring
                snap["integrity"] = str(e)
            entry["kind"], entry["ring"] = "ring", snap
            del ring
        elif magic == L.CONTROL_MAGIC:
            entry["kind"], entry["control"] = "control", Control(seg.buf).snapshot()
    except (RingError, ControlError, TornReadError, ValueError) as e:
        entry["error"] = str(e)
    finally:
        seg.close()
    return entry


def inspect(directory: str = L.DEFAULT_DIRECTORY) -> list[dict]:
    """One dict per ringserve segment in `directory` (the `--json` payload's `segments`)."""
    return [_describe(info, directory) for info in list_segments(directory)]


def _hit_rate(gpu_stats: dict) -> str:
    """Prompt tokens served from cached KV blocks over tokens looked up ("-" before any lookup)."""
    queries = gpu_stats.get("prefix_cache_queries", 0.0)
    return f"{gpu_stats.get('prefix_cache_hits', 0.0) / queries:.1%}" if queries else "-"


def _accepted_length(gpu_stats: dict) -> str:
    """Speculative decoding's mean accepted length: tokens a drafting row emits per verifying step
    (its kept draft tokens plus the one sampled after them; "-" before any draft), as vLLM's."""
    drafts = gpu_stats.get("spec_decode_num_drafts", 0.0)
    return f"{1.0 + gpu_stats.get('spec_decode_num_accepted_tokens', 0.0) / drafts:.2f}" if drafts else "-"


def _gpu_stat_lines(gpu_stats: dict, width: int = 96) -> list[str]:
    """Every stat `shm.stats_schema.GPU_STATS` declares, `name value`, wrapped to `width`."""
    items = []
    for stat in GPU_STATS:
        v = gpu_stats.get(stat.name, 0.0)
        items.append(f"{stat.name} {int(v) if float(v).is_integer() else f'{v:.3f}'}")
    lines, line = [], "gpu:"
    for item in items:
        if len(line) + len(item) + 2 > width:
            lines.append(line + ",")
            line = "    " + item
        else:
            line += (", " if line != "gpu:" else " ") + item
    return lines + [line]


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _pid(pid: int, alive: bool) -> str:
    return "-" if not pid else f"{pid}{'' if alive else ' (dead)'}"


def format_table(segments: list[dict]) -> str:
    """Human-readable listing grouped by instance."""
    if not segments:
        return "no ringserve segments"
    lines = []
    cols = (
        "part",
        "capacity",
        "head",
        "tail",
        "used",
        "gen",
        "producer",
        "consumer",
        "prod hb",
        "cons hb",
        "integrity",
    )
    widths = (9, 10, 14, 14, 10, 4, 14, 14, 8, 8, 0)
    instance = None
    for seg in segments:
        if seg["instance"] != instance:
            instance = seg["instance"]
            state = "alive" if seg["owner_alive"] else "DEAD (stale: `ringserve shm --clean`)"
            lines += ["", f"instance {instance}  owner pid {seg['owner_pid']} {state}"]
            lines.append("  " + " ".join(c.ljust(w) for c, w in zip(cols, widths)))
        if "error" in seg:
            lines.append(f"  {seg['part']:<9} error: {seg['error']}")
        elif seg["kind"] == "control":
            c = seg["control"]
            facts = c["model_facts"] or {}
            lines.append(
                f"  {seg['part']:<9} gpu generation {c['gpu_generation']}, state "
                f"{c['gpu_state']}, pid {c['gpu_pid'] or '-'}, heartbeat "
                f"{_age(c['gpu_heartbeat_age_s'])}, model "
                f"{facts.get('model', facts.get('name', '-'))}, {c['n_workers']} worker slots"
            )
            g = c["gpu_stats"]
            total, free = int(g["kv_blocks_total"]), int(g["kv_blocks_free"])
            lines.append(
                f"  {'':<9} kv blocks {total - free}/{total} used, queue depth "
                f"{int(g['queue_depth'])}, running rows {int(g['running_rows'])}, "
                f"steps {int(g['steps'])}, prefix cache hit rate {_hit_rate(g)}, "
                f"mean accepted length {_accepted_length(g)}"
            )
            lines.append(
                f"  {'':<9} requests in the running step {c['requests_in_step']}, "
                f"quarantined requests {c['quarantined_requests']}"
            )
            lines += [f"  {'':<9} {line}" for line in _gpu_stat_lines(g)]
            for i, w in enumerate(c["workers"]):
                lines.append(
                    f"  {'':<9} worker {i}: pid {_pid(w['pid'], pid_alive(w['pid']))}, "
                    f"generation {w['generation']}, heartbeat {_age(w['heartbeat_age_s'])}"
                )
        elif seg["kind"] == "ring":
            r = seg["ring"]
            row = (
                seg["part"],
                f"{r['capacity']:,}",
                str(r["head"]),
                str(r["tail"]),
                f"{r['used_bytes']:,}",
                str(r["generation"]),
                _pid(r["producer_pid"], r["producer_alive"]),
                _pid(r["consumer_pid"], r["consumer_alive"]),
                _age(r["producer_heartbeat_age_s"]),
                _age(r["consumer_heartbeat_age_s"]),
                r["integrity"],
            )
            lines.append("  " + " ".join(v.ljust(w) for v, w in zip(row, widths)))
        else:
            lines.append(f"  {seg['part']:<9} not a ringserve segment layout ({seg['size']:,} bytes)")
    return "\n".join(lines).lstrip("\n")


def watch(directory: str, interval_s: float, *, as_json: bool = False, iterations: int | None = None) -> int:
    """Redraw the table (or print one JSON object per line) every `interval_s` until Ctrl-C, or
    `iterations` times."""
    n = 0
    try:
        while iterations is None or n < iterations:
            segments = inspect(directory)
            if as_json:
                print(json.dumps({"directory": directory, "time": time.time(), "segments": segments}), flush=True)
            else:
                # Home the cursor and clear the screen, so the table redraws in place.
                print(
                    "\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + directory + "\n" + format_table(segments), flush=True
                )
            n += 1
            if iterations is None or n < iterations:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringserve shm", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--clean", action="store_true", help="remove segments of dead owners")
    parser.add_argument("--dir", default=L.DEFAULT_DIRECTORY, help="segment directory (default %(default)s)")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=1.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 1) until Ctrl-C",
    )
    args = parser.parse_args(argv)
    if args.watch is not None:
        if args.watch <= 0:
            parser.error("--watch takes a positive number of seconds")
        return watch(args.dir, args.watch, as_json=args.json)
    removed = cleanup_stale(args.dir) if args.clean else []
    segments = inspect(args.dir)
    if args.json:
        print(json.dumps({"directory": args.dir, "segments": segments, "removed": removed}))
    else:
        for name in removed:
            print(f"removed stale {name}")
        print(format_table(segments))
    return 0


if __name__ == "__main__":
    sys.exit(main())
