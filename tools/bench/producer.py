"""The GPU side of `ringserve bench api`: a process that answers one worker's ring as fast as the
ring takes records, with no model. Every "step" emits one token for every running sample (the
prompt ids, cycled), as one `StepOutput`, finishing samples at max_tokens; Cancels remove rows.

Run by the bench as `python -m ringserve.tools.bench.producer --instance I --bell-fds FDS
--shm-dir DIR`, with the doorbells inherited; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time

from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import Accepted, Cancel, Finish, FinishReason, StepOutput, Submit, Token, decode, encode


class _Row:
    __slots__ = ("submit", "ids", "left")

    def __init__(self, submit: Submit) -> None:
        self.submit = submit
        self.ids = [itertools.cycle(submit.prompt_ids) for _ in range(submit.n)]
        self.left = submit.max_tokens


def run(instance: str, bell_fds: list[int], directory: str) -> int:
    shm = ShmInstance.attach(instance, bell_fds=bell_fds, directory=directory)
    if shm.input_bell is None or shm.output_bells is None:
        raise RuntimeError("the producer needs the instance's doorbells (--bell-fds)")
    input_bell = shm.input_bell
    ins, outs = shm.gpu_rings(shm.control.gpu_generation)
    requests, output, bell = ins[0], outs[0], shm.output_bells[0]
    rows: dict[int, _Row] = {}
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    step = 0
    while not stopping:
        if not rows:
            input_bell.wait(0.05)
        news: list = []
        for raw in requests.pop_many():
            msg = decode(raw)
            if isinstance(msg, Submit):
                rows[msg.rid] = _Row(msg)
                news.append(Accepted(rid=msg.rid, est_gpu_ms=1.0))
            elif isinstance(msg, Cancel) and msg.rid in rows:
                row = rows.pop(msg.rid)
                news.append(
                    StepOutput(
                        step=step,
                        finishes=[
                            Finish(
                                msg.rid,
                                i,
                                FinishReason.CANCELLED,
                                len(row.submit.prompt_ids),
                                row.submit.max_tokens - row.left,
                                0.0,
                                0.0,
                            )
                            for i in range(row.submit.n)
                        ],
                    )
                )
        if rows:
            step += 1
            tokens, finishes = [], []
            for rid, row in list(rows.items()):
                row.left -= 1
                for i, ids in enumerate(row.ids):
                    tokens.append(Token(rid, i, next(ids), -0.5))
                if row.left == 0:
                    del rows[rid]
                    finishes += [
                        Finish(rid, i, FinishReason.LENGTH, len(row.submit.prompt_ids), row.submit.max_tokens, 0.1, 1.0)
                        for i in range(row.submit.n)
                    ]
            news.append(StepOutput(step=step, tokens=tokens, finishes=finishes))
        for msg in news:
            data = encode(msg)
            while not output.try_push(data):  # the worker is behind: wait for ring space
                bell.ring()
                time.sleep(0.0002)
                if stopping:
                    break
        if news:
            bell.ring()
    shm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve-bench-producer", description=__doc__.splitlines()[0])
    p.add_argument("--instance", required=True)
    p.add_argument("--bell-fds", required=True)
    p.add_argument("--shm-dir", required=True)
    args = p.parse_args(argv)
    return run(args.instance, [int(x) for x in args.bell_fds.split(",")], args.shm_dir)


if __name__ == "__main__":
    sys.exit(main())
