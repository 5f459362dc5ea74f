"""The client <-> service protocol: a Unix-socket hello, then a shm segment per connection.

Hello (framing: 4-byte little-endian length, then a msgpack map; docs/FORMAT.md)::

    client -> service  {"v": 1, "op": "hello", "pid": int, "tenant": str}
    service -> client  {"v": 1, "ok": true, "client_id": int, "page_size": int,
                        "max_batch": int, "lease_start": int, "lease_count": int,
                        "arena": str, "control": str, "states_offset": int,
                        "segment": str, "sem": str, "doorbell": str,
                        "service_pid": int, "store": str, "server": str}
                   or  {"v": 1, "ok": false, "error": str, "kind": str}

The socket stays open for the life of the connection: its EOF tells the
service the client is gone (and the client that the service is gone).

Connection segment layout (``ClientChannel``)::

    requests   Ring of MSG (capacity RING_CAP), client -> service
    responses  Ring of MSG (capacity RING_CAP), service -> client
    keys       max_batch x 32 bytes: BLAKE2b-256 of each key (unsalted; the
               service mixes in the tenant salt)
    bufs       max_batch x i32: arena buffer index per key (get, put)
    lengths    max_batch x u32: payload bytes per key (put in, get out)
    results    max_batch x i32: R_* per key, written by the service

One request is outstanding per connection at a time (the client serializes
its calls), so the batch arrays are not shared between requests.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import numpy as np

from ..shm.ring import Ring

VERSION = 1
MAX_FRAME = 1 << 16
RING_CAP = 8

OP_LOOKUP = 1
OP_GET = 2
OP_PUT = 3
OP_PING = 4
OP_PIN = 5
OP_UNPIN = 6

FLAG_WAIT = 1

# request / response status
S_OK = 0
S_BAD_REQUEST = 1
S_TOO_LARGE = 2
S_SHUTTING_DOWN = 3

# per-key results
R_MISS = 0
R_HIT = 1
R_STORED = 2
R_SKIPPED = 3    # the key is already stored (or being stored)
R_DROPPED = 4    # no slot could be freed, or the write failed
R_QUEUED = 5     # accepted, the write completes later (put without wait)
R_PINNED = 6     # pin: pinned (or already pinned); unpin: unpinned
R_QUOTA = 7      # pin: the tenant's pin quota is reached

#: one ring record, 32 bytes
MSG = np.dtype([
    ("req_id", "<u8"),   # client-chosen, echoed in the response
    ("op", "<u4"),       # OP_* (1 lookup, 2 get, 3 put, 4 ping, 5 pin, 6 unpin)
    ("count", "<u4"),    # keys in the batch arrays
    ("flags", "<u4"),    # FLAG_*
    ("status", "<i4"),   # S_* (response)
    ("value", "<i8"),    # lookup: leading keys available (response)
])
assert MSG.itemsize == 32


class ClientChannel:
    """Views over one connection's segment (both sides build the same views)."""

    def __init__(self, buf: Any, max_batch: int) -> None:
        self.max_batch = max_batch
        o = 0
        self.requests = Ring(buf, o, RING_CAP, MSG)
        o += Ring.nbytes(RING_CAP, MSG)
        self.responses = Ring(buf, o, RING_CAP, MSG)
        o += Ring.nbytes(RING_CAP, MSG)
        self.keys = np.frombuffer(buf, dtype=np.uint8, count=32 * max_batch, offset=o).reshape(max_batch, 32)
        o += 32 * max_batch
        self.bufs = np.frombuffer(buf, dtype="<i4", count=max_batch, offset=o)
        o += 4 * max_batch
        self.lengths = np.frombuffer(buf, dtype="<u4", count=max_batch, offset=o)
        o += 4 * max_batch
        self.results = np.frombuffer(buf, dtype="<i4", count=max_batch, offset=o)

    @staticmethod
    def nbytes(max_batch: int) -> int:
        """Size of a connection segment."""
        return 2 * Ring.nbytes(RING_CAP, MSG) + max_batch * (32 + 12)


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one length-prefixed msgpack map."""
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Receive one frame; raises ``ConnectionError`` on EOF and ``ValueError`` on a bad frame."""
    head = _recv_exact(sock, 4)
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    obj = msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=True)
    if not isinstance(obj, dict):
        raise ValueError("frame is not a map")
    return obj


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)
