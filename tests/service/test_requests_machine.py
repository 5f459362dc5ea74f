"""The request engine as a protocol, under random interleavings (hypothesis state machine, one process).

A client posts puts and gets over a few keys (three stored at the start), cancels some, and releases the pages it got;
a device worker takes I/O records in any order and completes each as valid or as a lying
device (bad checksum); the service turns in between; a worker may be lost with I/O on it.
Whatever the order, the service:

- answers every request it took exactly once, and a cancelled one as cancelled or done;
- answers a page as stored only after a write of that key's digest completed, and a get as a
  hit only after a read of that key's digest completed valid;
- finds every key answered as stored until a read of it fails validation;
- gives every buffer back (FREE after a put or a cancelled get, the client's after a get), and
  at the end holds no I/O, no pin, no buffer and no descriptor.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.ipc import connection as P
from kvstore.ipc import lease as A
from kvstore.ipc.iorings import OP_READ, OP_WRITE, ST_BAD_CHECKSUM, ST_OK
from kvstore.shm.segment import home_prefix, leftovers

from .harness import PAGE, Client, Service, digests

KEYS = [f"key-{i}".encode() for i in range(5)]


class RequestsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvstore-rq-"))
        home = self.tmp / "mass"
        home.mkdir()
        dev = self.tmp / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate(8 << 20)
        self.home = home
        self.svc = Service(home, [str(dev)])
        self.c = Client(self.svc)
        self.d0 = {int(w[0]): k for k, w in zip(KEYS, digests(self.svc, KEYS))}
        self.free_bufs = set(self.c.buffers(self.c.nb))
        self.mine: set[int] = set()   # buffers a get gave the client (CLIENT until released)
        self.posted: dict[int, tuple[int, list[bytes], list[int]]] = {}  # desc -> (op, keys, bufs)
        self.cancelled: set[int] = set()
        self.taken: list[np.ndarray[Any, Any]] = []   # records the worker holds, not completed
        self.ok_reads: set[bytes] = set()             # keys whose read completed valid
        self.ok_writes: set[bytes] = set()            # keys whose write completed
        self.stored: set[bytes] = set()               # answered stored, not distrusted since
        self.dropped: set[bytes] = set()              # dropped by a failed read since their last write
        # three keys stored at the start, so that most gets read from the (fake) device
        self.post(KEYS[:3], True)
        self.drain()
        assert self.stored == set(KEYS[:3])

    def teardown(self) -> None:
        try:
            self.drain()
            s = self.svc
            assert not s.requests.pending and not s.requests.writing
            assert s.st.alloc.pinned_slots == 0
            conn = next(iter(s.clients.conns.values()))
            assert not conn.held and not conn.inuse and conn.ops == 0
            for b in self.mine:
                self.c.arena.set_state(b, A.FREE)
            assert [self.c.arena.state(b) for b in self.c.buffers(self.c.nb)] == [A.FREE] * self.c.nb
        finally:
            self.c.close()
            self.svc.close()
            assert not leftovers(home_prefix(self.home))
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- the client --------------------------------------------------------------------------
    def _free_desc(self) -> int | None:
        for d in range(P.NDESC):
            if d not in self.posted:
                return d
        return None

    @precondition(lambda self: self._free_desc() is not None)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True), put=st.booleans())
    def post(self, keys: list[bytes], put: bool) -> None:
        if len(self.free_bufs) < len(keys):
            return
        d = self._free_desc()
        assert d is not None
        bufs = sorted(self.free_bufs)[:len(keys)]
        self.free_bufs -= set(bufs)
        if put:
            self.c.post(d, P.OP_PUT, keys, bufs, [k.ljust(PAGE, b"\0") for k in keys])
        else:
            self.c.post(d, P.OP_GET, keys, bufs)
        self.posted[d] = (P.OP_PUT if put else P.OP_GET, keys, bufs)

    @precondition(lambda self: bool(set(self.posted) - self.cancelled))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        d = data.draw(st.sampled_from(sorted(set(self.posted) - self.cancelled)))
        self.c.chan.desc[d].set_cancel(1)
        self.cancelled.add(d)

    @rule()
    def collect(self) -> None:
        for d in list(self.posted):
            got = self.c.answer(d)
            if got is None:
                continue
            status, _value, res = got
            op, keys, bufs = self.posted.pop(d)
            cancelled = d in self.cancelled
            self.cancelled.discard(d)
            assert status == P.S_OK or (status == P.S_CANCELLED and cancelled), (status, cancelled)
            for k, r, b in zip(keys, res, bufs):
                state = self.c.arena.state(b)
                if status == P.S_CANCELLED:  # results mean nothing; no buffer is the client's to read
                    assert state == A.FREE
                    self.free_bufs.add(b)
                elif op == P.OP_PUT:
                    assert r in (P.R_STORED, P.R_SKIPPED, P.R_DROPPED)
                    if r == P.R_STORED:
                        assert k in self.ok_writes, "stored without a completed write of its digest"
                        if k not in self.dropped:
                            self.stored.add(k)
                    assert state == A.FREE
                    self.free_bufs.add(b)
                else:
                    assert r in (P.R_HIT, P.R_MISS)
                    if r == P.R_HIT:
                        assert k in self.ok_reads, "a hit without a valid read of its digest"
                    assert state == A.CLIENT
                    self.mine.add(b)

    @precondition(lambda self: bool(self.mine))
    @rule()
    def release(self) -> None:
        for b in self.mine:
            self.c.arena.set_state(b, A.FREE)  # the client is done with its pages
        self.free_bufs |= self.mine
        self.mine = set()

    # ---- the service and its worker ---------------------------------------------------------
    @rule()
    def turn(self) -> None:
        self.svc.turn()

    @rule()
    def take(self) -> None:
        for op in (OP_READ, OP_WRITE):
            recs = self.svc.worker_takes(op)
            self.taken.extend(recs[i:i + 1].copy() for i in range(len(recs)))

    @precondition(lambda self: bool(self.taken))
    @rule(data=st.data(), valid=st.booleans())
    def complete(self, data: st.DataObject, valid: bool) -> None:
        i = data.draw(st.integers(0, len(self.taken) - 1))
        rec = self.taken.pop(i)
        key = self.d0[int(rec["d0"][0])]
        if int(rec["op"][0]) == OP_WRITE:
            valid = True  # a write completes; lies are a reader's problem
            self.ok_writes.add(key)
            self.dropped.discard(key)
        elif valid:
            self.ok_reads.add(key)
        elif int(self.svc.st.slots["gen"][self._gid_of(rec)]) == int(rec["gen"][0]):
            self.stored.discard(key)  # the device lied about the slot the index names: dropped
            self.dropped.add(key)  # also when the put that stored it is answered only after this
        self.svc.worker_completes(rec, ST_OK if valid else ST_BAD_CHECKSUM)

    def _gid_of(self, rec: np.ndarray[Any, Any]) -> int:
        area = int(rec["area"][0])
        return int(self.svc.st.smap.gid(0, area, int(rec["slot"][0])))

    @precondition(lambda self: bool(self.svc.requests.pending))
    @rule()
    def lose_worker(self) -> None:
        """The worker died with I/O on it (dead: no kernel I/O can land any more)."""
        self.svc.requests.fail_device(0, dead=True)
        self.taken.clear()
        self.svc.pool.slots[0].rings.reset()  # as Workers.restart does before the new worker starts

    @invariant()
    def stored_keys_are_found(self) -> None:
        if not self.stored:
            return
        ks = sorted(self.stored)
        gids = self.svc.st.index.lookup(digests(self.svc, ks), self.svc.st.local)
        assert (gids >= 0).all(), [k for k, g in zip(ks, gids) if g < 0]

    def drain(self) -> None:
        for _ in range(200):
            self.take()
            while self.taken:
                rec = self.taken.pop()
                self.ok_writes.add(self.d0[int(rec["d0"][0])]) if int(rec["op"][0]) == OP_WRITE else \
                    self.ok_reads.add(self.d0[int(rec["d0"][0])])
                self.svc.worker_completes(rec, ST_OK)
            self.svc.turn()
            self.collect()
            if not self.posted and not self.svc.requests.pending:
                return
        raise AssertionError(f"requests never answered: {sorted(self.posted)}")


TestRequestsMachine = RequestsMachine.TestCase
TestRequestsMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
