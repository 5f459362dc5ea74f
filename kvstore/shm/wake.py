"""Wake-ups between processes: a FIFO under /dev/shm whose read end only its consumer holds.

Why not a POSIX semaphore: whoever may post a semaphore may also wait on it, and a waiter
takes the wake-up meant for another (a member of the access group that waited on the
supervisor's doorbell, a worker's wake-up or another client's made everyone else's calls
wait for their 50 ms timeouts: a 16-page get 1.0 -> 51 ms). A FIFO splits the two rights in
the kernel:

- A consumer's wake-up (the supervisor's doorbell, each I/O worker's) is created by the
  service with mode 0620 when there is an access group (0600 without): group members may
  open it for writing only; ``open(O_RDONLY)`` is refused them. Each producer opens its own
  write end (its own open file description: its ``O_NONBLOCK`` is its own).
- A client's wake-up is owner-only (0600): no other user can open it at all. The service
  opens its read end and sends it with the hello answer (SCM_RIGHTS); the service and the
  workers write to it through write ends of their own.

Protocol. A producer publishes its work, then writes one byte without blocking; a full FIFO
(64 KiB of posts not yet drained) needs nothing more, the consumer has a wake-up pending
already. A consumer checks for work, then ``wait``s: poll the read end (with a timeout), then
drain it. Every byte drained was posted before the drain, so the work it announces is seen by
the check that follows: no wake-up is lost, and many posts cost one turn. A consumer that
never drains hurts only itself (its producers' writes find the FIFO full and return).
"""

from __future__ import annotations

import math
import os
import select
import signal
import stat
from pathlib import Path

from .segment import SHM_DIR

_DRAIN = 65536  # a pipe's default capacity: one read empties it


def doorbell_name(prefix: str) -> str:
    """The supervisor's wake-up, of the service whose shm names start with ``prefix``."""
    return prefix + "wake.bell"


def worker_wake_name(prefix: str, device: int) -> str:
    """The wake-up of the I/O worker of ``device``."""
    return prefix + f"wake.w{device}"


def client_wake_prefix(prefix: str) -> str:
    """Connection ``cid``'s wake-up is this plus ``str(cid)``."""
    return prefix + "wake.c"


def wake_path(name: str) -> Path:
    """Where wake-up ``name`` (a shm name, without the leading slash) lives."""
    return SHM_DIR / name


class WakeReader:
    """The consuming end of a wake-up. Invariant: ``fd`` is open for reading until ``close()``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls, name: str, mode: int = 0o600, group: int | None = None) -> WakeReader:
        """Make wake-up ``name`` (``make_wake``) and open it as its consumer: read-write, so that
        it never reads as closed while no producer has it open (a worker's FIFO outlives the
        worker that drains it, and producers never get ENXIO)."""
        make_wake(name, mode, group)
        return cls.open(name)

    @classmethod
    def open(cls, name: str) -> WakeReader:
        """Open an existing wake-up as its consumer (read-write, as ``create``): a restarted
        I/O worker takes over its wake-up so."""
        return cls(os.open(wake_path(name), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))

    @classmethod
    def open_for_client(cls, name: str) -> tuple[int, WakeWriter]:
        """Open an existing owner-only wake-up for a client: ``(read fd to send it, the
        service's own write end)``. The service keeps no read end: it shares no open file
        description with the client (whose flags it could change)."""
        path = wake_path(name)
        rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            return rfd, WakeWriter(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except BaseException:
            os.close(rfd)
            raise

    @classmethod
    def adopt(cls, fd: int) -> WakeReader:
        """The read end passed over the Unix socket (a client's own wake-up)."""
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError("the wake-up file descriptor is not a FIFO")
        os.set_blocking(fd, False)
        return cls(fd)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a post, then take every post made so far; True if there
        was one. (Whole milliseconds, rounded up: a shorter wait would spin.)"""
        try:
            ready = self._poll.poll(max(0, math.ceil(timeout_s * 1000)))
        except InterruptedError:  # a signal: let the caller look at its flags
            return False
        if not ready:
            return False
        self.drain()
        return True

    def drain(self) -> None:
        """Take every post made so far (without waiting)."""
        try:
            while len(os.read(self.fd, _DRAIN)) == _DRAIN:
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def post(self) -> None:
        """Post through this end (read-write when ``create``d: the service's end of a worker's
        wake-up keeps the FIFO open and posts through it)."""
        _post(self.fd)

    def close(self) -> None:
        """Close the read end (idempotent)."""
        if self.fd >= 0:
            self._poll.unregister(self.fd)
            os.close(self.fd)
            self.fd = -1


class WakeWriter:
    """A producer's end of a wake-up: ``post()`` never blocks and never raises."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def open(cls, name: str) -> WakeWriter:
        """Open wake-up ``name`` for posting (write-only: what the access group is allowed).

        Raises:
            FileNotFoundError: no such wake-up; OSError(ENXIO): its consumer is gone (a client's).
        """
        return cls(os.open(wake_path(name), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))

    def post(self) -> None:
        """Wake the consumer (a full FIFO already holds a wake-up; a gone consumer needs none,
        and its SIGPIPE is never delivered, whatever the program's SIGPIPE action)."""
        _post(self.fd)

    def close(self) -> None:
        """Close the write end (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _post(fd: int) -> None:
    if signal.getsignal(signal.SIGPIPE) is signal.SIG_IGN:  # Python's default: EPIPE, no signal
        try:
            os.write(fd, b"\x01")
        except (BlockingIOError, BrokenPipeError, InterruptedError):
            pass
        return
    # A program that restored SIGPIPE's default action would be killed by a post to a wake-up
    # whose consumer is gone (the service killed): block it for this write, and take the signal
    # the write raised before unblocking.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        os.write(fd, b"\x01")
    except BrokenPipeError:
        signal.sigtimedwait({signal.SIGPIPE}, 0)
    except (BlockingIOError, InterruptedError):
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def make_wake(name: str, mode: int = 0o600, group: int | None = None) -> None:
    """Create the FIFO of wake-up ``name``, replacing a stale one.

    ``mode`` is 0o600 or, with an access ``group``, 0o620: the group may post, never wait."""
    if mode & 0o044:
        raise ValueError(f"a wake-up's mode must not let anyone else read it, got {mode:o}")
    path = wake_path(name)
    unlink_wake(name)
    os.mkfifo(path, 0o600)
    os.chmod(path, mode)  # the exact mode (mkfifo applies the umask), then the group
    if group is not None:
        os.chown(path, -1, group)


def unlink_wake(name: str) -> None:
    """Remove wake-up ``name`` if it exists (open ends keep working)."""
    try:
        wake_path(name).unlink()
    except FileNotFoundError:
        pass


__all__ = ["WakeReader", "WakeWriter", "client_wake_prefix", "doorbell_name", "make_wake", "unlink_wake",
           "wake_path", "worker_wake_name"]
