"""The I/O worker process: one per device, libaio + O_DIRECT between the device and the arena.

Loop, in this order each turn (why: reads are what an engine waits on, writes
can wait; and a deep write queue in the device is read latency):

1. reap completions without blocking and report them on the ``done`` ring;
2. take reads from the ``reads`` ring while fewer than ``read_depth`` are
   outstanding;
3. take writes only when no read waits (the ``reads`` ring and the clients'
   direct-read rings are empty), and only while fewer than
   ``max_inflight_writes`` are outstanding;
4. submit all of it in one ``io_submit``;
5. with nothing new to do: wait for a completion (100 us at most, so new
   reads are picked up soon) or, when nothing is outstanding, after a batch of
   at most ``POLL_READS`` I/Os poll (yielding the core) for ``IDLE_POLL_S``,
   since a client that just got its page often posts the next at once and a
   sleeping worker's wake-up costs tens of microseconds (big batches do not:
   the polling would take a core from whoever prepares the next one); then
   wait for the supervisor's wake-up semaphore (50 ms at most, then check the
   parent is alive).

Clients' direct reads (gets that bypass the supervisor) come on one ring per
connection per device, in the connection's segment; the worker finds the
connections in the control segment's connection table, serves their rings in
step 2 with the supervisor's reads, answers the client itself (result words in
the connection segment, the buffer handed back, the client's semaphore
posted) and then reports the read to the supervisor on ``done`` for its
statistics, hints and dropping locations that fail validation: if that ring is
full (the supervisor stalled), the report is dropped, the client's read is not
held up.

Writes: the worker writes the slot header into the buffer's header block
(checksum of the payload computed here, in parallel per device) and writes
header and payload with one I/O. Reads: after the device fills the buffer the
worker validates header and payload against what the supervisor expected and
reports OK, BAD_HEADER or BAD_CHECKSUM; the supervisor never hands out a page
that did not pass.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import structlog
import xxhash

import numpy as np

from ..errors import WouldBlock
from ..service import protocol as P
from ..shm import arena as A
from ..shm.arena import Arena
from ..shm.control import CONN_DTYPE
from ..shm.segment import Segment, attach_semaphore, wait_semaphore
from ..shm.stats import D, StatsBlock
from ..storage.header import HEADER_BLOCK, HEADER_SIZE, SlotHeader
from .aio import AioContext
from .protocol import (F_CSUM, IO_COMPLETION, K_DIRECT, K_SUPERVISOR, OP_READ, ST_BAD_CHECKSUM,
                       ST_BAD_HEADER, ST_IO_ERROR, ST_OK, WorkerRings)

_ZERO_TAIL = bytes(HEADER_BLOCK - HEADER_SIZE)


@dataclass(frozen=True)
class WorkerParams:
    """Everything a worker needs, as plain values (it is pickled into the new process)."""

    device_path: str
    device_index: int
    store_uuid: bytes
    page_size: int
    arena_name: str
    arena_count: int
    control_name: str
    states_offset: int
    worker_segment: str
    stats_name: str
    doorbell: str
    wakeup: str
    read_depth: int
    max_inflight_writes: int
    direct: bool = True
    store: str = ""
    server: str = ""
    conns_offset: int = 0
    """Offset of the connection table in the control segment (0 with ``max_clients`` 0: no direct reads)."""
    max_clients: int = 0
    conn_prefix: str = ""
    """Connection ``cid``'s segment is ``conn_prefix + str(cid)``, its semaphore that plus ``.s``."""
    n_devices: int = 1
    slot_size: int = 0
    area_offsets: tuple[int, ...] = ()
    area_slots: tuple[int, ...] = ()


IDLE_POLL_S = 0.0005  # after a batch of at most P.POLL_READS I/Os the loop polls this long (yielding)
DIRECT_TAG = 1 << 62  # tags of direct reads: never one of the supervisor's (it counts up from 1)


class _Conn:
    """A client connection whose direct reads this worker serves."""

    def __init__(self, p: WorkerParams, cid: int, entry: Any) -> None:
        self.cid = cid
        self.gen = int(entry["gen"])
        self.lease_start = int(entry["lease_start"])
        self.lease_count = int(entry["lease_count"])
        self.seg = Segment.attach(p.conn_prefix + str(cid))
        try:
            self.chan = P.ClientChannel(self.seg.buf, self.lease_count, p.n_devices)
            self.sem = attach_semaphore(p.conn_prefix + f"{cid}.s")
        except BaseException:
            self.seg.close()
            raise
        self.ring = self.chan.direct[p.device_index]
        self.inflight = 0
        self.gone = False

    def close(self) -> None:
        self.sem.close()
        del self.ring, self.chan
        self.seg.close()

class Worker:
    """State of a running worker; see the module docstring for the loop."""

    def __init__(self, p: WorkerParams) -> None:
        self.p = p
        self.arena_seg = Segment.attach(p.arena_name)
        self.control_seg = Segment.attach(p.control_name)
        self.arena = Arena(self.arena_seg.buf, self.control_seg.buf, p.states_offset, p.arena_count, p.page_size)
        self.wseg = Segment.attach(p.worker_segment)
        self.rings = WorkerRings(self.wseg.buf)
        self.stats_seg = Segment.attach(p.stats_name)
        self.stats = StatsBlock.attach(self.stats_seg.buf)
        self.doorbell = attach_semaphore(p.doorbell)
        self.wakeup = attach_semaphore(p.wakeup)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if p.direct else 0)
        self.fd = os.open(p.device_path, flags)
        self.ctx = AioContext(p.read_depth + p.max_inflight_writes, p.device_path)
        # tag -> (request record, submit ns, (connection, lease buffer, seq) of a direct read or None)
        self.pending: dict[int, tuple[Any, int, tuple[_Conn, int, int] | None]] = {}
        self.reads_inflight = 0
        self.writes_inflight = 0
        self.stop = False
        self.parent = os.getppid()
        d = p.device_index
        self.row = self.stats.device[d]
        self.h_read = 1 + 2 * d
        self.h_write = 2 + 2 * d
        self.conn_table = (np.frombuffer(self.control_seg.buf, dtype=CONN_DTYPE, count=p.max_clients,
                                         offset=p.conns_offset) if p.max_clients else None)
        self.conns: dict[int, _Conn] = {}
        self._conn_gens = np.zeros(p.max_clients, dtype=np.uint64)
        self._conn_raw = memoryview(self.control_seg.buf)[p.conns_offset:p.conns_offset + 16 * p.max_clients]
        self._conn_seen = bytes(16 * p.max_clients)
        self._leaving: list[_Conn] = []   # gone from the table, still with reads in flight
        self.next_direct = DIRECT_TAG
        self.reports_dropped = 0
        self._to_wake: set[_Conn] = set()
        self._bell = False  # completions for the supervisor are on ``done``: ring its doorbell
        self._rr = 0

    def _reap(self, min_nr: int, timeout_s: float) -> bool:
        """Complete what the device finished (waiting up to ``timeout_s`` for ``min_nr``); whether any."""
        done = self.ctx.getevents(min_nr, 256, timeout_s)
        for c in done:
            self._complete(c.tag, c.result)
        self._wake()
        return bool(done)

    def _wake(self) -> None:
        """Wake whoever a batch of completions concerns: the supervisor once, each client once.
        (Per completion, each wake-up is a context switch, on two cores often a preemption.)"""
        if self._bell:
            self._bell = False
            self.doorbell.release()
        for c in self._to_wake:
            try:
                c.sem.release()
            except Exception:
                pass  # the semaphore is gone with the client: nothing to wake
        self._to_wake.clear()

    # ---- direct reads -------------------------------------------------------------------
    def _poll_conns(self) -> None:
        """Follow the connection table: attach new connections, let go of ended ones."""
        if self.conn_table is None:
            return
        raw = self._conn_raw.tobytes()  # a cheap look each loop turn; most turns nothing changed
        if raw == self._conn_seen:
            return
        self._conn_seen = raw
        gens = self.conn_table["gen"].copy()
        for cid in np.nonzero(gens != self._conn_gens)[0].tolist():
            old = self.conns.pop(cid, None)
            if old is not None:
                old.gone = True
                self._leaving.append(old)
            if int(gens[cid]):
                try:
                    self.conns[cid] = _Conn(self.p, cid, self.conn_table[cid])
                except Exception:  # posix_ipc.ExistentialError, or a segment of another size
                    pass  # already gone again (its segment unlinked): the table will say so
        self._conn_gens = gens
        self._close_left()

    def _close_left(self) -> None:
        keep = []
        for c in self._leaving:
            if c.inflight:
                keep.append(c)
            else:
                c.close()
        self._leaving = keep

    def _take_direct(self, room: int, now: int, batch: list[tuple[int, int, Any, int, int, int]]) -> int:
        """Take up to ``room`` direct reads from the connections' rings; returns how many."""
        p = self.p
        taken = 0
        conns = list(self.conns.values())
        # fair: each turn starts at the next connection, and takes at most an equal share of the
        # room from each while others wait (one client's deep batch must not hold the device)
        self._rr = (self._rr + 1) % len(conns)
        conns = conns[self._rr:] + conns[:self._rr]
        share = max(1, room // max(1, sum(1 for c in conns if len(c.ring))))
        for c in conns:
            if taken >= room:
                break
            for r in c.ring.get_batch(min(share, room - taken)):
                b, area, slot, n = int(r["buf"]), int(r["area"]), int(r["slot"]), int(r["payload_len"])
                if not (b < c.lease_count and area < len(p.area_offsets) and slot < p.area_slots[area]
                        and 0 < n <= p.page_size):
                    continue  # a record no honest client writes: nothing is read for it
                i = c.lease_start + b
                if not self.arena.cas_state(i, A.tagged(A.DIRECT, c.gen), A.tagged(A.READING, c.gen)):
                    continue  # taken back by the client (timed out), or not this connection's to give
                if int(c.chan.dseq[b]) != int(r["seq"]):
                    # a stale record (its read was taken back) for a buffer posted again since:
                    # leave the buffer to the record of the read it is posted for now
                    self.arena.set_state(i, A.tagged(A.DIRECT, c.gen))
                    continue
                tag = self.next_direct
                self.next_direct += 1
                # the fields of an IO_REQUEST, as a dict: what _complete and _validate_read read
                rec = {"op": OP_READ, "buf": i, "area": area, "slot": slot, "gen": int(r["gen"]),
                       "payload_len": n, "length": HEADER_BLOCK + (n + 4095) // 4096 * 4096,
                       "d0": r["d0"], "d1": r["d1"], "d2": r["d2"], "d3": r["d3"]}
                self.pending[tag] = (rec, now, (c, b, int(r["seq"])))
                c.inflight += 1
                batch.append((0, self.fd, self.arena.address(i), rec["length"],
                              p.area_offsets[area] + slot * p.slot_size, tag))
                self.reads_inflight += 1
                taken += 1
        return taken

    def _answer_direct(self, r: Any, who: tuple[_Conn, int, int], status: int, result: int, lat: int) -> None:
        """Hand a direct read's result to its client, then report it to the supervisor."""
        c, b, seq = who
        c.chan.pins[b] = -1  # the page is in the buffer: retiring its slot may go on
        c.chan.set_done(b, seq, status)
        self.arena.set_state(int(r["buf"]), A.CLIENT)
        c.inflight -= 1
        if not c.inflight and not len(c.ring):
            # the client waits for all the reads it posted: wake it when this worker holds none
            # of them any more (once per batch of completions, ``_wake``), not for every page
            self._to_wake.add(c)
        rec = (0, result, status, K_DIRECT, lat, int(r["gen"]), int(r["area"]) << 40 | int(r["slot"]))
        try:
            self.rings.done.put_nowait(rec)
            # not urgent (the client has its page): the supervisor takes reports at its next tick
            # unless they pile up; waking it for each would take a core from clients and workers
            if len(self.rings.done) > self.rings.done.capacity // 4:
                self.doorbell.release()
        except WouldBlock:
            self.reports_dropped += 1  # the supervisor is behind: its statistics miss this read
        if c.gone and not c.inflight:
            self._wake()  # before its semaphore is closed
            self._close_left()

    def _prepare_write(self, r: Any) -> None:
        i = int(r["buf"])
        n = int(r["payload_len"])
        # a checksum the client computed while copying the page in is trusted only as far as any
        # checksum is: one that does not match the payload makes the page a miss when read
        csum = int(r["csum"]) if int(r["flags"]) & F_CSUM else xxhash.xxh3_64_intdigest(self.arena.payload(i, n))
        hdr = SlotHeader(self.p.store_uuid, self.p.device_index, int(r["area"]), int(r["slot"]),
                         int(r["gen"]), _digest(r), n, csum, time.time_ns()).encode()
        hb = self.arena.header(i)
        hb[:HEADER_SIZE] = hdr
        hb[HEADER_SIZE:] = _ZERO_TAIL

    def _validate_read(self, r: Any) -> int:
        i = int(r["buf"])
        h = SlotHeader.decode(self.arena.header(i))
        n = int(r["payload_len"])
        if (h is None or h.store_uuid != self.p.store_uuid or h.device_index != self.p.device_index
                or h.area_index != int(r["area"]) or h.slot_index != int(r["slot"])
                or h.generation != int(r["gen"]) or h.key_digest != _digest(r)
                or h.payload_length != n):
            # what differed, for whoever investigates (rare: a page that changed or was damaged)
            structlog.get_logger(__name__).warning(
                "slot header does not match the read", area=int(r["area"]), slot=int(r["slot"]),
                expected_gen=int(r["gen"]), found_gen=None if h is None else h.generation,
                key_matches=None if h is None else h.key_digest == _digest(r),
                expected_length=n, found_length=None if h is None else h.payload_length,
                found_slot=None if h is None else h.slot_index)
            return ST_BAD_HEADER
        if xxhash.xxh3_64_intdigest(self.arena.payload(i, n)) != h.payload_checksum:
            return ST_BAD_CHECKSUM
        return ST_OK

    def _complete(self, tag: int, result: int) -> None:
        r, t0, who = self.pending.pop(tag)
        lat = time.monotonic_ns() - t0
        is_read = int(r["op"]) == OP_READ
        row = self.row
        if is_read:
            self.reads_inflight -= 1
        else:
            self.writes_inflight -= 1
        if result != int(r["length"]):
            status = ST_IO_ERROR
            row[D["read_errors" if is_read else "write_errors"]] += 1
        else:
            status = self._validate_read(r) if is_read else ST_OK
            if is_read:
                row[D["reads"]] += 1
                row[D["read_bytes"]] += result
            else:
                row[D["writes"]] += 1
                row[D["write_bytes"]] += result
        self.stats.observe(self.h_read if is_read else self.h_write, lat / 1e9)
        if who is not None:
            return self._answer_direct(r, who, status, result, lat)
        rec = (tag, result, status, K_SUPERVISOR, lat, 0, 0)
        while True:
            try:
                self.rings.done.put(rec, 1.0)
                break
            except Exception:
                self.doorbell.release()  # full: make sure the supervisor is draining it
                if not self._parent_alive():
                    raise SystemExit(0) from None
        self._bell = True

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def _take(self) -> list[tuple[int, int, Any, int, int, int]]:
        batch: list[tuple[int, int, Any, int, int, int]] = []
        now = time.monotonic_ns()
        room = self.p.read_depth - self.reads_inflight
        if room > 0:
            for r in self.rings.reads.get_batch(room):
                tag = int(r["tag"])
                self.pending[tag] = (r, now, None)
                batch.append((0, self.fd, self.arena.address(int(r["buf"])), int(r["length"]),
                              int(r["offset"]), tag))
                self.reads_inflight += 1
            room = self.p.read_depth - self.reads_inflight
            if room > 0 and self.conns:
                self._take_direct(room, now, batch)
        room = self.p.max_inflight_writes - self.writes_inflight
        if room > 0 and len(self.rings.reads) == 0 and not any(len(c.ring) for c in self.conns.values()):
            for r in self.rings.writes.get_batch(room):
                tag = int(r["tag"])
                self._prepare_write(r)
                self.pending[tag] = (r, now, None)
                batch.append((1, self.fd, self.arena.address(int(r["buf"])), int(r["length"]),
                              int(r["offset"]), tag))
                self.writes_inflight += 1
        return batch

    def _submit(self, batch: list[tuple[int, int, Any, int, int, int]]) -> None:
        while batch:
            try:
                n = self.ctx.submit(batch)
            except OSError as e:
                # the device refused the whole batch: fail its first request and go on
                n = 0
                self._complete(batch[0][5], -(e.errno or 5))
                self._wake()
                batch = batch[1:]
                continue
            batch = batch[n:]
            if batch:  # the kernel took only part: reap something and retry
                self._reap(1, 0.001)

    def run(self) -> None:
        """Serve until SIGTERM or until the supervisor is gone."""
        last_check = busy = time.monotonic()
        small = False  # whether the last batch taken was of P.POLL_READS I/Os or fewer
        row = self.row
        while not self.stop:
            progressed = False
            self._poll_conns()
            if self.ctx.outstanding and self._reap(0, 0):
                progressed = True
            batch = self._take()
            if batch:
                small = len(batch) <= P.POLL_READS
                self._submit(batch)
                progressed = True
            # health, judged by the supervisor: the age of the oldest I/O the device holds
            # (dict order is submit order), and that this loop still turns
            row[D["oldest_io_ns"]] = next(iter(self.pending.values()))[1] if self.pending else 0
            row[D["loop_ns"]] = time.monotonic_ns()
            row[D["reads_inflight"]] = self.reads_inflight
            row[D["writes_inflight"]] = self.writes_inflight
            row[D["reads_queued"]] = len(self.rings.reads)
            row[D["writes_queued"]] = len(self.rings.writes)
            now = time.monotonic()
            if progressed:
                busy = now
                continue
            if self.ctx.outstanding:
                self._reap(1, 100e-6)
            elif small and now - busy < IDLE_POLL_S:
                os.sched_yield()  # a client that just got its page often asks for the next at once
            else:
                wait_semaphore(self.wakeup, 0.05)
                now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                if not self._parent_alive():
                    break
        # drain what is in flight so no DMA outlives us into buffers the supervisor reuses
        while self.ctx.outstanding:
            self._reap(1, 1.0)

    def close(self) -> None:
        """Release the context, the device and the mappings."""
        for c in list(self.conns.values()) + self._leaving:
            c.close()
        self.ctx.close()
        os.close(self.fd)
        self.arena.release()


def _digest(r: Any) -> bytes:
    return (int(r["d0"]).to_bytes(8, "little") + int(r["d1"]).to_bytes(8, "little")
            + int(r["d2"]).to_bytes(8, "little") + int(r["d3"]).to_bytes(8, "little"))


def worker_main(p: WorkerParams) -> None:
    """Process entry point (spawned by the supervisor)."""
    from ..logging import configure_logging

    configure_logging(store=p.store, server=p.server, component=f"io{p.device_index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the supervisor, which stops us
    w = Worker(p)
    structlog.get_logger(__name__).info("I/O worker started", device=p.device_index, path=p.device_path,
                                        pid=os.getpid())

    def _term(signum: int, frame: Any) -> None:
        w.stop = True

    signal.signal(signal.SIGTERM, _term)
    try:
        w.run()
    finally:
        w.close()


__all__ = ["IO_COMPLETION", "WorkerParams", "worker_main"]
