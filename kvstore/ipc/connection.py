"""The client <-> service protocol: a Unix-socket hello, then a shm segment per connection.

Hello (framing: 4-byte little-endian length, then a msgpack map; docs/FORMAT.md)::

    client -> service  {"v": 6, "op": "hello", "tenant": str}
    service -> client  {"v": 6, "ok": true, "client_id": int, "page_size": int,
                        "max_batch": int, "lease_start": int, "lease_count": int,
                        "control": str, "slots": int, "salt": bytes,
                        "segment": str, "states_offset": int, "buffers_offset": int,
                        "doorbell": str, "workers": [str],
                        "service_pid": int, "store": str, "server": str, "tenant": str}
                       with two file descriptors (SCM_RIGHTS): the connection segment
                       and the read end of the client's wake-up
                   or  {"v": 6, "ok": false, "error": str, "kind": str}

``slots`` gives the control segment's layout (shm/control.py), which the client maps
read-only to answer lookups itself from the key index; ``salt`` is the granted tenant's
salt, with which it computes the digests it looks up (kvstore/digests.py). The
connection's own segment (``ClientChannel.layout``: this channel, then its lease's state
words and buffers) is owner-only: the client maps it from the descriptor sent with the
answer, so no process of another user can open another connection's segment. Wake-ups
are FIFOs (shm/wake.py): ``doorbell`` (the supervisor's) and ``workers`` (each I/O
worker's) name FIFOs the client may open for writing only; its own wake-up is the read
end sent with the answer, which no other process of another user can open.

The service reads the hello without blocking (a state machine fed by its loop)
and drops a client whose hello is not complete within ``HELLO_DEADLINE_S``, is
larger than ``MAX_FRAME`` or is not a valid map. Who connected (pid, uid, gid)
comes from the socket (``SO_PEERCRED``), never from the hello. The socket stays
open for the life of the connection with nothing more sent on it: its EOF
tells the service the client is gone (and the client that the service is
gone); any byte sent after the hello is a protocol violation that ends the
connection.

Connection segment layout (``ClientChannel``)::

    requests     Ring of REQ (capacity NDESC), client -> service: "descriptor d holds request seq"
    descriptors  NDESC x Descriptor: a DESC_HEAD (64 bytes), then
                     keys     max_batch x 32 bytes: BLAKE2b-256 of each key (unsalted;
                              the service mixes in the tenant salt)
                     bufs     max_batch x i32: arena buffer index per key (get, put)
                     lengths  max_batch x u32: payload bytes per key (put)
                     results  max_batch x i32: R_* per key (written by the service when it answers)
                     csums    max_batch x u64: put with FLAG_CSUM: xxh3_64 of each page
                 each padded to a multiple of 64 bytes
    counters     COUNTERS_WORDS u64, written by the client only (the service adds what they
                 grew by to its stats): lookups, keys looked up, gets, keys asked for in
                 gets, pages missed in gets, then HIST_BUCKETS of direct-get latency
    direct       per device, a Ring of DIRECT_REQ (capacity: 2 x max_batch rounded up to a
                 power of two), client -> that device's I/O worker
    per buffer of the lease (max_batch each):
                 pins   i64  client: slot (gid) its direct read into this buffer pins, -1 none
                 dseq   u64  client: seq of the direct read posted into this buffer
                 ddev   u32  client: device of that read
                 wstat  i32  worker: status of the read (ST_* of ipc/iorings.py)
                 wseq   u64  worker: seq of the read ``wstat`` is for (store-release)
    keyspace     64 bytes, service -> client: u64 ``seq`` (odd while the service writes), then
                 the connection's current tenant salt (32 bytes). The service rewrites it when
                 an administrator moves the tenant's key space (``mass-ctl kvcache invalidate``);
                 the client takes the salt for its own lookups when ``seq`` changed (a seqlock).
                 The client could write it too, and would only mislead its own lookups: the
                 service never reads it back (it counts ``seq`` in its own record).
    wake         64 bytes, client -> I/O workers: u64 ``wake_seq``, the direct read the client
                 waits for next. A worker wakes the client when it holds none of its reads any
                 more, or when it answers the read ``wake_seq`` names: a client keeping several
                 batches in flight (``get_async``) is woken when the one it waits for lands, not
                 when all have. A wrong value only wakes that client too often or too late.

Direct reads (gets that bypass the supervisor; see client.py ``_post_direct``): the client
finds the slot in the shared index, notes it in ``pins`` (its own bookkeeping: the service
does not ask it), checks the slot is still the one it found, hands the buffer over by
setting its state to DIRECT tagged with the connection's generation, and posts a
DIRECT_REQ to the device's ring. The worker pins the slot in its own segment, fences, and
checks the slot table's register (the supervisor retires, fences, and checks the workers'
pins before it reuses a slot, so one of the two sees the other). The worker takes the buffer with a compare-and-swap
DIRECT -> READING (the generation must match: a record left by a connection that is
gone cannot take a buffer of the next one), reads, validates exactly as for the
supervisor's reads, writes ``wstat`` and ``wseq``, sets the state CLIENT and posts the
client's wake-up. A client that times out takes back a buffer the worker has not taken
yet (the same compare-and-swap, DIRECT -> CLIENT); one being read stays the worker's.

Ownership (the invariant the first version lacked): a descriptor belongs to
exactly one side at a time, named by its ``state`` word (store-release to hand
it on, load-acquire to take it):

    D_FREE -> D_POSTED      client filled it and posts it          (client)
    D_POSTED -> D_ANSWERED  service wrote results, status, value   (service)
    D_ANSWERED -> D_FREE    client read the answer                 (client)

While a descriptor is D_POSTED the client does not write it (except the
``cancel`` word) and the service reads it exactly once, at intake, copying
the op, keys, buffer ids and lengths into its own memory: nothing the service
acts on afterwards lives where a client can rewrite it. The service writes
only at the answer, and only to a descriptor it took and has not answered. A
call that times out sets ``cancel`` and leaves the descriptor (and its
buffers) with the service; the next call uses another descriptor. The service
answers every request it took, a cancelled one with ``S_CANCELLED`` (not
executed if still queued; a get's buffers come back FREE), which hands the
descriptor back. With all descriptors held by the service, a call waits for
one (up to its timeout).
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .._native.lib import FFI, LIB
from ..shm.ring import Ring

VERSION = 6  # 4: wake-ups are FIFOs, the client's sent as a second descriptor; 5: the channel's keyspace;
            # 6: the channel's wake word, direct-read rings of twice the lease
MAX_FRAME = 1 << 16
HELLO_DEADLINE_S = 2.0   # a hello must be complete this long after connect
LISTEN_BACKLOG = 1024    # connections the kernel queues for accept (capped by net.core.somaxconn)
MAX_PENDING_PER_UID = 8  # hellos one local user may have in progress at once (a flood drops its own)
NDESC = 8                # request descriptors per connection (requests in flight, timed-out ones included)
HIST_BUCKETS = 32        # as the stats block's histograms
COUNTERS_WORDS = 5 + HIST_BUCKETS  # client-written counters, after the descriptors
POLL_READS = 2  # a direct-read batch this small is latency-bound: the client polls for its answer,
                # and the worker that served it polls a little before it sleeps (no wake-ups)
KEYSPACE_BYTES = 64  # salt seq and salt (service -> client)
WAKE_BYTES = 64  # the channel's last part: the read the client waits for (client -> workers)
C_LOOKUPS, C_LOOKUP_KEYS, C_GETS, C_GET_KEYS, C_GET_MISSES, C_HIST = range(6)

#: client -> I/O worker: one direct read, 64 bytes
DIRECT_REQ = np.dtype([
    ("seq", "<u8"),          # the client's sequence number for this read (echoed in wseq)
    ("buf", "<u2"),          # buffer index within the connection's lease
    ("area", "<u2"),         # area of the slot on the worker's device
    ("payload_len", "<u4"),  # payload bytes the slot table gave (not used: the worker reads the register)
    ("slot", "<u8"),         # slot index in the area
    ("gen", "<u8"),          # generation the client found in the slot table
    ("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"),  # the key id (unsalted; the worker salts it)
])
assert DIRECT_REQ.itemsize == 64

OP_LOOKUP = 1
OP_GET = 2
OP_PUT = 3
OP_PING = 4
OP_PIN = 5
OP_UNPIN = 6

FLAG_WAIT = 1
FLAG_CSUM = 2    # put: ``csums`` holds each page's xxh3_64, computed by the client while copying it in

# request status (DESC_HEAD.status)
S_OK = 0
S_BAD_REQUEST = 1
S_TOO_LARGE = 2
S_SHUTTING_DOWN = 3
S_CANCELLED = 4      # the client cancelled it (timed out); results are not meaningful

# per-key results
R_MISS = 0
R_HIT = 1
R_STORED = 2
R_SKIPPED = 3    # the key is already stored (or being stored)
R_DROPPED = 4    # no slot could be freed, or the write failed
R_QUEUED = 5     # accepted, the write completes later (put without wait)
R_PINNED = 6     # pin: pinned (or already pinned); unpin: unpinned
R_QUOTA = 7      # pin: the tenant's pin quota is reached

# descriptor ownership (DESC_HEAD.state)
D_FREE = 0
D_POSTED = 1
D_ANSWERED = 2

#: one request ring record, 16 bytes
REQ = np.dtype([
    ("seq", "<u8"),      # the request's sequence number (also in its descriptor)
    ("desc", "<u4"),     # descriptor index, < NDESC
    ("pad", "<u4"),
])
assert REQ.itemsize == 16

#: head of a descriptor, 64 bytes (one cache line)
DESC_HEAD = np.dtype([
    ("state", "<u4"),    # D_*: who owns the descriptor (atomic)
    ("cancel", "<u4"),   # 1: the client gave up on this request (atomic, client writes)
    ("seq", "<u8"),      # client: sequence number of the posted request
    ("op", "<u4"),       # client: OP_*
    ("count", "<u4"),    # client: keys in the batch arrays
    ("flags", "<u4"),    # client: FLAG_*
    ("status", "<i4"),   # service: S_*
    ("value", "<i8"),    # service: lookup: leading keys available; pin: pages pinned
    ("answered", "<u8"), # service: seq of the request this answer is for
    ("pad", "<u8", 2),
])
assert DESC_HEAD.itemsize == 64


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _round4k(n: int) -> int:
    return (n + 4095) // 4096 * 4096


class Descriptor:
    """Views over one request descriptor (see the module docstring for who may touch what when)."""

    def __init__(self, buf: Any, base: Any, offset: int, max_batch: int, index: int) -> None:
        self.index = index
        """Position in the connection's descriptor array (what a REQ record names)."""
        self.head = np.frombuffer(buf, dtype=DESC_HEAD, count=1, offset=offset)
        self._state = FFI.cast("uint32_t *", base + offset)
        self._cancel = FFI.cast("uint32_t *", base + offset + 4)
        o = offset + DESC_HEAD.itemsize
        self.keys = np.frombuffer(buf, dtype=np.uint8, count=32 * max_batch, offset=o).reshape(max_batch, 32)
        o += 32 * max_batch
        self.bufs = np.frombuffer(buf, dtype="<i4", count=max_batch, offset=o)
        o += 4 * max_batch
        self.lengths = np.frombuffer(buf, dtype="<u4", count=max_batch, offset=o)
        o += 4 * max_batch
        self.results = np.frombuffer(buf, dtype="<i4", count=max_batch, offset=o)
        o += 4 * max_batch
        self.csums = np.frombuffer(buf, dtype="<u8", count=max_batch, offset=o)

    @staticmethod
    def nbytes(max_batch: int) -> int:
        """Bytes of one descriptor."""
        return _round64(DESC_HEAD.itemsize + max_batch * (32 + 12 + 8))

    @property
    def state(self) -> int:
        """Owner state (load-acquire)."""
        return int(LIB.kv_load_acquire_u32(self._state))

    def set_state(self, state: int) -> None:
        """Hand the descriptor on (store-release). Only its current owner may call this."""
        LIB.kv_store_release_u32(self._state, state)

    @property
    def cancelled(self) -> bool:
        """Whether the client gave up on the request (load-acquire)."""
        return bool(LIB.kv_load_acquire_u32(self._cancel))

    def set_cancel(self, v: int) -> None:
        """Client: mark the posted request cancelled (1), or clear the mark before posting (0)."""
        LIB.kv_store_release_u32(self._cancel, v)


def direct_capacity(max_batch: int) -> int:
    """Records of one direct-read ring: twice ``max_batch``, rounded up to a power of two. Twice:
    reads a client gave up on (a timeout, a cancelled or dropped ``get_async``) leave their
    records in the ring until the worker skips them, and a lease's worth of those must not
    leave the next lease's worth of reads without room (each would be a miss)."""
    cap = 1
    while cap < 2 * max_batch:
        cap *= 2
    return cap


class ClientChannel:
    """Views over one connection's segment (client, supervisor and workers build the same views):
    numpy arrays for Python, and a pointer beside each per-buffer array (``_pins``, ``_dseq``,
    ``_ddev``, ``_wstat``, ``_wseq``, ``_wake_seq``) for compiled code."""

    def __init__(self, buf: Any, max_batch: int, n_devices: int) -> None:
        self.max_batch = max_batch
        base = FFI.from_buffer(buf)
        self._keep = base
        self.requests = Ring(buf, 0, NDESC, REQ)
        o = Ring.nbytes(NDESC, REQ)
        self.desc: list[Descriptor] = []
        for i in range(NDESC):
            self.desc.append(Descriptor(buf, base, o, max_batch, i))
            o += Descriptor.nbytes(max_batch)
        self.counters = np.frombuffer(buf, dtype="<u8", count=COUNTERS_WORDS, offset=o)
        """See the module doc (one writer: the client)."""
        o += _round64(8 * COUNTERS_WORDS)
        cap = direct_capacity(max_batch)
        self.direct: list[Ring] = []
        for _ in range(n_devices):
            self.direct.append(Ring(buf, o, cap, DIRECT_REQ))
            o += Ring.nbytes(cap, DIRECT_REQ)
        self.pins = np.frombuffer(buf, dtype="<i8", count=max_batch, offset=o)
        self._pins = FFI.cast("int64_t *", base + o)
        o += _round64(8 * max_batch)
        self.dseq = np.frombuffer(buf, dtype="<u8", count=max_batch, offset=o)
        self._dseq = FFI.cast("uint64_t *", base + o)
        o += _round64(8 * max_batch)
        self.ddev = np.frombuffer(buf, dtype="<u4", count=max_batch, offset=o)
        self._ddev = FFI.cast("uint32_t *", base + o)
        o += _round64(4 * max_batch)
        self.wstat = np.frombuffer(buf, dtype="<i4", count=max_batch, offset=o)
        self._wstat = FFI.cast("int32_t *", base + o)
        o += _round64(4 * max_batch)
        self._wseq_off = o
        self.wseq = np.frombuffer(buf, dtype="<u8", count=max_batch, offset=o)
        self._wseq = FFI.cast("uint64_t *", base + o)
        o += _round64(8 * max_batch)
        self._kseq = FFI.cast("uint64_t *", base + o)
        self._ksalt = np.frombuffer(buf, dtype=np.uint8, count=32, offset=o + 8)
        o += KEYSPACE_BYTES
        self._wake_seq = FFI.cast("uint64_t *", base + o)

    def publish_salt(self, salt: bytes, seq: int) -> None:
        """Service: the connection's tenant salt changed; ``seq`` (even, the service's own count:
        the word here is the client's to scribble on, never read back) is published after the
        salt, ``seq - 1`` (odd) while it is written."""
        LIB.kv_store_release_u64(self._kseq, seq - 1)
        LIB.kv_fence()
        self._ksalt[:] = np.frombuffer(salt, dtype=np.uint8)
        LIB.kv_store_release_u64(self._kseq, seq)

    def salt_seq(self) -> int:
        """Client: the keyspace word (0 until the service first changes the salt)."""
        return int(LIB.kv_load_acquire_u64(self._kseq))

    def read_salt(self, seq: int) -> bytes | None:
        """Client: the salt published with ``seq`` (``salt_seq``), or None when it was being
        rewritten meanwhile (look again)."""
        if seq & 1:
            return None
        salt = self._ksalt.tobytes()
        LIB.kv_fence()
        return salt if int(LIB.kv_load_acquire_u64(self._kseq)) == seq else None

    def wait_for(self, seq: int) -> None:
        """Client: name the direct read it waits for next (a worker answering it wakes the
        client), then fence: the caller looks at that read's ``wseq`` again after this, and a
        worker looks at this word after publishing ``wseq`` (one of the two sees the other)."""
        LIB.kv_store_release_u64(self._wake_seq, seq)
        LIB.kv_fence()

    def pinned(self, gid: int) -> bool:
        """Whether one of this connection's direct reads pins slot ``gid`` (the caller fences first)."""
        return bool(LIB.kv_contains_i64(self._pins, self.max_batch, gid))

    def done_seq(self, b: int) -> int:
        """The seq of the direct read whose result ``wstat[b]`` holds (load-acquire)."""
        return int(LIB.kv_load_acquire_u64(self._wseq + b))

    def set_done(self, b: int, seq: int, status: int) -> None:
        """Worker: publish the result of the direct read ``seq`` into lease buffer ``b``."""
        self.wstat[b] = status
        LIB.kv_store_release_u64(self._wseq + b, seq)

    @staticmethod
    def nbytes(max_batch: int, n_devices: int) -> int:
        """Size of the channel (the start of a connection segment)."""
        return (Ring.nbytes(NDESC, REQ) + NDESC * Descriptor.nbytes(max_batch) + _round64(8 * COUNTERS_WORDS)
                + n_devices * Ring.nbytes(direct_capacity(max_batch), DIRECT_REQ)
                + 2 * _round64(8 * max_batch) + 2 * _round64(4 * max_batch) + _round64(8 * max_batch)
                + KEYSPACE_BYTES + WAKE_BYTES)

    @staticmethod
    def layout(max_batch: int, n_devices: int, page_size: int) -> tuple[int, int, int]:
        """The whole connection segment: the channel, then the lease's state words and its
        ``max_batch`` page buffers, each part on a 4096-byte boundary. Returns (states
        offset, buffers offset, segment size)."""
        states = _round4k(ClientChannel.nbytes(max_batch, n_devices))
        buffers = states + _round4k(4 * max_batch)
        return states, buffers, buffers + max_batch * (4096 + page_size)


def encode_frame(obj: dict[str, Any]) -> bytes:
    """One length-prefixed msgpack map."""
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<I", len(data)) + data


def refusal(kind: str, error: str) -> bytes:
    """The frame that refuses a hello (``kind``: protocol, tenant, busy)."""
    return encode_frame({"v": VERSION, "ok": False, "kind": kind, "error": error})


def decode_frame(data: bytes) -> dict[str, Any]:
    """Decode a frame's body; ``ValueError`` unless it is a msgpack map."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise ValueError(f"frame is not valid msgpack: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("frame is not a map")
    return obj


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one length-prefixed msgpack map."""
    sock.sendall(encode_frame(obj))


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Receive one frame; raises ``ConnectionError`` on EOF and ``ValueError`` on a bad frame."""
    head = _recv_exact(sock, 4)
    (n,) = struct.unpack("<I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return decode_frame(_recv_exact(sock, n))


def readable(socks: Sequence[socket.socket]) -> list[socket.socket]:
    """Those of ``socks`` with bytes to read, or closed, now. (poll, not select: select refuses
    descriptors from 1024 up, which a service of many clients or a busy engine process has.)"""
    p = select.poll()
    by_fd: dict[int, socket.socket] = {}
    for s in socks:
        fd = s.fileno()
        by_fd[fd] = s
        p.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ev in p.poll(0) if fd in by_fd]  # POLLIN, or HUP/ERR: recv tells


def recv_frame_fds(sock: socket.socket, max_fds: int = 2) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame and the file descriptors sent with it (``SCM_RIGHTS``; they arrive with
    its first bytes). The caller owns (and closes) the descriptors."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 4 + MAX_FRAME, max_fds)
    fds = list(fds)
    try:
        if not data:
            raise ConnectionError("connection closed")
        buf = bytearray(data)
        while len(buf) < 4:
            buf += _recv_exact(sock, 4 - len(buf))
        (n,) = struct.unpack_from("<I", buf)
        if n > MAX_FRAME:
            raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        if len(buf) < 4 + n:
            buf += _recv_exact(sock, 4 + n - len(buf))
        return decode_frame(bytes(buf[4:4 + n])), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class HelloReader:
    """Non-blocking reader of one hello frame, fed whatever bytes arrived.

    ``feed`` returns the decoded map once the frame is complete, None while it
    is not, and raises ``ValueError`` for an oversized or malformed frame or
    bytes beyond the frame. The caller enforces the deadline.
    """

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.buf = bytearray()

    def feed(self, data: bytes) -> dict[str, Any] | None:
        """Add received bytes; the hello when complete."""
        self.buf += data
        if len(self.buf) < 4:
            return None
        (n,) = struct.unpack_from("<I", self.buf)
        if n > MAX_FRAME:
            raise ValueError(f"hello frame of {n} bytes exceeds {MAX_FRAME}")
        if len(self.buf) < 4 + n:
            return None
        if len(self.buf) > 4 + n:
            raise ValueError("bytes after the hello frame")
        return decode_frame(bytes(self.buf[4:]))
