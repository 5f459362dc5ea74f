"""libaio for the I/O workers and the tests: an ``AioContext`` of fixed depth over the compiled
core's ``kv_submit``/``kv_getevents``.

This is the one place where a negative return value from C becomes
``OSError(errno, strerror, path)``.
"""

from __future__ import annotations

import errno as errno_mod
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .lib import FFI as ffi
from .lib import LIB

lib: Any = LIB  # the libaio calls are not in the typed subset
from .lib import const

OP_READ = const("KV_OP_READ")
OP_WRITE = const("KV_OP_WRITE")


def _check(ret: int, what: str, path: str | None = None) -> int:
    if ret < 0:
        e = -ret
        raise OSError(e, f"{what}: {os.strerror(e)}", path)
    return ret


@dataclass(frozen=True)
class Completion:
    """One reaped I/O: the caller's tag and the byte count, or ``-errno``."""

    tag: int
    result: int


class AioContext:
    """A libaio context with a fixed number of iocb slots.

    Invariant: at most ``depth`` I/Os are outstanding (``outstanding`` counts them).
    """

    def __init__(self, depth: int, path: str | None = None) -> None:
        if not 1 <= depth <= 4096:
            raise ValueError(f"depth must be in [1, 4096], got {depth}")
        self.depth = depth
        self._path = path
        self._ctx = ffi.new("io_context_t *")
        _check(lib.kv_io_setup(depth, self._ctx), "io_setup", path)
        self._iocbs = ffi.new("struct iocb[]", depth)
        self._ptrs = ffi.new("struct iocb *[]", depth)
        self._fds = ffi.new("int[]", depth)
        self._ops = ffi.new("int[]", depth)
        self._bufs = ffi.new("char *[]", depth)
        self._lens = ffi.new("unsigned long long[]", depth)
        self._offs = ffi.new("long long[]", depth)
        self._tags = ffi.new("unsigned long long[]", depth)
        self._ev_tags = ffi.new("unsigned long long[]", 256)
        self._ev_res = ffi.new("long long[]", 256)
        self.outstanding = 0

    def submit(self, reqs: Sequence[tuple[int, int, Any, int, int, int]]) -> int:
        """Submit ``(op, fd, buf_ptr, length, offset, tag)`` requests in one ``io_submit``.

        Returns how many were submitted (a prefix of ``reqs``); the caller retries
        the rest later. The kernel copies each iocb during ``io_submit`` and hands
        the tag back in the completion, so the scratch arrays are reused at once.

        Raises:
            ValueError: more requests than the context has room for.
            OSError: io_submit failed before submitting anything.
        """
        n = len(reqs)
        if n == 0:
            return 0
        if self.outstanding + n > self.depth:
            raise ValueError(f"{n} requests with {self.outstanding} outstanding exceed depth {self.depth}")
        for i, (op, fd, buf, length, off, tag) in enumerate(reqs):
            self._fds[i] = fd
            self._ops[i] = op
            self._bufs[i] = buf
            self._lens[i] = length
            self._offs[i] = off
            self._tags[i] = tag
        done = _check(lib.kv_submit(self._ctx[0], self._iocbs, self._ptrs, n, self._fds, self._ops,
                                    self._bufs, self._lens, self._offs, self._tags),
                      "io_submit", self._path)
        self.outstanding += done
        return int(done)

    def getevents(self, min_nr: int, max_nr: int, timeout_s: float | None) -> list[Completion]:
        """Reap between ``min_nr`` and ``max_nr`` completions, waiting at most ``timeout_s``."""
        tns = -1 if timeout_s is None else int(timeout_s * 1e9)
        r = _check(lib.kv_getevents(self._ctx[0], min_nr, min(max_nr, 256), tns,
                                    self._ev_tags, self._ev_res), "io_getevents", self._path)
        out = []
        for i in range(r):
            out.append(Completion(int(self._ev_tags[i]), int(self._ev_res[i])))
        self.outstanding -= r
        return out

    def close(self) -> None:
        """Wait for outstanding I/O (bounded by the kernel) and destroy the context."""
        if self._ctx is not None:
            lib.kv_io_destroy(self._ctx[0])
            self._ctx = None


def buffer_address(buf: Any) -> Any:
    """A ``char *`` to the start of a writable buffer (mmap, bytearray) for use in requests."""
    return ffi.from_buffer(buf)


def result_errno(result: int) -> str:
    """Human name of a negative I/O result (``-EIO`` -> ``'EIO'``)."""
    return errno_mod.errorcode.get(-result, str(-result)) if result < 0 else "ok"
