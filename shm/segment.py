"""Named shared-memory segments: files under `/dev/shm` (or any directory) mapped with `mmap`.

We use `os.open` + `mmap` rather than `multiprocessing.shared_memory`: on Python < 3.13 its
resource tracker unlinks a segment when the process that attached it exits, while others still
use it. Names are `ringserve.<instance>.<part>`, with instance = `<owner pid>-<start time>` (the
owner's start time in clock ticks since boot, from `/proc/<pid>/stat`), so `cleanup_stale()` can
tell a live owner from a dead one whose pid was reused.

Space is reserved at creation with `posix_fallocate`: a full tmpfs fails here, with a message
naming the size needed, instead of as SIGBUS the first time a page is touched mid-stream.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

from ringserve.shm.layout import DEFAULT_DIRECTORY, SEGMENT_PREFIX

# MAP_POPULATE maps every page at attach time, so the hot path never takes a page fault.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmSpaceError(OSError):
    """The segment directory cannot hold the segments; the message says how much is needed."""


def process_start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot, or None if there is no such process.

    PermissionError (e.g. /proc mounted with hidepid) propagates: "unknown" is not "dead".
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


def instance_started_at(instance: str) -> float:
    """The Unix time the instance's owner started (boot time plus its start in clock ticks)."""
    _, ticks = parse_instance(instance)
    with open("/proc/stat", "rb") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def instance_id(pid: int | None = None) -> str:
    """`<pid>-<start time>` of a live process (default: this one)."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid)
    if start is None:
        raise ProcessLookupError(f"no process {pid}")
    return f"{pid}-{start}"


def parse_instance(instance: str) -> tuple[int, int]:
    """(pid, start time) from an instance id; ValueError when it is not one."""
    pid, sep, start = instance.partition("-")
    if not sep or not pid.isdigit() or not start.isdigit():
        raise ValueError(f"not a ringserve instance id: {instance!r}")
    return int(pid), int(start)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # NOTE: the state follows the last ')' (the command name may itself hold one).
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def owner_alive(instance: str) -> bool:
    """True when the instance's owner process still runs (same pid *and* same start time).

    When we may not look at the process, it counts as alive: never remove what might be in use.
    """
    pid, start = parse_instance(instance)
    try:
        return process_start_time(pid) == start
    except PermissionError:
        return True


def segment_name(instance: str, part: str) -> str:
    parse_instance(instance)
    if not part or "/" in part:
        raise ValueError(f"bad segment part {part!r}")
    return f"{SEGMENT_PREFIX}{instance}.{part}"


def parse_segment_name(name: str) -> tuple[str, str] | None:
    """(instance, part) of a ringserve segment name, or None for any other file."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    instance, sep, part = name[len(SEGMENT_PREFIX) :].partition(".")
    if not sep or not part:
        return None
    try:
        parse_instance(instance)
    except ValueError:
        return None
    return instance, part


class Segment:
    """One mapped segment. `buf` is the writable `mmap`; the file descriptor is not kept."""

    __slots__ = ("name", "directory", "size", "buf")

    def __init__(self, name: str, directory: str, size: int, buf: mmap.mmap):
        self.name = name
        self.directory = directory
        self.size = size
        self.buf = buf

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    @classmethod
    def create(
        cls,
        name: str,
        size: int,
        directory: str = DEFAULT_DIRECTORY,
        fallocate: Callable[[int, int, int], None] = os.posix_fallocate,
    ) -> Segment:
        """Create `name` exclusively, reserve `size` bytes and map it (zero-filled).

        Raises FileExistsError if it exists and ShmSpaceError if the space cannot be reserved.
        `fallocate` is a parameter so tests can inject ENOSPC.
        """
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise ShmSpaceError(
                        e.errno,
                        f"cannot reserve {size:,} bytes for shared-memory segment {name} in "
                        f"{directory} ({_free_text(directory)}); enlarge it (e.g. "
                        f"`mount -o remount,size=... {directory}` or docker --shm-size) or lower "
                        f"ring_bytes / workers",
                    ) from None
                raise
            buf = mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        return cls(name, directory, size, buf)

    @classmethod
    def attach(cls, name: str, directory: str = DEFAULT_DIRECTORY, writable: bool = True) -> Segment:
        """Map an existing segment (read-only unless `writable`); FileNotFoundError if none."""
        fd = os.open(os.path.join(directory, name), os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"segment {name} is empty")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buf = mmap.mmap(fd, size, _MAP_FLAGS, prot)
        finally:
            os.close(fd)
        return cls(name, directory, size, buf)

    def close(self) -> None:
        """Unmap. If views into the map are still alive the map stays until they are collected."""
        try:
            self.buf.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the name; processes that mapped it keep their mapping."""
        _unlink_quietly(self.path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _free_text(directory: str) -> str:
    try:
        return f"{free_bytes(directory):,} bytes free"
    except OSError:
        return "free space unknown"


def check_space(directory: str, needed: int) -> None:
    """Raise ShmSpaceError up front when `directory` has less than `needed` bytes free."""
    free = free_bytes(directory)
    if free < needed:
        raise ShmSpaceError(
            errno.ENOSPC,
            f"shared memory needs {needed:,} bytes in {directory} but only {free:,} "
            f"are free; enlarge it (e.g. `mount -o remount,size=... {directory}` or docker "
            f"--shm-size) or lower ring_bytes / workers",
        )


@dataclass(frozen=True)
class SegmentInfo:
    """A ringserve segment found on disk."""

    name: str
    instance: str
    part: str
    size: int
    owner_pid: int
    owner_alive: bool


def list_segments(directory: str = DEFAULT_DIRECTORY) -> list[SegmentInfo]:
    """Every ringserve segment in `directory`, sorted by name."""
    found = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is None:
            continue
        instance, part = parsed
        try:
            size = os.stat(os.path.join(directory, name)).st_size
        except FileNotFoundError:
            continue  # removed while we looked
        found.append(SegmentInfo(name, instance, part, size, parse_instance(instance)[0], owner_alive(instance)))
    return found


def cleanup_stale(directory: str = DEFAULT_DIRECTORY) -> list[str]:
    """Unlink the segments whose owner is dead (or whose pid now names another process)."""
    removed = []
    for info in list_segments(directory):
        if not info.owner_alive:
            try:
                _unlink_quietly(os.path.join(directory, info.name))
            except PermissionError:
                continue  # another user's segment in a sticky /dev/shm: not ours to remove
            removed.append(info.name)
    return removed
