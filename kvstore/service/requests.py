"""Client requests and device completions: the supervisor's request engine.

``Requests.serve`` takes at most one request per connection per loop turn (no client can
starve another) from the connections' rings (``connections.take``: the request is copied at
intake, the descriptor is the service's until answered), and handles it: lookups and pins at
once, gets and puts by dispatching I/O to the device workers (``_dispatch``: a record for the
worker's read or write ring, handed over up to ``FLUSH_EVERY`` at a time by ``_flush``, the I/O
in ``pending`` under its tag). ``drain`` takes the workers' completions: a read's page goes to
its client once every read of the get is done, a write is committed to the slot table; the
writes of one drain are indexed together (``_settle``) before the puts they finish are
answered. A direct read's report (the client already has its page) is counted, hinted to
peers, and drops a location that failed validation.
``fail_device`` answers the I/Os of a lost worker.

It works on the service's state (``state.StoreState``: the slot table, the key index, the
allocator; the config and superblocks are replaced on a membership change, so this module
never keeps its own copy), the device workers' rings and the client connections. Pages it
stores go to the state's change feed, and so to peers and KV-event subscribers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..digests import salted_words
from ..ipc.iorings import (F_CSUM, IO_REQUEST, K_DIRECT, OP_READ, OP_WRITE, ST_BAD_CHECKSUM, ST_BAD_HEADER, ST_OK,
                                  ST_REFUSED, ST_STALE,
                                  ST_WORKER_LOST)
from ..ipc import lease as A
from ..shm.ring import RingCorrupt
from ..shm.slots import RETIRED, VALID
from ..storage.header import HEADER_BLOCK
from ..ipc import connection as P
from .allocator import BATCH_MIN
from .clients import Clients
from .connections import Conn, Request, answer, give_back, take
from .state import StoreState
from .workers import WorkerSlot

FLUSH_EVERY = 8  # I/Os queued for one worker before they are handed over (also at the end of each request)


@dataclass
class Op:
    """One I/O dispatched to a worker."""

    req: Request
    index: int
    gid: int
    device: int
    buf: int
    op: int
    words: np.ndarray[Any, Any]
    length: int
    gen: int
    t0: float


class Requests:
    """The request engine (see the module doc). Invariant: every request taken is answered
    exactly once, and every I/O in ``pending`` completes exactly once (by the worker, or by
    ``fail_device``)."""

    def __init__(self, st: StoreState, workers: list[WorkerSlot], clients: Clients) -> None:
        self.st = st
        self.workers = workers
        self.clients = clients
        self.pending: dict[int, Op] = {}   # tag -> the I/O a worker has (or will have)
        self.writing: dict[bytes, int] = {}  # salted digest -> slot being written (dedupe)
        self.next_tag = 1
        self.rr = 0  # round-robin over devices for writes
        self._out: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # (device, op) -> records not yet handed over
        self._ins_words: list[np.ndarray[Any, Any]] = []  # written pages to index at ``_settle``
        self._ins_gids: list[int] = []
        self._ins_lens: list[int] = []
        self._finish: list[Request] = []  # puts to answer at ``_settle``, once their pages are indexed

    def turn(self, now: float) -> int:
        """One turn of the loop: completions first, then requests; returns how many were handled."""
        return self.drain() + self.serve()

    def queued(self, device: int) -> bool:
        """Whether I/O of ``device`` is outstanding (``Workers`` judges a stalled loop by it)."""
        return any(op.device == device for op in self.pending.values())

    # ---- requests ----------------------------------------------------------------------------
    def serve(self) -> int:
        """Take at most one request per connection per loop turn (no client can starve another).
        A connection may have several requests in flight (a put's sub-batches, gets in flight
        beside it): each holds its own buffers of the connection's lease (``take`` refuses a
        buffer another request holds), so the lease bounds what one connection has queued."""
        n = 0
        for conn in list(self.clients.conns.values()):
            if not conn.alive:
                continue
            try:
                m = conn.chan.requests.get_checked()
            except RingCorrupt as e:  # the client wrote garbage into its own ring: it goes
                self.clients.refuse(conn.id, conn.generation & 0xFFFFFFFF, str(e))
                continue
            except Exception:
                continue
            n += 1
            got = take(conn, m, self.st.arena)
            if got is None:
                self.st.stats.add("requests_rejected")
                continue
            if isinstance(got, int):
                self.st.stats.add("requests_rejected")
                answer(conn, int(m["desc"]), int(m["seq"]), got)
                continue
            self._handle(got)
        return n

    def _respond(self, req: Request, status: int = P.S_OK, value: int = 0) -> None:
        req.responded = True
        answer(req.conn, req.desc, req.seq, status, value, req.results)

    def _handle(self, req: Request) -> None:
        op = req.op
        if req.cancelled:  # the client timed out before we got to it: do nothing, give everything back
            for b in req.bufs:
                give_back(req.conn, b, self.st.arena, A.FREE)
            self.st.stats.add("requests_cancelled")
            return self._respond(req, P.S_CANCELLED)
        if op == P.OP_PING:
            return self._respond(req)
        words = salted_words(req.keys, req.conn.salt)
        if op == P.OP_LOOKUP:
            return self._lookup(req, words)
        if op in (P.OP_PIN, P.OP_UNPIN):
            return self._pin(req, words, op == P.OP_PIN)
        if op == P.OP_GET:
            return self._get(req, words)
        return self._put(req, words)

    def _lookup(self, req: Request, words: np.ndarray[Any, Any]) -> None:
        gids = self.st.index.lookup(words, self.st.local)
        hit = gids >= 0
        req.results[:] = np.where(hit, P.R_HIT, P.R_MISS)
        if hit.any():
            self.st.alloc.touch(gids[hit])
        lead = int(np.argmin(hit)) if not hit.all() else len(hit)
        self.st.stats.add("lookups")
        self.st.stats.add("lookup_keys", req.count)
        self._respond(req, P.S_OK, lead)

    def _pin(self, req: Request, words: np.ndarray[Any, Any], pin: bool) -> None:
        conn = req.conn
        res = req.results
        gids = self.st.index.lookup(words, self.st.local)
        quota = self.st.cfg.pin_quota_for(conn.tenant, sum(len(r) for r in self.st.own))
        done = 0
        for i, g in enumerate(gids.tolist()):
            if g < 0 or not self.st.local[g]:
                res[i] = P.R_MISS  # only pages in this server's own areas can be pinned here
            elif not pin:
                res[i] = P.R_PINNED if self.st.alloc.unpin_client(g, conn.tenant_id) else P.R_MISS
            elif self.st.alloc.pin_client(g, conn.tenant_id, quota):
                res[i] = P.R_PINNED
            else:
                res[i] = P.R_QUOTA
            done += int(res[i] == P.R_PINNED)
        self._respond(req, P.S_OK, done)

    def _dispatch(self, req: Request, i: int, gid: int, buf: int, op: int, words: np.ndarray[Any, Any],
                  length: int, csum: int | None = None) -> bool:
        """Queue one I/O for its device's worker (``_flush`` hands it over); False when that
        worker is being replaced."""
        d, a, s = self.st.smap.locate(gid)
        w = self.workers[d]
        if w.proc is None:
            return False
        sb = self.st.sbs[d]
        tag = self.next_tag
        self.next_tag += 1
        gen = int(self.st.slots["gen"][gid])
        xfer = HEADER_BLOCK + (length + 4095) // 4096 * 4096
        out = self._out.setdefault((d, op), [])
        out.append((tag, op, buf, sb.areas[a].offset + s * sb.slot_size, xfer, gen,
                    int(words[0]), int(words[1]), int(words[2]), int(words[3]), a, 0 if csum is None else F_CSUM, s,
                    length, csum or 0, req.conn.generation & 0xFFFFFFFF))
        self.pending[tag] = Op(req, i, gid, d, buf, op, words, length, gen, time.monotonic())
        req.outstanding += 1
        req.conn.ops += 1
        if len(out) >= FLUSH_EVERY:
            self._flush()
        return True

    def _flush(self) -> None:
        """Hand the queued I/Os to their workers: one ring write and one wake-up per worker
        for up to ``FLUSH_EVERY`` of them (per I/O, each wake-up is a syscall and often a
        context switch). The rings never overflow: each I/O holds one of at most
        ``REQUEST_RING`` arena buffers (checked at start-up)."""
        for (d, op), recs in self._out.items():
            if recs:
                w = self.workers[d]
                (w.rings.reads if op == OP_READ else w.rings.writes).put_many(np.array(recs, dtype=IO_REQUEST))
                recs.clear()
                w.wake.post()

    def _get(self, req: Request, words: np.ndarray[Any, Any]) -> None:
        gids = self.st.index.lookup(words, self.st.local)
        req.results[:] = P.R_MISS
        self.st.stats.add("gets")
        found = np.nonzero(gids >= 0)[0]
        self.st.stats.add("misses", req.count - len(found))
        for i in found:
            gid = int(gids[i])
            self.st.alloc.pin(gid)
            if not self._dispatch(req, int(i), gid, req.bufs[i], OP_READ, words[i],
                                  int(self.st.slots["length"][gid])):
                self.st.alloc.unpin(gid)
                self.st.stats.add("misses")
        self._flush()
        self._maybe_finish(req)

    def _put(self, req: Request, words: np.ndarray[Any, Any]) -> None:
        """Skip what is stored or being written, allocate slots for the rest (per device, a
        batch at a time: ``Allocator.allocate_many``), and hand their writes over together."""
        res = req.results
        n = req.count
        wait = bool(req.flags & P.FLAG_WAIT)
        page_size = self.st.cfg.page_size
        lengths = req.lengths.astype(np.int64)
        ok = (lengths > 0) & (lengths <= page_size)
        present = self.st.index.contains(words)
        self.st.stats.add("puts")
        self.st.stats.add("put_pages", n)
        raw = words.tobytes()
        seen: set[bytes] = set()
        todo: list[int] = []
        skipped = dropped = 0
        for i, good, there in zip(range(n), ok.tolist(), present.tolist()):
            key = raw[32 * i:32 * i + 32]
            if there or not good or key in self.writing or key in seen:
                res[i] = P.R_SKIPPED if good else P.R_DROPPED
                if good:
                    skipped += 1
                else:
                    dropped += 1
                give_back(req.conn, req.bufs[i], self.st.arena, A.FREE)
                continue
            seen.add(key)
            todo.append(i)
        if skipped:
            self.st.stats.add("put_skipped", skipped)
        ndev = len(self.workers)
        quota = self.st.cfg.quota_for(req.conn.tenant)
        tenant = req.conn.tenant_id
        # round-robin over devices, page by page: page j of ``todo`` goes to device rr + j
        want: list[list[int]] = [[] for _ in range(ndev)]
        for j, i in enumerate(todo):
            want[(self.rr + j) % ndev].append(i)
        self.rr = (self.rr + len(todo)) % ndev
        left: list[tuple[int, int]] = []  # (page, its device) where that device had no slot
        for d in range(ndev):
            if not want[d]:
                continue
            gids = (self.st.alloc.allocate_many(d, len(want[d]), tenant, quota)
                    if self.workers[d].proc is not None else np.zeros(0, dtype=np.int64))
            if len(gids):
                self._dispatch_writes(req, want[d][:len(gids)], gids, d, words, lengths)
            left.extend((i, d) for i in want[d][len(gids):])
        for i, d0 in sorted(left):
            gid = dev = -1
            for k in range(1, ndev + 1):  # the next devices in round-robin order, its own last
                d = (d0 + k) % ndev
                if self.workers[d].proc is None:
                    continue  # its worker is being replaced
                gid = self.st.alloc.allocate(d, tenant, quota)
                if gid >= 0:
                    dev = d
                    break
            if gid < 0:
                res[i] = P.R_DROPPED
                dropped += 1
                give_back(req.conn, req.bufs[i], self.st.arena, A.FREE)
                continue
            self._dispatch_writes(req, [i], np.array([gid], dtype=np.int64), dev, words, lengths)
        if dropped:
            self.st.stats.add("put_dropped", dropped)
        self._flush()
        self.st.stats.set("evictions", self.st.alloc.evictions)
        if not wait:
            self._respond(req)
        self._maybe_finish(req)

    def _dispatch_writes(self, req: Request, idx: list[int], gids: np.ndarray[Any, Any], d: int,
                         words: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]) -> None:
        """Hand the writes of pages ``idx`` of ``req`` into slots ``gids`` (allocated, on device
        ``d``) to its worker: the ring records built for all of them at once, one ring write and
        one wake-up (a few pages go one by one through ``_dispatch``: numpy's per-call cost
        is more than a few records' worth)."""
        m = len(idx)
        if m < BATCH_MIN:
            for i, gid in zip(idx, gids.tolist()):
                self.writing[words[i].tobytes()] = gid
                req.results[i] = P.R_QUEUED
                self._dispatch(req, i, gid, req.bufs[i], OP_WRITE, words[i], int(lengths[i]),
                               None if req.csums is None else int(req.csums[i]))
            return
        ix = np.asarray(idx, dtype=np.int64)
        _dev, area, slot = self.st.smap.locate_many(gids)
        sb = self.st.sbs[d]
        offsets = np.array([a.offset for a in sb.areas], dtype=np.int64)[area] + slot * sb.slot_size
        lens = lengths[ix]
        w = words[ix]
        tag0 = self.next_tag
        self.next_tag += m
        recs = np.zeros(m, dtype=IO_REQUEST)
        recs["tag"] = np.arange(tag0, tag0 + m, dtype=np.uint64)
        recs["op"] = OP_WRITE
        recs["buf"] = [req.bufs[i] for i in idx]
        recs["offset"] = offsets
        recs["length"] = HEADER_BLOCK + (lens + 4095) // 4096 * 4096
        recs["gen"] = self.st.slots["gen"][gids]
        recs["d0"], recs["d1"], recs["d2"], recs["d3"] = w[:, 0], w[:, 1], w[:, 2], w[:, 3]
        recs["area"] = area
        recs["slot"] = slot
        recs["payload_len"] = lens
        if req.csums is not None:
            recs["flags"] = F_CSUM
            recs["csum"] = req.csums[ix]
        recs["conn_gen"] = req.conn.generation & 0xFFFFFFFF
        raw = w.tobytes()
        now = time.monotonic()
        for j, (i, gid, buf, length, gen) in enumerate(zip(idx, gids.tolist(), recs["buf"].tolist(),
                                                           lens.tolist(), recs["gen"].tolist())):
            self.writing[raw[32 * j:32 * j + 32]] = gid
            req.results[i] = P.R_QUEUED
            self.pending[tag0 + j] = Op(req, i, gid, d, buf, OP_WRITE, w[j], length, gen, now)
        req.outstanding += m
        req.conn.ops += m
        wk = self.workers[d]
        wk.rings.writes.put_many(recs)
        wk.wake.post()

    def _maybe_finish(self, req: Request) -> None:
        if req.outstanding or req.responded:
            return
        status = P.S_OK
        if req.op == P.OP_GET:
            # a cancelled get's pages go nowhere: the client gave up on them
            cancelled = req.cancelled
            for i, b in enumerate(req.bufs):
                if b in req.quarantined:
                    req.results[i] = P.R_MISS
                    req.conn.inuse.discard(b)  # QUARANTINE: freed when the hung worker is reaped
                else:
                    give_back(req.conn, b, self.st.arena, A.FREE if cancelled else A.CLIENT)
            if cancelled:
                status = P.S_CANCELLED
                self.st.stats.add("requests_cancelled")
            self.st.stats.observe(0, time.monotonic() - req.t0)
        elif req.cancelled:
            status = P.S_CANCELLED
            self.st.stats.add("requests_cancelled")
        self._respond(req, status)

    # ---- completions -------------------------------------------------------------------------
    def _complete(self, op: Op, status: int) -> None:
        req = op.req
        res = req.results  # the service's own copy: written into the client's descriptor only at the answer
        req.outstanding -= 1
        req.conn.ops -= 1
        if op.op == OP_READ:
            self.st.alloc.unpin(op.gid)
            if status == ST_OK:
                res[op.index] = P.R_HIT  # gets are answered only once all their reads completed
                if not self.st.local[op.gid] and len(self.st.hints) < 4096:
                    self.st.hints.append(op.gid)
                self.st.stats.add("hits")
                self.st.stats.add("pages_read")
                self.st.stats.add("bytes_read", op.length)
            else:
                res[op.index] = P.R_MISS
                self.st.stats.add("misses")
                if status in (ST_BAD_HEADER, ST_BAD_CHECKSUM):
                    self.st.stats.add("validation_failures")
                    self._distrust(op.gid, op.gen, status)
                else:
                    self.st.stats.add("io_errors")
        else:
            self.writing.pop(op.words.tobytes(), None)
            if status == ST_OK:
                # committed, indexed and counted at ``_settle``, for the whole drain at once,
                # before any answer
                self._ins_words.append(op.words)
                self._ins_gids.append(op.gid)
                self._ins_lens.append(op.length)
                res[op.index] = P.R_STORED
            else:
                self.st.alloc.abandon(op.gid, op.device)
                res[op.index] = P.R_DROPPED
                self.st.stats.add("put_dropped")
                self.st.stats.add("io_errors")
            if op.buf in req.quarantined:
                req.conn.inuse.discard(op.buf)
            else:
                give_back(req.conn, op.buf, self.st.arena, A.FREE)
            self._finish.append(req)
            return
        self._maybe_finish(req)

    def _settle(self) -> None:
        """Index the pages whose writes completed in this batch (one compiled call), then
        answer the puts they finished: an answered put's pages are found."""
        if self._ins_gids:
            words = np.array(self._ins_words, dtype=np.uint64).reshape(-1, 4)
            gids = np.array(self._ins_gids, dtype=np.int64)
            lens = np.array(self._ins_lens, dtype=np.int64)
            self.st.alloc.commit(gids, words, lens)  # VALID, then found
            self.st.changes.stored(self._ins_gids)
            self.st.index.insert_many(words, gids)
            self.st.stats.add("pages_written", len(gids))
            self.st.stats.add("bytes_written", sum(self._ins_lens))
            self._ins_words = []
            self._ins_gids = []
            self._ins_lens = []
        for req in self._finish:
            self._maybe_finish(req)
        self._finish.clear()

    def _direct_done(self, d: int, c: Any) -> None:
        """A worker's report of a client's direct read (the client already has the page): count
        it, hint peers whose pages we read, and drop a location that failed validation. The
        worker validated the read against the slot table's register, not against anything the
        client said, so a failure is the device disagreeing with the register. A refused record
        (a lie) disconnects its client and costs nobody else anything."""
        status = int(c["status"])
        if status == ST_REFUSED:
            tag = int(c["tag"])
            self.st.stats.add("direct_refused")
            self.clients.refuse(tag & 0xFFFFFFFF, tag >> 32)
            return
        if status == ST_STALE:  # changed since the client looked: a miss (the client counts it)
            return
        where = int(c["where"])
        try:
            gid = self.st.smap.gid(d, where >> 40, where & ((1 << 40) - 1))
        except IndexError:
            return
        if status == ST_OK:
            self.st.stats.add("hits")
            self.st.stats.add("pages_read")
            self.st.stats.add("bytes_read", int(self.st.slots["length"][gid]))
            if not self.st.local[gid] and len(self.st.hints) < 4096:
                self.st.hints.append(gid)
        elif status in (ST_BAD_HEADER, ST_BAD_CHECKSUM):
            self.st.stats.add("validation_failures")
            self._distrust(gid, int(c["gen"]), status)
        else:
            self.st.stats.add("io_errors")

    def _distrust(self, gid: int, gen: int, status: int) -> None:
        """Drop the location of a page that failed validation, if the slot still holds what was read."""
        if int(self.st.slots["gen"][gid]) == gen and self.st.slots["state"][gid] == VALID:
            own = self.st.own_device(gid)
            if own is not None:
                self.st.alloc.drop(gid, own)
            else:
                # another server's slot: distrust this generation only (RETIRED at the
                # same generation outranks a re-delivered VALID; its next write does not)
                self.st.changes.forgotten([gid])
                self.st.slots["state"][gid] = RETIRED
        self.st.log.warning("page failed validation; location dropped", gid=gid,
                         reason="header" if status == ST_BAD_HEADER else "checksum")

    def drain(self) -> int:
        n = 0
        for w in self.workers:
            if w.proc is None:
                continue  # being replaced: its rings are reset before the new worker starts
            recs = w.rings.done.get_batch(256)
            if not len(recs):
                continue
            # the fields as Python ints, once per batch (a structured record's field, per record,
            # cost the service more than the rest of a completion)
            for j, (kind, tag, status) in enumerate(zip(recs["kind"].tolist(), recs["tag"].tolist(),
                                                        recs["status"].tolist())):
                if kind == K_DIRECT:
                    n += 1
                    self._direct_done(w.device, recs[j])
                    continue
                op = self.pending.pop(tag, None)
                if op is None:
                    continue
                n += 1
                self._complete(op, status)
        self._settle()
        return n

    # ---- workers -------------------------------------------------------------------------------
    def fail_device(self, device: int, dead: bool) -> list[tuple[Conn, int]]:
        """Fail the I/Os a lost worker held (``Workers.lost``); unless it is ``dead`` already,
        their buffers are quarantined and returned, to be freed once it is gone."""
        held: list[tuple[Conn, int]] = []
        for tag, op in [(t, o) for t, o in self.pending.items() if o.device == device]:
            del self.pending[tag]
            if not dead:
                held.append((op.req.conn, op.buf))
                op.req.quarantined.add(op.buf)
                self.st.arena.set_state(op.buf, A.QUARANTINE)
            self._complete(op, ST_WORKER_LOST)
        self._settle()
        return held


__all__ = ["Op", "Requests"]
