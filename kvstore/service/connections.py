"""Client connections of the service: the non-blocking handshake, who connected, and request intake.

Three rules live here (docs/ARCHITECTURE.md, "Requests are owned"):

* **No client can stall the service.** Hellos are read by a state machine fed
  from the supervisor's loop: a socket is read only when it has bytes, a hello
  must be complete within ``HELLO_DEADLINE_S`` of the connect and at most
  ``MAX_FRAME`` long, and at most ``MAX_PENDING_HELLOS`` handshakes wait at
  once (the oldest is dropped). Garbage, oversized or trickled hellos cost a
  few microseconds per loop turn, never a blocking ``recv``.
* **Who connected comes from the kernel** (``SO_PEERCRED``: pid, uid, gid),
  never from what the client says; tenants are granted from it
  (``StoreConfig.tenant_for``).
* **Requests are owned.** ``take`` copies a posted descriptor's op, keys,
  buffer ids and lengths into a ``Request`` once, after checking that the
  descriptor really is posted with the sequence number the ring names, that
  it is not already held, and that every buffer id is in the connection's
  lease, handed over, and not in use by another of its requests.
  ``answer`` is the only place the service writes a descriptor, and it
  writes only one the service took and has not answered.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ipc import lease as A
from ..shm.segment import Segment
from ..shm.wake import WakeWriter
from ..ipc import connection as P

MAX_PENDING_HELLOS = 64


@dataclass(frozen=True)
class PeerCred:
    """The connecting process as the kernel saw it at ``connect()`` (``SO_PEERCRED``)."""

    pid: int
    """Process id."""
    uid: int
    """Effective user id."""
    gid: int
    """Effective group id."""

    @classmethod
    def of(cls, sock: socket.socket) -> PeerCred:
        """Read the credentials of a connected Unix socket's peer."""
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid, uid, gid)

    def groups(self) -> frozenset[int]:
        """The peer's primary and supplementary groups (supplementary ones read from /proc while
        it lives; a process that is gone has only its primary group)."""
        out = {self.gid}
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        out.update(int(g) for g in line.split()[1:])
                        break
        except (OSError, ValueError):
            pass
        return frozenset(out)


@dataclass
class Pending:
    """A socket whose hello is still being read."""

    sock: socket.socket
    cred: PeerCred
    reader: P.HelloReader


class Handshakes:
    """Accepts connections and reads their hellos without ever blocking the loop.

    Invariant: every socket accepted is either in ``pending`` or was handed to the
    caller by ``poll`` or closed; none waits longer than ``HELLO_DEADLINE_S``.
    """

    def __init__(self, lsock: socket.socket, clock: Any = time.monotonic) -> None:
        self.lsock = lsock
        self.pending: dict[int, Pending] = {}
        self.clock = clock
        self.dropped = 0
        """Handshakes dropped: too slow, too large, malformed, or too many at once."""

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            s.setblocking(False)
            try:
                cred = PeerCred.of(s)
            except OSError:
                s.close()
                self.dropped += 1
                continue
            # a flood of silent connections displaces its own sender's, not other users' hellos
            mine = [fd for fd, p in self.pending.items() if p.cred.uid == cred.uid]
            if len(mine) >= P.MAX_PENDING_PER_UID:
                self._drop(min(mine, key=lambda fd: self.pending[fd].reader.deadline))
            elif len(self.pending) >= MAX_PENDING_HELLOS:
                oldest = min(self.pending, key=lambda fd: self.pending[fd].reader.deadline)
                self._drop(oldest)
            self.pending[s.fileno()] = Pending(s, cred, P.HelloReader(self.clock() + P.HELLO_DEADLINE_S))

    def _drop(self, fd: int) -> None:
        p = self.pending.pop(fd)
        p.sock.close()
        self.dropped += 1

    def poll(self) -> tuple[list[tuple[socket.socket, PeerCred, dict[str, Any]]], list[str]]:
        """Accept, read what arrived, expire the slow. Returns the complete hellos (socket,
        credentials, message; the socket now belongs to the caller) and the reasons of the
        handshakes dropped in this call."""
        self._accept()
        done: list[tuple[socket.socket, PeerCred, dict[str, Any]]] = []
        why: list[str] = []
        if not self.pending:
            return done, why
        for s in P.readable([p.sock for p in self.pending.values()]):
            fd = s.fileno()
            p = self.pending[fd]
            try:
                data = s.recv(P.MAX_FRAME + 8)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                why.append(f"pid {p.cred.pid}: {e}")
                self._drop(fd)
                continue
            if not data:
                why.append(f"pid {p.cred.pid}: closed before its hello")
                self._drop(fd)
                continue
            try:
                msg = p.reader.feed(data)
            except ValueError as e:
                why.append(f"pid {p.cred.pid}: {e}")
                try:
                    s.send(P.refusal("protocol", str(e)))
                except OSError:
                    pass
                self._drop(fd)
                continue
            if msg is not None:
                del self.pending[fd]
                done.append((s, p.cred, msg))
        now = self.clock()
        for fd in [fd for fd, p in self.pending.items() if p.reader.deadline <= now]:
            why.append(f"pid {self.pending[fd].cred.pid}: no complete hello within {P.HELLO_DEADLINE_S} s")
            self._drop(fd)
        return done, why

    def close(self) -> None:
        """Close every socket still in its handshake."""
        for fd in list(self.pending):
            self.pending.pop(fd).sock.close()


@dataclass
class Conn:
    """One client connection."""

    id: int
    sock: socket.socket
    seg: Segment
    chan: P.ClientChannel
    wake: WakeWriter
    """The service's write end of the client's wake-up (the client holds the only read end)."""
    wake_name: str
    lease_start: int
    lease_count: int
    cred: PeerCred
    salt: bytes = b""
    tenant: str = ""
    tenant_id: int = -1
    alive: bool = True
    ops: int = 0            # I/Os in flight that use this connection's buffers
    held: set[int] = field(default_factory=set)      # descriptors the service took and has not answered
    inuse: set[int] = field(default_factory=set)     # buffers the service holds for this connection
    rejected: int = 0       # requests refused as malformed
    generation: int = 0     # unique per connection in this service run (the workers' connection table)
    salt_seq: int = 0       # times its salt was rewritten, x2 (the keyspace word it publishes; never read back)
    dropped: bool = False   # forgotten: its segment (and lease) is gone
    counted: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(P.COUNTERS_WORDS, dtype=np.uint64))
    """The client's counters as last added to the stats."""

    @property
    def pid(self) -> int:
        """The client's pid (from the kernel)."""
        return self.cred.pid


@dataclass
class Request:
    """A client request being served: the service's own copy of everything it acts on."""

    conn: Conn
    desc: int
    seq: int
    op: int
    count: int
    flags: int
    t0: float
    keys: np.ndarray[Any, Any]
    bufs: list[int]
    lengths: np.ndarray[Any, Any]
    results: np.ndarray[Any, Any]
    csums: np.ndarray[Any, Any] | None = None  # put with FLAG_CSUM: the payload checksums the client computed
    outstanding: int = 0
    responded: bool = False
    quarantined: set[int] = field(default_factory=set)

    @property
    def cancelled(self) -> bool:
        """Whether the client gave up on this request (it timed out, or it is gone)."""
        if not self.conn.alive:
            return True  # its segment may be unmapped already; nobody waits for the answer
        return self.conn.chan.desc[self.desc].cancelled


def take(conn: Conn, m: Any, arena: A.BufferStates) -> Request | int | None:
    """Take the request a ring record announces.

    Returns the ``Request`` (the descriptor is now held by the service), or an ``S_*``
    status when the descriptor is held but the request is malformed (the caller answers
    it with that status), or None when the record names no descriptor the client
    posted (it is dropped and counted; nothing can be answered)."""
    di, seq = int(m["desc"]), int(m["seq"])
    if not 0 <= di < P.NDESC or di in conn.held:
        conn.rejected += 1
        return None
    d = conn.chan.desc[di]
    if d.state != P.D_POSTED:
        conn.rejected += 1
        return None
    conn.held.add(di)
    h = d.head
    if int(h["seq"][0]) != seq:
        conn.rejected += 1
        return P.S_BAD_REQUEST
    op, count, flags = int(h["op"][0]), int(h["count"][0]), int(h["flags"][0])
    mb = conn.chan.max_batch
    if op == P.OP_PING:
        count = 0
    elif op not in (P.OP_LOOKUP, P.OP_GET, P.OP_PUT, P.OP_PIN, P.OP_UNPIN) or count <= 0:
        conn.rejected += 1
        return P.S_BAD_REQUEST
    elif count > mb:
        conn.rejected += 1
        return P.S_TOO_LARGE
    bufs: list[int] = []
    if op in (P.OP_GET, P.OP_PUT):
        bufs = d.bufs[:count].tolist()
        lo, hi = conn.lease_start, conn.lease_start + conn.lease_count
        if (len(set(bufs)) != count or any(not lo <= b < hi or b in conn.inuse for b in bufs)
                or any(arena.state(b) != A.SERVICE for b in bufs)):
            conn.rejected += 1
            return P.S_BAD_REQUEST
        conn.inuse.update(bufs)
    return Request(conn, di, seq, op, count, flags, time.monotonic(), d.keys[:count].copy(), bufs,
                   d.lengths[:count].copy(), np.zeros(count, dtype="<i4"),
                   d.csums[:count].copy() if op == P.OP_PUT and flags & P.FLAG_CSUM else None)


def answer(conn: Conn, desc: int, seq: int, status: int, value: int = 0,
           results: np.ndarray[Any, Any] | None = None) -> None:
    """Write the answer into a descriptor the service holds and hand it back to the client."""
    if desc not in conn.held:  # never write a descriptor the client owns
        return
    conn.held.discard(desc)
    if not conn.alive:
        return
    d = conn.chan.desc[desc]
    if results is not None and len(results):
        d.results[:len(results)] = results
    h = d.head
    h["status"] = status
    h["value"] = value
    h["answered"] = seq
    d.set_state(P.D_ANSWERED)
    conn.wake.post()


def give_back(conn: Conn, buf: int, arena: A.BufferStates, state: int) -> None:
    """The service is done with ``buf``: hand it to the client (CLIENT) or free it (FREE). Nothing
    to do once the connection is dropped (its lease went with it; the index may name another
    connection's buffer by now)."""
    conn.inuse.discard(buf)
    if not conn.dropped:
        arena.set_state(buf, state)
