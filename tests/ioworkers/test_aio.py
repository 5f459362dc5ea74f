from __future__ import annotations

import mmap
import os

import pytest

from kvstore._native.aio import OP_READ, OP_WRITE, AioContext, buffer_address, result_errno


def test_direct_write_read_roundtrip(devices) -> None:  # type: ignore[no-untyped-def]
    (dev,) = devices.make(1, 8 << 20)
    fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
    ctx = AioContext(16, dev)
    w = mmap.mmap(-1, 64 << 10)
    r = mmap.mmap(-1, 64 << 10)
    try:
        w[:] = os.urandom(64 << 10)
        pw, pr = buffer_address(w), buffer_address(r)
        reqs = [(OP_WRITE, fd, pw + i * 4096, 4096, (1 << 20) + i * 4096, i) for i in range(16)]
        assert ctx.submit(reqs) == 16
        done = []
        while len(done) < 16:
            done += ctx.getevents(1, 16, 5.0)
        assert sorted(c.tag for c in done) == list(range(16)) and all(c.result == 4096 for c in done)
        assert ctx.submit([(OP_READ, fd, pr, 64 << 10, 1 << 20, 99)]) == 1
        (c,) = ctx.getevents(1, 1, 5.0)
        assert c.tag == 99 and c.result == 64 << 10
        assert r[:] == w[:]
        # a read past the end is short (0 bytes), which the worker reports as an I/O error
        assert ctx.submit([(OP_READ, fd, pr, 4096, 8 << 20, 7)]) == 1
        (c,) = ctx.getevents(1, 1, 5.0)
        assert c.tag == 7 and c.result == 0
        # a bad descriptor fails at submit: an OSError naming the device, not a crash
        with pytest.raises(OSError) as ei:
            ctx.submit([(OP_READ, -1, pr, 4096, 0, 8)])
        assert ei.value.errno == 9 and ei.value.filename == dev and result_errno(-9) == "EBADF"
        with pytest.raises(ValueError, match="exceed depth"):
            ctx.submit([(OP_READ, fd, pr, 4096, 0, i) for i in range(17)])
    finally:
        ctx.close()
        os.close(fd)
        del pw, pr
