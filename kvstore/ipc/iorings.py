"""Records on the rings between the supervisor and an I/O worker.

Each worker has one control segment holding three rings (see ``WorkerRings``):
``reads`` and ``writes`` (supervisor -> worker) carry ``IO_REQUEST``;
``done`` (worker -> supervisor) carries ``IO_COMPLETION``; then the worker's own
table of the connections whose direct reads it serves (``WCONN``: generation,
lease and tenant salt, written by the supervisor; ``busy``, written by the
worker). The segment is the supervisor's and the worker's alone: it is created
owner-only whatever ``service.access_group`` says, and no client is told its
name. Layouts are listed in docs/FORMAT.md ("I/O worker rings").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._native.lib import FFI, LIB, const
from ..shm.ring import Ring

# declared once, in kvstore/_native/kvstore.h
OP_READ = const("KV_OP_READ")
OP_WRITE = const("KV_OP_WRITE")

# status of a completion
ST_OK = const("KV_ST_OK")
ST_IO_ERROR = const("KV_ST_IO_ERROR")          # the device failed the request (result holds -errno) or it was short
ST_BAD_HEADER = const("KV_ST_BAD_HEADER")      # header missing, torn, or not the expected store/slot/generation/key
ST_BAD_CHECKSUM = const("KV_ST_BAD_CHECKSUM")  # payload checksum mismatch
ST_WORKER_LOST = const("KV_ST_WORKER_LOST")    # synthesized by the supervisor when the worker died or hung
ST_REFUSED = const("KV_ST_REFUSED")  # direct read: a record no honest client writes; nothing read, the connection dropped
ST_STALE = const("KV_ST_STALE")      # direct read: the slot no longer holds the page the client found; nothing read

#: supervisor -> worker, 112 bytes
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
    ("conn_gen", "<u8"),   # generation of the connection whose lease holds ``buf``
])
assert IO_REQUEST.itemsize == 112

F_CSUM = const("KV_F_CSUM")  # the client computed the payload checksum while copying the page in: the worker uses it

# kind of a completion
K_SUPERVISOR = const("KV_K_SUPERVISOR")  # the supervisor's request ``tag``
K_DIRECT = const("KV_K_DIRECT")          # a report of a client's direct read (tag 0; already answered to the client)

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
# K_DIRECT: ``tag`` is the reading connection, generation << 32 | connection id

#: one connection as a worker serves it (the worker's segment), 64 bytes
WCONN = np.dtype([
    ("gen", "<u8"),          # supervisor: the connection's generation; 0: none (the worker lets go)
    ("lease_start", "<u4"),  # supervisor: first arena buffer of its lease
    ("lease_count", "<u4"),  # supervisor: buffers in its lease
    ("salt", "u1", 32),      # supervisor: its tenant's salt (what its key ids are salted with)
    ("busy", "<i8"),         # worker: buffers of this id's lease it reads into or is taking (>= 0)
    ("salt_seq", "<u8"),     # supervisor: odd while it rewrites ``salt`` of a live connection, +2 each time
])
assert WCONN.itemsize == 64

REQUEST_RING = 1024
DONE_RING = 1024


WPINS = const("KV_MAX_DEPTH")  # the worker's pins: one per I/O slot (at most KV_MAX_DEPTH slots)


class WorkerRings:
    """The three rings of one worker's control segment, at fixed offsets, its connection table
    and its pins."""

    def __init__(self, buf: Any, max_clients: int = 0) -> None:
        o = 0
        self.reads = Ring(buf, o, REQUEST_RING, IO_REQUEST)
        o += Ring.nbytes(REQUEST_RING, IO_REQUEST)
        self.writes = Ring(buf, o, REQUEST_RING, IO_REQUEST)
        o += Ring.nbytes(REQUEST_RING, IO_REQUEST)
        self.done = Ring(buf, o, DONE_RING, IO_COMPLETION)
        o += Ring.nbytes(DONE_RING, IO_COMPLETION)
        self.conns = np.frombuffer(buf, dtype=WCONN, count=max_clients, offset=o)
        """The connections whose direct reads the worker serves, by connection id."""
        o += max_clients * WCONN.itemsize
        self.pins = np.frombuffer(buf, dtype="<i8", count=WPINS, offset=o)
        """By I/O slot: the slot (global id) a direct read in flight pins, -1 none (the worker writes)."""
        self._pins = FFI.cast("int64_t *", FFI.from_buffer(buf) + o)
        self._keep = buf

    def pinned(self, gid: int) -> bool:
        """Whether a direct read of this worker pins slot ``gid`` (the caller fences first)."""
        return bool(LIB.kv_contains_i64(self._pins, WPINS, gid))

    @staticmethod
    def nbytes(max_clients: int = 0) -> int:
        """Size of the control segment."""
        return (2 * Ring.nbytes(REQUEST_RING, IO_REQUEST) + Ring.nbytes(DONE_RING, IO_COMPLETION)
                + max_clients * WCONN.itemsize + 8 * WPINS)

    def reset(self) -> None:
        """Empty all three rings; a worker that is gone holds no buffer (only while no worker runs)."""
        self.reads.reset()
        self.writes.reset()
        self.done.reset()
        self.conns["busy"] = 0
        self.pins[:] = -1
