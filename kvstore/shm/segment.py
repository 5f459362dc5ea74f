"""POSIX shared-memory segments, named per MASS_HOME, store and server.

Names look like ``/kvs.<home8>.<store>.<server>.<what>``: ``home8`` is a hash
of the MASS_HOME path, so two MASS_HOMEs (two test runs, two users) never
collide. Segments are created owner-only (mode 0600) unless told otherwise. On
Linux they live under /dev/shm beside the wake-up FIFOs (``wake.py``), which is
how a starting service finds and removes what a crashed one left behind.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import posix_ipc

SHM_DIR = Path("/dev/shm")


def home_prefix(home: Path) -> str:
    """The shm name prefix shared by every service under one MASS_HOME."""
    h = hashlib.blake2b(str(Path(home).resolve()).encode(), digest_size=4).hexdigest()
    return f"kvs.{h}."


def name_prefix(home: Path, store: str, server: str) -> str:
    """The shm name prefix of one service (without the leading slash)."""
    return f"{home_prefix(home)}{store}.{server}."


class Segment:
    """A mapped POSIX shm segment. Invariant: ``buf`` stays mapped until ``close()``."""

    def __init__(self, name: str, size: int, *, create: bool, mode: int = 0o600, group: int | None = None,
                 readonly: bool = False) -> None:
        self.name = name
        flags = posix_ipc.O_CREX if create else 0
        shm = posix_ipc.SharedMemory("/" + name, flags, mode=mode, size=size if create else 0,
                                     read_only=readonly and not create)
        try:
            if create:  # exact mode (shm_open applies the umask) and the configured group
                os.fchmod(shm.fd, mode)
                if group is not None:
                    os.fchown(shm.fd, -1, group)
            self.size = shm.size
            # read-only: opened O_RDONLY and mapped PROT_READ, so the kernel refuses any write
            self.buf: mmap.mmap = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ if readonly else
                                            mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        self.owner = create

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600, group: int | None = None) -> Segment:
        """Create (fails if it exists) and map a zero-filled segment of ``size`` bytes."""
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        return cls(name, size, create=True, mode=mode, group=group)

    @classmethod
    def adopt(cls, name: str, fd: int) -> Segment:
        """Map the segment behind file descriptor ``fd`` (one passed over a Unix socket), read
        and write, and close ``fd``; ``name`` is only for messages."""
        seg = cls.__new__(cls)
        seg.name = name
        try:
            seg.size = os.fstat(fd).st_size
            seg.buf = mmap.mmap(fd, seg.size)
        finally:
            os.close(fd)
        seg.owner = False
        return seg

    def open_fd(self) -> int:
        """A new read-write file descriptor of this segment (to pass to a client); the caller
        closes it."""
        return os.open(str(SHM_DIR / self.name), os.O_RDWR | os.O_CLOEXEC)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> Segment:
        """Map an existing segment (``readonly``: opened and mapped for reading only); raises
        ``posix_ipc.ExistentialError`` if it is gone, ``posix_ipc.PermissionsError`` if this
        process may not open it so."""
        return cls(name, 0, create=False, readonly=readonly)

    def close(self) -> None:
        """Unmap (views into ``buf`` must be released first; otherwise the map is left to GC)."""
        try:
            self.buf.close()
        except BufferError:
            pass  # live numpy views: the mapping goes when they do

    def unlink(self) -> None:
        """Remove the name; the memory goes when the last process unmaps it."""
        unlink_segment(self.name)


def unlink_segment(name: str) -> None:
    """Unlink segment ``name`` if it exists."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def leftovers(prefix: str) -> list[str]:
    """Names under /dev/shm that start with ``prefix``: segments and wake-up FIFOs (and the
    ``sem.`` semaphores of versions before 4 of the hello, which a crash may have left)."""
    if not SHM_DIR.is_dir():
        return []
    out = []
    for p in SHM_DIR.iterdir():
        n = p.name
        if n.startswith(prefix) or n.startswith("sem." + prefix):
            out.append(n)
    return sorted(out)


def remove_leftovers(prefix: str) -> list[str]:
    """Unlink everything ``leftovers`` names; return what was removed."""
    gone = leftovers(prefix)
    for n in gone:
        try:
            (SHM_DIR / n).unlink()
        except FileNotFoundError:
            pass
    return gone


def pid_alive(pid: int) -> bool:
    """True if a process with ``pid`` exists (zombies count as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
