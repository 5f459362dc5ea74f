"""Records on the rings between the supervisor and an I/O worker.

Each worker has one control segment holding three rings (see ``WorkerRings``):
``reads`` and ``writes`` (supervisor -> worker) carry ``IO_REQUEST``;
``done`` (worker -> supervisor) carries ``IO_COMPLETION``. Layouts are listed in
docs/FORMAT.md ("I/O worker rings").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..shm.ring import Ring

OP_READ = 0
OP_WRITE = 1

# status of a completion
ST_OK = 0
ST_IO_ERROR = 1       # the device failed the request (result holds -errno) or it was short
ST_BAD_HEADER = 2     # header missing, torn, or not the expected store/slot/generation/key
ST_BAD_CHECKSUM = 3   # payload checksum mismatch
ST_WORKER_LOST = 4    # synthesized by the supervisor when the worker died or hung

#: supervisor -> worker, 96 bytes
IO_REQUEST = np.dtype([
    ("tag", "<u8"),        # unique per request while outstanding
    ("op", "<u4"),         # OP_READ / OP_WRITE
    ("buf", "<u4"),        # arena buffer index
    ("offset", "<u8"),     # device byte offset of the slot (its header block)
    ("length", "<u8"),     # bytes to transfer: 4096 + payload rounded up to 4096
    ("gen", "<u8"),        # generation to write / expected
    ("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"),  # key digest
    ("area", "<u4"),       # area index of the slot
    ("flags", "<u4"),      # write: F_CSUM
    ("slot", "<u8"),       # slot index in the area
    ("payload_len", "<u8"),  # payload bytes (write: to store; read: expected)
    ("csum", "<u8"),       # write with F_CSUM: the payload's xxh3_64, computed by the client
])
assert IO_REQUEST.itemsize == 104

F_CSUM = 1  # the client computed the payload checksum while copying the page in: the worker uses it

# kind of a completion
K_SUPERVISOR = 0      # the supervisor's request ``tag``
K_DIRECT = 1          # a report of a client's direct read (tag 0; already answered to the client)

#: worker -> supervisor, 48 bytes
IO_COMPLETION = np.dtype([
    ("tag", "<u8"),
    ("result", "<i8"),     # bytes transferred or -errno
    ("status", "<i4"),     # ST_*
    ("kind", "<u4"),       # K_*
    ("latency_ns", "<u8"),
    ("gen", "<u8"),        # K_DIRECT: the generation the read expected
    ("where", "<u8"),      # K_DIRECT: area << 40 | slot
])
assert IO_COMPLETION.itemsize == 48

REQUEST_RING = 1024
DONE_RING = 1024


class WorkerRings:
    """The three rings of one worker's control segment, at fixed offsets."""

    def __init__(self, buf: Any) -> None:
        o = 0
        self.reads = Ring(buf, o, REQUEST_RING, IO_REQUEST)
        o += Ring.nbytes(REQUEST_RING, IO_REQUEST)
        self.writes = Ring(buf, o, REQUEST_RING, IO_REQUEST)
        o += Ring.nbytes(REQUEST_RING, IO_REQUEST)
        self.done = Ring(buf, o, DONE_RING, IO_COMPLETION)

    @staticmethod
    def nbytes() -> int:
        """Size of the control segment."""
        return 2 * Ring.nbytes(REQUEST_RING, IO_REQUEST) + Ring.nbytes(DONE_RING, IO_COMPLETION)

    def reset(self) -> None:
        """Empty all three rings (only while no worker runs)."""
        self.reads.reset()
        self.writes.reset()
        self.done.reset()
