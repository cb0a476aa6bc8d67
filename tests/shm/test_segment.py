"""Named segments: create/attach/unlink, instance ids, stale cleanup, and the space check."""

from __future__ import annotations

import errno
import multiprocessing
import os

import pytest

from ringserve.shm.instance import ShmInstance, ShmSizes
from ringserve.shm.segment import (
    Segment,
    ShmSpaceError,
    cleanup_stale,
    instance_id,
    list_segments,
    owner_alive,
    parse_segment_name,
    process_start_time,
    segment_name,
)


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    return proc.pid


def test_create_attach_share_bytes(shm_dir):
    """A segment created by name is zero-filled, and an attached mapping sees the same bytes."""
    seg = Segment.create(segment_name(instance_id(), "x"), 8192, shm_dir)
    assert seg.buf[:16] == bytes(16)
    seg.buf[0:5] = b"hello"
    other = Segment.attach(seg.name, shm_dir)
    assert other.size == 8192 and other.buf[0:5] == b"hello"
    with pytest.raises(FileExistsError):
        Segment.create(seg.name, 8192, shm_dir)
    seg.unlink()
    with pytest.raises(FileNotFoundError):
        Segment.attach(seg.name, shm_dir)
    other.buf[0:1] = b"H"  # an existing mapping outlives the name
    assert seg.buf[0:1] == b"H"


def test_instance_id_names_this_process():
    """The instance id is pid-starttime, and its owner is alive."""
    inst = instance_id()
    assert inst == f"{os.getpid()}-{process_start_time(os.getpid())}"
    assert owner_alive(inst)
    name = segment_name(inst, "req.3")
    assert name == f"ringserve.{inst}.req.3"
    assert parse_segment_name(name) == (inst, "req.3")
    assert parse_segment_name("ringserve.nonsense") is None
    assert parse_segment_name("other.1-2.control") is None


def test_cleanup_removes_only_stale_segments(shm_dir):
    """cleanup_stale() removes segments of dead owners and of reused pids, keeps live ones."""
    live = segment_name(instance_id(), "control")
    dead = segment_name(f"{_dead_pid()}-12345", "control")
    reused = segment_name(f"{os.getpid()}-{process_start_time(os.getpid()) + 1}", "req.0")
    for name in (live, dead, reused):
        Segment.create(name, 4096, shm_dir).close()
    open(os.path.join(shm_dir, "unrelated"), "w").close()
    alive = {info.name: info.owner_alive for info in list_segments(shm_dir)}
    assert alive == {live: True, dead: False, reused: False}
    assert sorted(cleanup_stale(shm_dir)) == sorted([dead, reused])
    assert sorted(os.listdir(shm_dir)) == sorted([live, "unrelated"])


def test_full_tmpfs_fails_at_startup_naming_the_size(shm_dir):
    """When fallocate reports ENOSPC the error names the bytes needed; nothing is left behind."""

    def no_space_for_rings(fd, offset, length):
        if length > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate(fd, offset, length)

    total = ShmSizes(ring_bytes=4 << 20, n_workers=2).total_bytes
    with pytest.raises(ShmSpaceError, match=rf"cannot reserve 4,198,400 bytes .*needs {total:,}"):
        ShmInstance.create(ring_bytes=4 << 20, n_workers=2, directory=shm_dir, fallocate=no_space_for_rings)
    assert os.listdir(shm_dir) == []


def test_too_small_directory_is_refused_up_front(shm_dir):
    """An instance larger than the free space fails before creating anything, naming the total."""
    sizes = ShmSizes(ring_bytes=1 << 40, n_workers=2)  # 4 TiB of rings
    with pytest.raises(ShmSpaceError, match=f"needs {sizes.total_bytes:,} bytes"):
        ShmInstance.create(ring_bytes=sizes.ring_bytes, n_workers=2, directory=shm_dir)
    assert os.listdir(shm_dir) == []


def test_sizes_are_validated():
    """Bad ring sizes or worker counts are rejected with the limit in the message."""
    with pytest.raises(ValueError, match="multiple of 8"):
        ShmSizes(ring_bytes=1001, n_workers=1)
    with pytest.raises(ValueError, match="n_workers"):
        ShmSizes(ring_bytes=4096, n_workers=0)


def test_unreadable_owner_counts_as_alive(monkeypatch):
    """If /proc hides the owner (PermissionError), its segments are never treated as stale."""
    import ringserve.shm.segment as segment

    def hidden(pid):
        raise PermissionError("hidepid")

    monkeypatch.setattr(segment, "process_start_time", hidden)
    assert segment.owner_alive("1-2")


def test_read_only_attach_cannot_write(shm_dir):
    """The inspector's read-only mapping sees the bytes and refuses writes."""
    seg = Segment.create(segment_name(instance_id(), "ro"), 4096, shm_dir)
    seg.buf[0:2] = b"ok"
    ro = Segment.attach(seg.name, shm_dir, writable=False)
    assert ro.buf[0:2] == b"ok"
    with pytest.raises(TypeError):
        ro.buf[0:2] = b"no"


def test_pid_alive_sees_live_gone_and_zombie_processes():
    """A running process is alive; an exited one, a zombie and pid 0 are not."""
    import subprocess
    import sys
    import time

    from ringserve.shm.segment import pid_alive

    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exited, unreaped: a zombie
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)
