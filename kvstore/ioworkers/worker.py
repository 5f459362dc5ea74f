"""The I/O worker process: one per device, libaio + O_DIRECT between the device and the arena.

Loop, in this order each turn (why: reads are what an engine waits on, writes
can wait; and a deep write queue in the device is read latency):

1. reap completions without blocking and report them on the ``done`` ring,
   waking the supervisor (its doorbell, once per turn) for any read, and for
   writes once per four or when the write stream pauses (none in flight or
   queued): a put stream does not wake it for every page;
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
   wait for its wake-up (a FIFO only it drains, shm/wake.py; 50 ms at most,
   then check the parent is alive).

Clients' direct reads (gets that bypass the supervisor) come on one ring per
connection per device, in the connection's segment; the worker finds the
connections in the control segment's connection table, serves their rings in
step 2 with the supervisor's reads, answers the client itself (result words in
the connection segment, the buffer handed back, the client's wake-up
posted) and then reports the read to the supervisor on ``done`` for its
statistics, hints and dropping locations that fail validation: if that ring is
full (the supervisor stalled), the report is dropped, the client's read is not
held up.

The per-I/O work is compiled (``kvstore/_native/worker.c``: ``kv_wk_turn`` does steps 1-4
for every ring, ``kv_wk_reap`` the waiting in step 5): reading ring records,
building iocbs, encoding and checking slot headers, checksums, answering
clients and reporting. This module keeps what happens once per turn or less:
following the connection table, the wake-ups (FIFOs, shm/wake.py), logging
headers that were not the expected ones, idling, health of the parent,
shutdown. If the supervisor stops draining ``done``, its completions wait in
the worker (at most one per I/O slot) and no more of its requests are taken
until they are delivered; clients' direct reads go on.

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

import numpy as np
import structlog

from ..ipc import connection as P
from ..ipc.lease import buffer_size
from ..shm.segment import Segment
from ..shm.wake import WakeReader, WakeWriter
from ..shm.stats import D, StatsBlock
from ..storage.superblock import FORMAT_VERSION
from .._native.lib import FFI, LIB
from ..ipc.iorings import IO_COMPLETION, WorkerRings


@dataclass(frozen=True)
class WorkerParams:
    """Everything a worker needs, as plain values (it is pickled into the new process)."""

    device_path: str
    device_index: int
    store_uuid: bytes
    page_size: int
    control_name: str
    lease_buffers: int
    """Buffers per connection lease (``service.client_buffers``)."""
    worker_segment: str
    stats_name: str
    doorbell: str
    wakeup: str
    read_depth: int
    max_inflight_writes: int
    direct: bool = True
    store: str = ""
    server: str = ""
    max_clients: int = 0
    """Entries of the worker's connection table (0: no direct reads)."""
    conn_prefix: str = ""
    """Connection ``cid``'s segment is ``conn_prefix + str(cid)``."""
    wake_prefix: str = ""
    """Connection ``cid``'s wake-up is ``wake_prefix + str(cid)`` (shm/wake.py)."""
    n_devices: int = 1
    slot_size: int = 0
    area_offsets: tuple[int, ...] = ()
    area_slots: tuple[int, ...] = ()
    own_area: int = 0
    """The area of this server: the only one the worker writes."""
    area_gids: tuple[int, ...] = ()
    """Global slot id of each area's slot 0 on this device (indexes the control segment's slot table)."""
    ref_offset: int = -1
    """Offset of the CLOCK reference bits in the control segment (-1: none)."""


IDLE_POLL_S = 0.0005  # after a batch of at most P.POLL_READS I/Os the loop polls this long (yielding)
# the device counters the compiled turn keeps, in the order of ``struct kv_worker.didx``
_COUNTERS = ("reads", "read_bytes", "read_errors", "writes", "write_bytes", "write_errors", "oldest_io_ns",
             "loop_ns", "reads_inflight", "writes_inflight", "reads_queued", "writes_queued")


def _ptr(ctype: str, a: np.ndarray[Any, Any]) -> Any:
    return FFI.cast(ctype, a.ctypes.data)


class _Conn:
    """A client connection whose direct reads this worker serves (``k``: its slot in the C table).

    Everything it is served under (generation, lease, tenant salt) comes from the worker's own
    connection table, which only the supervisor writes; the client's segment gives only the
    ring and the words the protocol lets the client write."""

    def __init__(self, p: WorkerParams, cid: int, entry: Any, k: int, c: Any, busy: np.ndarray[Any, Any]) -> None:
        self.k = k
        self.cid = cid
        self.gen = int(entry["gen"])
        lease_count = int(entry["lease_count"])
        self.seg = Segment.attach(p.conn_prefix + str(cid))
        try:
            states_off, buffers_off, size = P.ClientChannel.layout(lease_count, p.n_devices, p.page_size)
            if self.seg.size < size:
                raise ValueError("connection segment smaller than its layout")
            self.chan = P.ClientChannel(self.seg.buf, lease_count, p.n_devices)
            self._mem = FFI.from_buffer(self.seg.buf)
        except BaseException:
            self.seg.close()
            raise
        # its wake-up, if its client still holds the read end (a client that closed it cannot be
        # woken, and polls; its reads are served all the same: the ring is not held up for it)
        self.wake: WakeWriter | None = None
        try:
            self.wake = WakeWriter.open(p.wake_prefix + str(cid))
        except OSError:
            pass
        self.c = c
        c.gen = self.gen & 0xFFFFFFFF
        c.cid = cid
        c.lease_start = int(entry["lease_start"])
        c.lease_count = lease_count
        self.base = FFI.cast("uint8_t *", self._mem + buffers_off)
        c.base = self.base
        c.states = FFI.cast("uint32_t *", self._mem + states_off)
        ring = self.chan.direct[p.device_index]
        ring.point(c.ring)
        c.head = int(LIB.kv_load_acquire_u64(ring._head))  # ours from here on; the tail is checked against it
        self.salt_seq = -1
        self.rekey(entry)
        c.pins = self.chan._pins
        c.dseq = self.chan._dseq
        c.wstat = self.chan._wstat
        c.wseq = self.chan._wseq
        c.wake_seq = self.chan._wake_seq
        c.inflight = 0
        c.busy = _ptr("int64_t *", busy)
        c.wake = 0
        c.refused = 0
        c.has_prev = 0
        # its reads are taken once its salt is (a slot reused from another connection holds that one's)
        c.live = 1 if self.salt_seq >= 0 else 0

    def rekey(self, entry: Any) -> bool:
        """Take the tenant salt the supervisor wrote (``salt_seq``: a seqlock, odd while it
        writes); False when it is being rewritten (look again next turn)."""
        seq = int(entry["salt_seq"])
        LIB.kv_fence()  # the salt is read after the seq (seqlock)
        if seq & 1:
            return False
        salt = entry["salt"].tobytes()
        LIB.kv_fence()
        if int(entry["salt_seq"]) != seq:
            return False
        if self.salt_seq >= 0:  # a record looked up under the salt it replaces (the last one this worker
            # held) is a miss, not a lie
            FFI.memmove(self.c.keyed_prev, self.c.keyed, FFI.sizeof(self.c.keyed))
            self.c.has_prev = 1
        LIB.kv_b2b_keyed(self.c.keyed, FFI.from_buffer(salt), 32)
        self.salt_seq = seq
        return True

    def close(self) -> None:
        if self.wake is not None:
            self.wake.close()
        del self.chan
        del self._mem, self.base
        self.seg.close()


class Worker:
    """State of a running worker; see the module docstring for the loop."""

    def __init__(self, p: WorkerParams) -> None:
        self.p = p
        self.control_seg = Segment.attach(p.control_name)
        self.wseg = Segment.attach(p.worker_segment)
        self.rings = WorkerRings(self.wseg.buf, p.max_clients)
        self.stats_seg = Segment.attach(p.stats_name)
        self.stats = StatsBlock.attach(self.stats_seg.buf)
        self.doorbell = WakeWriter.open(p.doorbell)
        self.wakeup = WakeReader.open(p.wakeup)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if p.direct else 0)
        self.fd = os.open(p.device_path, flags)
        self.stop = False
        self.parent = os.getppid()
        d = p.device_index
        # the compiled turn's state; every array it points into is kept alive by ``self``
        w = self.w = FFI.new("struct kv_worker *")
        w.fd = self.fd
        w.read_depth = p.read_depth
        w.max_writes = p.max_inflight_writes
        w.version = FORMAT_VERSION
        self.rings.reads.point(w.reads)
        self.rings.writes.point(w.writes)
        self.rings.done.point(w.done)
        # the leases, by connection id, as this worker maps them (each in its connection's segment)
        w.bsize = buffer_size(p.page_size)
        n_ids = max(1, p.max_clients)
        self._lease_base = FFI.new("uint8_t *[]", n_ids)
        self._lease_gen = FFI.new("uint32_t[]", n_ids)
        w.lease_base = self._lease_base
        w.lease_gen = self._lease_gen
        w.per_lease = p.lease_buffers
        w.nleases = p.max_clients
        w.table = _ptr("uint64_t *", self.rings.conns) if p.max_clients else FFI.NULL
        w.uuid = p.store_uuid
        w.dev = d
        w.page_size = p.page_size
        w.slot_size = p.slot_size
        self._area_off = np.array(p.area_offsets or (0,), dtype=np.uint64)
        self._area_slots = np.array(p.area_slots or (0,), dtype=np.uint64)
        w.area_off = _ptr("uint64_t *", self._area_off)
        w.area_slots = _ptr("uint64_t *", self._area_slots)
        w.n_areas = len(p.area_offsets)
        w.own_area = p.own_area
        # what direct reads are checked against: the service's slot table (the control segment
        # starts with it) and where each area's slots are in it
        self._area_gid = np.array(p.area_gids or (0,) * max(1, len(p.area_offsets)), dtype=np.uint64)
        w.area_gid = _ptr("uint64_t *", self._area_gid)
        self._ctl = FFI.from_buffer(self.control_seg.buf)
        w.slots = self._ctl
        w.ref = FFI.cast("uint8_t *", self._ctl + p.ref_offset) if p.ref_offset >= 0 else FFI.NULL
        self.rings.pins[:] = -1  # nothing of a predecessor's is in flight (its rings were reset)
        w.wpins = _ptr("int64_t *", self.rings.pins)
        self.row = self.stats.device[d]
        w.row = _ptr("uint64_t *", self.row)
        w.didx = [D[n] for n in _COUNTERS]
        w.hread = _ptr("uint64_t *", self.stats.hist[1 + 2 * d])
        w.hwrite = _ptr("uint64_t *", self.stats.hist[2 + 2 * d])
        w.hist_buckets = self.stats.hist.shape[1]
        # a connection's slot stays taken while its reads are in flight, also after it left
        # the table (and a new one may already use its id): twice the table, then wait
        n_slots = 2 * p.max_clients
        self._cslots = FFI.new("struct kv_wconn[]", max(1, n_slots))
        self._wake = FFI.new("int32_t[]", max(1, n_slots))
        w.conns = self._cslots
        w.nconn = n_slots
        w.wake_list = self._wake
        self._free_slots = list(range(n_slots - 1, -1, -1))
        self._by_slot: dict[int, _Conn] = {}
        ret = LIB.kv_wk_init(w)
        if ret < 0:
            LIB.kv_wk_free(w)
            os.close(self.fd)
            raise OSError(-ret, f"io_setup: {os.strerror(-ret)}", p.device_path)
        self.conn_table = self.rings.conns if p.max_clients else None
        self._busy = self.rings.conns["busy"]
        self.conns: dict[int, _Conn] = {}
        self._conn_gens = np.zeros(p.max_clients, dtype=np.uint64)
        self._gens_seen = self._conn_gens.tobytes()
        self._salts_seen = b""
        self._leaving: list[_Conn] = []   # gone from the table, still with reads in flight
        self._log = structlog.get_logger(__name__)

    @property
    def refused(self) -> int:
        """Direct-read records refused (lies, impossible ring tails)."""
        return int(self.w.refused)

    @property
    def reports_dropped(self) -> int:
        """Direct-read reports the supervisor missed (its ``done`` ring was full)."""
        return int(self.w.reports_dropped)

    def _after(self) -> None:
        """What a compiled call left to do: wake the supervisor once, each client once
        (per completion, each wake-up is a context switch, on two cores often a
        preemption), log headers that were not the expected ones."""
        w = self.w
        if w.bell:
            w.bell = 0
            self.doorbell.post()
        for i in range(w.nwake):
            k = int(self._wake[i])
            self._cslots[k].wake = 0
            c = self._by_slot.get(k)
            if c is not None and c.wake is not None:
                c.wake.post()
        w.nwake = 0
        for i in range(w.nbad):
            b = w.bad[i]
            # what differed, for whoever investigates (rare: a page that changed or was damaged)
            self._log.warning(
                "slot header does not match the read", area=b.area, slot=b.slot, expected_gen=b.expected_gen,
                found_gen=b.found_gen if b.decoded else None,
                key_matches=bool(b.key_matches) if b.decoded else None, expected_length=b.expected_len,
                found_length=b.found_len if b.decoded else None, found_slot=b.found_slot if b.decoded else None)
        w.nbad = 0
        if self._leaving:
            self._close_left()

    def _reap(self, min_nr: int, timeout_s: float) -> bool:
        """Complete what the device finished (waiting up to ``timeout_s`` for ``min_nr``); whether any."""
        r = LIB.kv_wk_reap(self.w, min_nr, int(timeout_s * 1e9))
        self._after()
        return r > 0

    # ---- direct reads -------------------------------------------------------------------
    def _poll_conns(self) -> None:
        """Follow the worker's connection table: attach new connections, let go of ended ones.

        The worker publishes in ``busy`` how many buffers of each id's lease it reads into (or
        is taking); the supervisor frees a gone client's lease only when that is 0."""
        t = self.conn_table
        if t is None:
            return
        salts = t["salt_seq"].tobytes()
        if salts != self._salts_seen:  # an administrator moved a tenant's key space: new salts
            seqs = np.frombuffer(salts, dtype="<u8")
            stale = [conn for cid, conn in self.conns.items() if conn.salt_seq != int(seqs[cid])]
            keyed = [conn.rekey(t[conn.cid]) for conn in stale]
            for conn, ok in zip(stale, keyed):
                if ok and not conn.c.refused:
                    conn.c.live = 1  # served from here on (a new one waited for its first salt)
            if all(keyed):
                self._salts_seen = salts
        raw = t["gen"].tobytes()  # a cheap look each loop turn; most turns nothing changed
        if raw == self._gens_seen:
            return
        gens = np.frombuffer(raw, dtype="<u8")
        retry = False
        for cid in np.nonzero(gens != self._conn_gens)[0].tolist():
            old = self.conns.pop(cid, None)
            if old is not None:
                old.c.live = 0  # no more of its reads are taken; those in flight are answered
                self._leaving.append(old)
                self._lease_base[cid] = FFI.NULL  # the supervisor names none of its buffers any more
                self._lease_gen[cid] = 0
            self._conn_gens[cid] = 0
            if int(gens[cid]):
                if not self._free_slots:
                    retry = True  # every slot holds a connection with reads in flight: next turn
                    continue
                k = self._free_slots.pop()
                try:
                    conn = _Conn(self.p, cid, t[cid], k, self._cslots[k], self._busy[cid:cid + 1])
                    self.conns[cid] = self._by_slot[k] = conn
                    self._lease_base[cid] = conn.base
                    self._lease_gen[cid] = conn.gen & 0xFFFFFFFF
                except Exception:  # posix_ipc.ExistentialError, or a segment of another size
                    self._free_slots.append(k)  # already gone again (its segment unlinked): the table will say so
            self._conn_gens[cid] = gens[cid]
        if not retry:
            self._gens_seen = raw
        self._close_left()

    def _close_left(self) -> None:
        keep = []
        for c in self._leaving:
            if c.c.inflight:
                keep.append(c)
            else:
                c.close()  # not live since it left the table (``_poll_conns``)
                self._by_slot.pop(c.k, None)
                self._free_slots.append(c.k)
        self._leaving = keep

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def run(self) -> None:
        """Serve until SIGTERM or until the supervisor is gone."""
        last_check = busy = time.monotonic()
        small = False  # whether the last batch taken was of P.POLL_READS I/Os or fewer
        w = self.w
        while not self.stop:
            self._poll_conns()
            before = w.reads_inflight + w.writes_inflight
            n = LIB.kv_wk_turn(w)
            self._after()
            if w.need_attach:  # a request names a connection the table has and we have not attached
                w.need_attach = 0
                continue
            now = time.monotonic()
            if n:
                small = n <= P.POLL_READS
            if n or w.reads_inflight + w.writes_inflight < before:
                busy = now
                continue
            if w.outstanding:
                self._reap(1, 100e-6)
            elif small and now - busy < IDLE_POLL_S:
                os.sched_yield()  # a client that just got its page often asks for the next at once
            else:
                self.wakeup.wait(0.05)
                now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                if not self._parent_alive():
                    break
        # drain what is in flight so no DMA outlives us into buffers the supervisor reuses
        while w.outstanding:
            self._reap(1, 1.0)

    def close(self) -> None:
        """Release the context, the device and the mappings."""
        for c in list(self.conns.values()) + self._leaving:
            c.close()
        LIB.kv_wk_free(self.w)
        os.close(self.fd)
        self.doorbell.close()
        self.wakeup.close()


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
