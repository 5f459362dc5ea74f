"""The direct-read protocol against a hostile client, in process: a state machine (hypothesis).

A real I/O worker (``Worker``, its compiled turn, a file as the device) serves two connections:
alpha, honest, which reads its own pages as ``KVCacheClient`` does, and beta, which writes
anything into what it may write (its ring's head and tail words, any record, its lease's
buffer states, pins and sequence words). Whatever beta does:

* beta gets a page only if it is beta's own (its key, salted with beta's salt, is the slot's);
* alpha's reads keep returning exactly alpha's pages, and nothing of alpha's lease changes
  under it;
* the worker never writes the slot table, never reads outside the lease of the connection it
  serves, and its ``busy`` counts never go negative and come back to 0 once it is quiet;
* a refused connection is served no more.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.digests import key_digests
from kvstore._native.lib import LIB
from kvstore.ipc.iorings import ST_REFUSED, WorkerRings
from kvstore.ioworkers.worker import Worker, WorkerParams
from kvstore.ipc import connection as P
from kvstore.ipc import lease as A
from kvstore.shm.control import ControlLayout
from kvstore.shm.segment import Segment
from kvstore.shm.wake import WakeReader, unlink_wake
from kvstore.shm.slots import VALID, SlotMap
from kvstore.shm.stats import StatsBlock, stats_nbytes
from kvstore.storage.header import SlotHeader, payload_checksum

PS = 4096
BSIZE = 4096 + PS
SLOTS = 8           # per area; area 0 is ours, area 1 another server's
MB = 4              # buffers per lease
SALT_A, SALT_B = os.urandom(32), os.urandom(32)
GEN_A, GEN_B = 7, 9


def _page(key: bytes) -> bytes:
    return (key * (PS // len(key) + 1))[:PS]


class HostileClient(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.w: Worker | None = None

    @initialize()
    def build(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.prefix = f"kvstest-hostile{tag}."
        self.dev = Path(f"/tmp/kvs-hostile-{tag}.img")
        self.smap = SlotMap([[SLOTS, SLOTS]])
        self.lay = ControlLayout.of(self.smap.total)
        self.segs: list[Segment] = []
        self.wakes: list[tuple[str, WakeReader]] = []

        def seg(what: str, size: int) -> Segment:
            s = Segment.create(self.prefix + what, size)
            self.segs.append(s)
            return s

        def wake(what: str) -> None:  # its consumer's end stays open, as the service's does
            self.wakes.append((self.prefix + what, WakeReader.create(self.prefix + what)))

        self.ctl = seg("control", self.lay.nbytes)
        self.slots = self.lay.slot_table(self.ctl.buf)
        self.wseg = seg("w0", WorkerRings.nbytes(2))
        self.rings = WorkerRings(self.wseg.buf, 2)
        stats = seg("stats", stats_nbytes(1))
        StatsBlock(stats.buf, 1, init=True)
        wake("wake.bell")
        wake("wake.w0")
        # the device: alpha's pages in slots 0..3 of area 1 (another server's), beta's in 4..5
        area_off = (1 << 20, (1 << 20) + SLOTS * BSIZE)
        self.uuid = uuid.uuid4().bytes
        with open(self.dev, "wb") as f:
            f.truncate(area_off[1] + SLOTS * BSIZE)
        self.keys: dict[int, tuple[bytes, bytes, bytes]] = {}  # gid -> (key, key id, owner)
        with open(self.dev, "r+b") as f:
            for slot in range(6):
                owner, salt, gen = (b"A", SALT_A, GEN_A) if slot < 4 else (b"B", SALT_B, GEN_B)
                key = b"%s/page/%d" % (owner, slot)
                ids, words = key_digests([key], salt)
                assert words is not None
                digest = words[0].tobytes()
                page = _page(key)
                h = SlotHeader(self.uuid, 0, 1, slot, gen, digest, PS, payload_checksum(page)).encode()
                f.seek(area_off[1] + slot * BSIZE)
                f.write(h + bytes(4096 - len(h)) + page)
                gid = self.smap.gid(0, 1, slot)
                e = self.slots[gid]
                e["gen"], e["length"], e["state"] = gen, PS, VALID
                for i in range(4):
                    e[f"d{i}"] = words[0][i]
                self.keys[gid] = (key, ids[0].tobytes(), owner)
        self.table_before = self.slots.copy()
        # two connections: alpha (cid 0, lease 0..3) and beta (cid 1, lease 4..7)
        self.chans: list[P.ClientChannel] = []
        self.leases: list[A.Arena] = []
        states_off, buffers_off, size = P.ClientChannel.layout(MB, 1, PS)
        for cid, salt in ((0, SALT_A), (1, SALT_B)):
            c = seg(f"c{cid}", size)
            wake(f"wake.c{cid}")
            ch = P.ClientChannel(c.buf, MB, 1)
            ch.pins[:] = -1
            self.chans.append(ch)
            self.leases.append(A.Arena(c.buf, states_off, buffers_off, MB, PS, first=cid * MB))
            e = self.rings.conns
            e["lease_start"][cid], e["lease_count"][cid] = cid * MB, MB
            e["salt"][cid] = np.frombuffer(salt, dtype=np.uint8)
            e["gen"][cid] = 100 + cid
        for i in range(2 * MB):
            self.arena(i).set_state(i, A.CLIENT)
        p = WorkerParams(
            device_path=str(self.dev), device_index=0, store_uuid=self.uuid, page_size=PS,
            control_name=self.prefix + "control", lease_buffers=MB, worker_segment=self.prefix + "w0",
            stats_name=self.prefix + "stats", doorbell=self.prefix + "wake.bell", wakeup=self.prefix + "wake.w0",
            read_depth=8, max_inflight_writes=2, direct=False, max_clients=2, conn_prefix=self.prefix + "c",
            wake_prefix=self.prefix + "wake.c",
            n_devices=1, slot_size=BSIZE, area_offsets=area_off, area_slots=(SLOTS, SLOTS), own_area=0,
            area_gids=tuple(self.smap.bases[0]), ref_offset=self.lay.ref_offset)
        self.w = Worker(p)
        self.w._poll_conns()
        self.seq = [1, 1]
        self.beta_gen = 101
        self.beta_refused = False
        self.alpha_bytes = self._alpha_lease()

    def teardown(self) -> None:
        try:
            if self.w is not None:
                for _ in range(100):
                    if not self.w.w.outstanding:
                        break
                    self.w._reap(1, 0.1)
                self.w.close()
        finally:  # whatever failed, nothing of this example stays in /dev/shm or /tmp
            for s in getattr(self, "segs", []):
                s.close()
                s.unlink()
            for n, r in getattr(self, "wakes", []):
                r.close()
                unlink_wake(n)
            if hasattr(self, "dev"):
                self.dev.unlink(missing_ok=True)

    # ---- helpers ------------------------------------------------------------------------------
    def arena(self, i: int) -> A.Arena:
        """The lease holding global buffer ``i``."""
        return self.leases[i // MB]

    def _alpha_lease(self) -> bytes:
        a = self.leases[0]
        return b"".join(bytes(a.header(i)) + bytes(a.payload(i)) for i in range(MB)) + \
            a.states(0, MB).tobytes()

    def _quiesce(self) -> None:
        assert self.w is not None
        for _ in range(200):
            self.w._poll_conns()
            n = LIB.kv_wk_turn(self.w.w)
            self.w._after()
            if self.w.w.outstanding:
                self.w._reap(1, 0.5)
            elif not n:
                break

    def _post(self, cid: int, b: int, area: int, slot: int, gen: int, ident: bytes) -> int:
        ch = self.chans[cid]
        seq = self.seq[cid]
        self.seq[cid] += 1
        rec = np.zeros(1, dtype=P.DIRECT_REQ)
        rec["seq"], rec["buf"], rec["area"], rec["slot"], rec["gen"] = seq, b, area, slot, gen
        words = np.frombuffer(ident, dtype="<u8")
        for i in range(4):
            rec[f"d{i}"] = words[i]
        ch.dseq[b % MB] = seq
        r = ch.direct[0]  # written by hand, as a hostile producer does: whatever its words say
        tail = int(r._tail[0])
        r._recs[tail & r._mask] = rec[0]
        LIB.kv_store_release_u64(r._tail, (tail + 1) % (1 << 64))
        return seq

    # ---- alpha: honest ------------------------------------------------------------------------
    @rule(slot=st.integers(0, 3), b=st.integers(0, MB - 1))
    def alpha_reads(self, slot: int, b: int) -> None:
        gid = self.smap.gid(0, 1, slot)
        key, ident, _ = self.keys[gid]
        ch = self.chans[0]
        ch.pins[b] = gid
        a = self.leases[0]
        a.set_state(b, A.tagged(A.DIRECT, 100))
        seq = self._post(0, b, 1, slot, GEN_A, ident)
        self._quiesce()
        assert a.state(b) == A.CLIENT and ch.done_seq(b) == seq
        assert int(ch.wstat[b]) == 0, "alpha's own page must be served"
        assert bytes(a.payload(b)) == _page(key)
        self.alpha_bytes = self._alpha_lease()

    # ---- beta: hostile ------------------------------------------------------------------------
    @rule(b=st.sampled_from([0, 1, 2, 3, 0, 1, 2, 3, 4, 65535]), area=st.sampled_from([1, 1, 1, 0, 3]),
          slot=st.integers(0, 5) | st.integers(0, 12), gen=st.sampled_from([GEN_A, GEN_B, GEN_A, GEN_B, 0, 1 << 63]),
          ident=st.sampled_from(["alpha-id", "alpha-digest", "beta-id", "random"]),
          state=st.sampled_from(["direct", "direct", "direct", "reading", "client", "garbage"]))
    def beta_posts(self, b: int, area: int, slot: int, gen: int, ident: str, state: str) -> None:
        gid_a = self.smap.gid(0, 1, slot % 4)
        if ident == "alpha-id":
            raw = self.keys[gid_a][1]
        elif ident == "alpha-digest":
            raw = self.slots[gid_a][["d0", "d1", "d2", "d3"]].tobytes()
        elif ident == "beta-id":
            raw = self.keys[self.smap.gid(0, 1, 4 + slot % 2)][1]
        else:
            raw = os.urandom(32)
        lb = b % MB
        g = self.beta_gen
        st_word = {"direct": A.tagged(A.DIRECT, g), "reading": A.tagged(A.READING, g), "client": A.CLIENT,
                   "garbage": 0xDEADBEEF}[state]
        self.leases[1].set_state(MB + lb, st_word)  # beta's own lease
        self.chans[1].pins[lb] = gid_a
        self._post(1, b & 0xFFFF, area, slot, gen, raw)

    @precondition(lambda self: self.w is not None and self.w.w.refused > 0)
    @rule()
    def beta_reconnects(self) -> None:
        """Refused and dropped, beta comes back as a new connection (the supervisor's part:
        the worker lets go of the old one, then serves a new generation at the same id)."""
        assert self.w is not None
        self._quiesce()
        self.rings.conns["gen"][1] = 0
        self._quiesce()
        ch = self.chans[1]
        for r in ch.direct:
            r.reset()
        ch.pins[:] = -1
        for i in range(MB, 2 * MB):
            self.leases[1].set_state(i, A.CLIENT)
        self.beta_gen += 1
        self.rings.conns["gen"][1] = self.beta_gen
        self.w._poll_conns()

    @rule(head=st.integers(0, (1 << 64) - 1),
          delta=st.sampled_from([0, 1, -1, 4, 5, 1 << 62]) | st.integers(0, (1 << 64) - 1))
    def beta_scribbles_ring_words(self, head: int, delta: int) -> None:
        """Any head (the worker keeps its own), a tail from just right to impossible."""
        r = self.chans[1].direct[0]
        assert self.w is not None
        mine = int(self.w._by_slot[self.w.conns[1].k].c.head)
        LIB.kv_store_release_u64(r._head, head)
        LIB.kv_store_release_u64(r._tail, (mine + delta) % (1 << 64))

    @rule()
    def turn(self) -> None:
        self._quiesce()

    # ---- what must hold -----------------------------------------------------------------------
    @invariant()
    def beta_gets_only_its_own(self) -> None:
        if self.w is None:
            return
        self._quiesce()
        ch = self.chans[1]
        for lb in range(MB):
            if int(ch.wseq[lb]) and int(ch.wstat[lb]) == 0:
                data = bytes(self.leases[1].payload(MB + lb))
                assert data in (_page(b"B/page/4"), _page(b"B/page/5")), "beta was served a page not its own"
            if int(ch.wstat[lb]) == ST_REFUSED:
                self.beta_refused = True

    @invariant()
    def alpha_and_the_tables_are_untouched(self) -> None:
        if self.w is None:
            return
        assert self._alpha_lease() == self.alpha_bytes
        assert np.array_equal(self.slots, self.table_before), "the worker wrote the slot table"
        busy = self.rings.conns["busy"]
        assert (busy >= 0).all()
        if not self.w.w.outstanding:
            assert (busy == 0).all(), busy
            assert (self.rings.pins == -1).all(), "a pin outlived its read"

    @precondition(lambda self: self.w is not None)
    @invariant()
    def a_refused_client_is_served_no_more(self) -> None:
        assert self.w is not None
        c = self.w._by_slot[self.w.conns[1].k].c
        if c.refused:  # nothing more of its ring is taken: posting leaves it pending
            before = int(c.head)
            self.beta_posts(0, 1, 4, GEN_B, "beta-id", "direct")
            self._quiesce()
            assert int(c.head) == before


TestHostileClient = HostileClient.TestCase
TestHostileClient.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                      suppress_health_check=list(HealthCheck))
