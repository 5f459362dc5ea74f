"""The service's parts over one store, in one process, stepped by hand (tests/service).

The state (``StoreState``) is built over anonymous memory from a real store on a file device;
a test connects to the real ``Clients`` socket with a real hello, then plays both neighbours of
``Requests``: the client (it fills descriptors and posts them to the connection's ring) and the
device worker (it takes the I/O records from the worker's rings and writes completions).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvstore.digests import key_id, salted_words
from kvstore.ipc import connection as P
from kvstore.ipc import lease as A
from kvstore.ipc.iorings import IO_COMPLETION, OP_READ, ST_OK
from kvstore.service.changes import Change
from kvstore.service.clients import Clients
from kvstore.service.reloads import verified_membership
from kvstore.service.requests import Requests
from kvstore.service.runtime import Runtime
from kvstore.service.state import StoreState
from kvstore.service.workers import Workers
from kvstore.shm.segment import Segment
from kvstore.testing import make_store

PAGE = 16 << 10


class FakeProc:
    """Stands for a live worker process (``Requests`` dispatches only to workers that have one)."""

    pid = 0
    exitcode = None

    def is_alive(self) -> bool:
        return True


class Service:
    """The service's parts over one store, stepped by hand."""

    def __init__(self, home: Path, devices: list[str], servers: list[str] | None = None, spare: int = 0) -> None:
        self.home = home
        self.cfg = cfg = make_store(home, "u", devices, PAGE, servers, spare=spare)
        name = cfg.servers[0].name
        m = verified_membership(cfg, name, 0, home, structlog.get_logger())
        self.rt = Runtime(cfg.name, name, home, anonymous=True)
        self.rt.rundir.mkdir(parents=True, exist_ok=True)
        self.st = StoreState.build(cfg, name, 0, tuple(m.sbs), self.rt)
        self.pool = Workers(self.st, self.rt, None, queued=lambda d: self.requests.queued(d),
                            on_lost=lambda d, dead: self.requests.fail_device(d, dead),
                            on_replaced=lambda d: self.clients.fail_direct_reads(d))
        for w in self.pool.slots:
            w.proc = FakeProc()
        self.clients = Clients(self.st, self.rt, self.pool.slots)
        self.st.alloc.reading = self.clients.reading
        self.requests = Requests(self.st, self.pool.slots, self.clients)
        self.clients.listen()
        self.changes: list[Change] = []
        self.st.changes.subscribe(self.changes.append)

    def turn(self) -> int:
        self.clients.turn(0.0)
        return self.requests.turn(0.0)

    def worker_takes(self, op: int) -> np.ndarray[Any, Any]:
        """The I/O records the workers were handed (what a worker would read or write)."""
        ring = [w.rings.reads if op == OP_READ else w.rings.writes for w in self.pool.slots]
        return np.concatenate([r.get_batch(1024) for r in ring])

    def worker_completes(self, recs: np.ndarray[Any, Any], status: int = ST_OK) -> None:
        """Completions for ``recs`` as a worker writes them (device 0's ring: one device here)."""
        done = np.zeros(len(recs), dtype=IO_COMPLETION)
        done["tag"] = recs["tag"]
        done["status"] = status
        done["result"] = recs["length"]
        self.pool.slots[0].rings.done.put_many(done)

    def close(self) -> None:
        self.clients.close()
        self.clients.drop_all()
        self.pool.close()
        self.st.close(checkpoint=False)
        self.rt.close()


class Client:
    """A client as the wire sees it: a real hello, then descriptors and ring records by hand."""

    def __init__(self, svc: Service, tenant: str = "") -> None:
        self.svc = svc
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(svc.rt.sock_path))
        P.send_frame(self.sock, {"v": P.VERSION, "op": "hello", "tenant": tenant})
        for _ in range(1000):  # the service reads the hello over its turns, never blocking
            svc.turn()
            if P.readable([self.sock]):
                break
        hello, fds = P.recv_frame_fds(self.sock)
        assert hello["ok"], hello
        self.hello = hello
        self.seg = Segment.adopt(hello["segment"], fds[0])
        os.close(fds[1])  # the wake-up's read end: this client does not wait on it
        self.nb = hello["max_batch"]
        states, buffers, _ = P.ClientChannel.layout(self.nb, len(hello["areas"]), hello["page_size"])
        self.arena = A.Arena(self.seg.buf, states, buffers, self.nb, hello["page_size"], first=hello["lease_start"])
        self.chan = P.ClientChannel(self.seg.buf, self.nb, len(hello["areas"]))
        self.seq = 1

    def post(self, desc: int, op: int, keys: list[bytes], bufs: Sequence[int] = (), pages: Sequence[bytes] = ()) -> int:
        """Fill descriptor ``desc`` and post it, as ``KVCacheClient._post`` does."""
        d = self.chan.desc[desc]
        assert d.state == P.D_FREE
        for i, k in enumerate(keys):
            d.keys[i] = np.frombuffer(key_id(k), dtype=np.uint8)
        for i, b in enumerate(bufs):
            if pages:
                self.arena.payload(b, PAGE)[:] = pages[i]
                d.lengths[i] = PAGE
            d.bufs[i] = b
            self.arena.set_state(b, A.SERVICE)
        h = d.head
        seq = self.seq
        self.seq += 1
        h["seq"], h["op"], h["count"], h["flags"] = seq, op, len(keys), P.FLAG_WAIT
        d.set_cancel(0)
        d.set_state(P.D_POSTED)
        self.chan.requests.put_nowait((seq, desc, 0))
        return seq

    def answer(self, desc: int) -> tuple[int, int, list[int]] | None:
        """(status, value, results) once the service answered ``desc``; None before. Frees it."""
        d = self.chan.desc[desc]
        if d.state != P.D_ANSWERED:
            return None
        h = d.head
        out = int(h["status"][0]), int(h["value"][0]), d.results[:int(h["count"][0])].tolist()
        d.set_state(P.D_FREE)
        return out

    def buffers(self, n: int, skip: int = 0) -> list[int]:
        first = self.hello["lease_start"] + skip
        return list(range(first, first + n))

    def close(self) -> None:
        self.sock.close()
        self.seg.close()


def digests(svc: Service, keys: list[bytes], tenant: str = "") -> np.ndarray[Any, Any]:
    ids = np.frombuffer(b"".join(key_id(k) for k in keys), dtype=np.uint8).reshape(-1, 32)
    return salted_words(ids, svc.cfg.tenant_salt(svc.cfg.tenant_for(tenant, 0, frozenset())))


