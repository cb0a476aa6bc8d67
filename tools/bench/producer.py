"""The GPU side of `ringserve bench api`: a process that answers one worker's ring as fast as the
ring takes records, with no model. It drives the API tests' stand-in (`api.fake_gpu.FakeEngine`:
one token for every running sample per step, the prompt ids cycled, finishes as the engine's
rules say) over the real ring, stepping whenever a row runs.

Run by the bench as `python -m ringserve.tools.bench.producer --instance I --bell-fds FDS
--shm-dir DIR`, with the doorbells inherited; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from ringserve.api.fake_gpu import FakeEngine
from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import Cancel, Message, Submit, decode, encode


def run(instance: str, bell_fds: list[int], directory: str) -> int:
    shm = ShmInstance.attach(instance, bell_fds=bell_fds, directory=directory)
    if shm.input_bell is None or shm.output_bells is None:
        raise RuntimeError("the producer needs the instance's doorbells (--bell-fds)")
    input_bell = shm.input_bell
    ins, outs = shm.gpu_rings(shm.control.gpu_generation)
    requests, output, bell = ins[0], outs[0], shm.output_bells[0]
    engine = FakeEngine()
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    while not stopping:
        if not engine.running:
            input_bell.wait(0.05)
        news: list[Message] = []
        for raw in requests.pop_many():
            msg = decode(raw)
            if isinstance(msg, (Submit, Cancel)) and (answer := engine.take(msg)) is not None:
                news.append(answer)
        if engine.running:
            news.append(engine.step())
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
