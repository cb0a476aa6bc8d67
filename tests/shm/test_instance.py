"""One server instance's shared memory, attached by name from another process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ringserve.shm import messages
from ringserve.shm.instance import ShmInstance
from ringserve.shm.layout import GpuState

_WORKER = textwrap.dedent("""
    import sys
    from ringserve.shm import messages
    from ringserve.shm.instance import ShmInstance
    instance, directory, fds = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    shm = ShmInstance.attach(instance, directory=directory, bell_fds=fds)
    assert shm.control.gpu_state.name == "READY"
    req, out = shm.worker_rings(1)
    sub = messages.Submit(rid=7, request_id="r-7", tenant="t", prompt_ids=[1, 2, 3], max_tokens=4,
                          sampling=messages.SamplingParams(), arrival_ts=0.0, deadline_ts=1.0)
    assert req.try_push(messages.encode(sub))
    shm.input_bell.ring()
    assert shm.output_bells[1].wait(10), "no reply"
    reply = messages.decode(out.pop())
    print(type(reply).__name__, reply.rid, shm.control.model_facts()["name"])
""")


def test_worker_process_round_trip_through_an_instance(shm_dir):
    """A child attached by instance name and inherited doorbell fds submits; the parent, playing
    the GPU process, answers on the child's output ring; the segments unlink cleanly."""
    shm = ShmInstance.create(ring_bytes=64 * 1024, n_workers=2, directory=shm_dir)
    try:
        shm.control.set_model_facts({"name": "tiny"})
        shm.control.set_gpu_state(GpuState.READY)
        requests, outputs = shm.gpu_rings(shm.control.gpu_generation)
        fds = shm.bell_fds()
        child = subprocess.Popen(
            [sys.executable, "-c", _WORKER, shm.instance, shm_dir, ",".join(map(str, fds))],
            pass_fds=fds,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert shm.input_bell.wait(30), "worker never rang"
        assert requests[0].pop() is None
        sub = messages.decode(requests[1].pop())
        assert isinstance(sub, messages.Submit) and sub.prompt_ids == [1, 2, 3]
        assert outputs[1].try_push(messages.encode(messages.Accepted(rid=sub.rid, est_gpu_ms=1.0)))
        shm.output_bells[1].ring()
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, err
        assert out.split() == ["Accepted", "7", "tiny"]
        for ring in requests + outputs:
            ring.check_integrity()
    finally:
        shm.unlink()
        shm.close()
    assert os.listdir(shm_dir) == []


def test_restarted_gpu_process_adopts_the_rings(shm_dir):
    """A GPU process started with a new generation drops requests queued for its dead
    predecessor, keeps the worker's rings usable, and stamps the generation on every ring."""
    with ShmInstance.create(ring_bytes=4096, n_workers=1, directory=shm_dir) as shm:
        req, out = shm.worker_rings(0)
        assert req.try_push(b"for the dead gpu")
        gen = shm.control.bump_gpu_generation()
        requests, outputs = shm.gpu_rings(generation=gen)
        assert requests[0].pop() is None
        assert req.try_push(b"for the new gpu")
        assert requests[0].pop() == b"for the new gpu"
        assert outputs[0].try_push(b"reply") and out.pop() == b"reply"
        assert {r.generation for r in requests + outputs} == {gen}
        shm.unlink()


def test_restarted_worker_drops_output_of_its_predecessor(shm_dir):
    """A worker attaching to a slot never sees output left for a dead predecessor; what the GPU
    process pushes after it attached is delivered, and its requests reach the GPU process."""
    with ShmInstance.create(ring_bytes=4096, n_workers=1, directory=shm_dir) as shm:
        requests, outputs = shm.gpu_rings(shm.control.gpu_generation)
        shm.worker_rings(0)
        assert outputs[0].try_push(b"for the dead worker")
        req, out = shm.worker_rings(0)
        assert out.pop() is None
        assert outputs[0].try_push(b"for the new worker") and out.pop() == b"for the new worker"
        assert req.try_push(b"hello") and requests[0].pop() == b"hello"
        shm.unlink()
