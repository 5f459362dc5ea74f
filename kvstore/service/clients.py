"""The client connections of one service: accepting them, the hello, noticing they are gone, dropping them.

``Clients`` owns the listening socket, the handshakes in progress (``connections.Handshakes``),
every ``Conn`` and the workers' connection table in the control segment. It also answers the
two questions about clients the rest of the service asks: does a client's direct read pin
this slot (``reading``), and what did the clients count themselves (``count``: their lookups
and direct gets, added to the stats). Requests on a connection are the supervisor's business
(``connections.take``/``answer``); this module only opens and closes the channel they use.

A connection is dropped once its client is gone (EOF on its socket, bytes after the hello, or a
direct-read record a worker refused), no I/O of the service uses its buffers, and no device
worker reads into them: the service clears the connection in every worker's table, takes back
the buffers handed over for direct reads and not taken yet (compare-and-swap), and waits until
no worker is ``busy`` with its lease (a count each worker publishes in its own table, raised
before it takes a buffer). What the service then frees is decided by its own records, never by
a word the client can write: the whole lease comes back, except buffers a hung worker may still
transfer into (``held``, freed when that worker is gone).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

from ..errors import KVStoreError
from .._native.lib import LIB
from ..ipc.iorings import ST_WORKER_LOST
from ..ipc import lease as A
from ..shm.segment import Segment
from ..shm.wake import WakeReader, make_wake, unlink_wake
from ..ipc import connection as P
from .connections import Conn, Handshakes, PeerCred
from .runtime import Runtime
from .state import StoreState
from .workers import WorkerSlot


class Clients:
    """Every client connection of the service (see the module doc)."""

    def __init__(self, st: StoreState, rt: Runtime, workers: list[WorkerSlot]) -> None:
        """``workers``: the device workers (their connection tables)."""
        self.st = st
        self.arena = st.arena
        self.stats = st.stats
        self.log = st.log
        self.rt, self.mode, self.group = rt, rt.mode, rt.group
        self.sock_path = rt.sock_path
        self.workers = workers
        self.n_devices = len(workers)
        self.lease_buffers = st.cfg.service.client_buffers
        self.page_size = st.cfg.page_size
        self.hello = rt.hello(st, [w.wake_name for w in workers])
        self.conns: dict[int, Conn] = {}
        self.tenant_ids: dict[str, int] = {}
        """Tenant name -> the small id the allocator counts slots and pins under."""
        self.tenant_salts: dict[str, bytes] = {}
        """Tenant name -> the salt its pins were made under (``follow_keys`` drops them when it moves)."""
        self.generation = 0
        self._keyspace = st.keyspace
        self.lsock: socket.socket | None = None
        self.handshakes: Handshakes | None = None

    # ---- accepting -------------------------------------------------------------------------
    def listen(self) -> None:
        """Bind the service's socket: owner-only, or the access group's."""
        try:
            self.sock_path.unlink()
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # owner-only socket: only this user's engines may connect ...
        try:
            s.bind(str(self.sock_path))
        finally:
            os.umask(old)
        if self.group is not None:  # ... and the configured group's
            os.chown(self.sock_path, -1, self.group)
            os.chmod(self.sock_path, 0o660)
        s.listen(P.LISTEN_BACKLOG)
        s.setblocking(False)
        self.lsock = s
        self.handshakes = Handshakes(s)

    def turn(self, now: float) -> None:
        """The tick's work: handshakes, new connections, gone clients."""
        self.poll()

    def follow_keys(self) -> int:
        """After the key spaces moved (``st.keyspace``: an ``invalidate``, or this machine's
        namespaces edited): drop the pins of every tenant whose salt changed (their pages are
        never asked for again, and their keys would not name them for an unpin), and give each
        connection of such a tenant the new salt, in the service's own record (gets, puts,
        pins), in every worker's table (direct reads; a seqlock) and in the connection's
        channel (the client's own lookups). Returns how many connections changed."""
        if self._keyspace == self.st.keyspace:
            return 0
        self._keyspace = self.st.keyspace
        cfg, n, unpinned = self.st.cfg, 0, 0
        for tenant, tid in self.tenant_ids.items():
            salt = cfg.tenant_salt(tenant)
            if self.tenant_salts.get(tenant) != salt:
                self.tenant_salts[tenant] = salt
                unpinned += self.st.alloc.unpin_tenant(tid)
        for conn in list(self.conns.values()):
            salt = cfg.tenant_salt(conn.tenant)
            if salt == conn.salt or conn.dropped:
                continue
            try:
                self._rekey(conn, salt)
                n += 1
            except Exception as e:  # never the service's end: that connection ends instead
                self._unserve(conn)  # no direct read of it under a salt half changed
                self.refuse(conn.id, conn.generation & 0xFFFFFFFF, f"its salt could not be changed: {e!r}")
        self.stats.add("salts_changed", n)
        self.log.info("key spaces moved: connections given their tenant's new salt", connections=n,
                      pins_dropped=unpinned, key_epoch=cfg.key_epoch, epochs=cfg.epochs)
        return n

    def _rekey(self, conn: Conn, salt: bytes) -> None:
        conn.salt = salt
        conn.salt_seq += 2
        for w in self.workers:
            t = w.rings.conns
            t["salt_seq"][conn.id] = conn.salt_seq - 1
            LIB.kv_fence()
            t["salt"][conn.id] = np.frombuffer(salt, dtype=np.uint8)
            LIB.kv_fence()
            t["salt_seq"][conn.id] = conn.salt_seq
        conn.chan.publish_salt(salt, conn.salt_seq)

    def poll(self) -> None:
        """Advance handshakes, open the connections whose hello is complete, reap gone clients."""
        assert self.handshakes is not None
        done, dropped = self.handshakes.poll()
        for why in dropped:
            self.log.warning("client handshake dropped", reason=why)
        self.stats.set("handshakes_dropped", self.handshakes.dropped)
        for s, cred, msg in done:
            try:
                self._open(s, cred, msg)
            except Exception as e:  # a bad client must never take the service down
                self.log.warning("client hello failed", error=str(e), pid=cred.pid)
                s.close()
        self.reap()

    def _refuse(self, s: socket.socket, kind: str, error: str) -> None:
        try:
            s.send(P.refusal(kind, error))
        except OSError:
            pass
        s.close()

    def _open(self, s: socket.socket, cred: PeerCred, msg: dict[str, Any]) -> None:
        cfg = self.st.cfg
        if msg.get("v") != P.VERSION or msg.get("op") != "hello":
            return self._refuse(s, "protocol", f"expected a version {P.VERSION} hello "
                                "(client and service of different kvstore versions?)")
        if len(self.conns) >= cfg.service.max_clients:
            self.reap()  # a client that just closed must not hold a place against this one
        # one user may not take every place: by default another user (an access-group member)
        # gets a quarter of them, the service's own user all (its engines are the deployment's)
        cap = cfg.service.clients_per_user or (cfg.service.max_clients if cred.uid == os.getuid()
                                                else max(1, cfg.service.max_clients // 4))
        if sum(1 for c in self.conns.values() if c.cred.uid == cred.uid) >= cap:
            return self._refuse(s, "busy", f"user {cred.uid} has its maximum of {cap} clients "
                                "(service.clients_per_user in the store config)")
        asked = msg.get("tenant", "")
        try:
            if not isinstance(asked, str):
                raise ValueError("tenant must be a string")
            tenant = cfg.tenant_for(asked, cred.uid, cred.groups())
            salt = cfg.tenant_salt(tenant)
        except (ValueError, KVStoreError) as e:
            self.log.warning("client refused: tenant", pid=cred.pid, uid=cred.uid, tenant=str(asked)[:64])
            return self._refuse(s, "tenant", str(e))
        used = {c.id for c in self.conns.values()}
        free = [i for i in range(cfg.service.max_clients) if i not in used]
        if not free or self.st.stopping:
            return self._refuse(s, "busy", f"the service has its maximum of {cfg.service.max_clients} "
                                "clients (service.max_clients in the store config)")
        cid = free[0]
        nb = self.lease_buffers
        start = cid * nb
        # the connection's own segment: its channel, its buffers' states, its buffers. Owner-only
        # whatever the access group: the client gets it as a file descriptor with the answer, so no
        # other process of another user can open it (a fresh segment: every buffer FREE)
        states_off, _buffers_off, size = P.ClientChannel.layout(nb, self.n_devices, self.page_size)
        seg = Segment.create(self.rt.name(f"c{cid}"), size, 0o600)
        # its wake-up: owner-only, whatever the access group; the client gets the read end with
        # the answer, the service keeps a write end of its own (no open file description shared)
        wake_name = self.rt.client_wake(cid)
        try:
            make_wake(wake_name)
            wake_fd, wake = WakeReader.open_for_client(wake_name)
        except BaseException:
            seg.close()
            seg.unlink()
            unlink_wake(wake_name)
            raise
        self.generation += 1
        tid = self.tenant_ids.setdefault(tenant, len(self.tenant_ids))
        self.tenant_salts.setdefault(tenant, salt)
        conn = Conn(cid, s, seg, P.ClientChannel(seg.buf, nb, self.n_devices), wake, wake_name, start, nb, cred,
                    salt, tenant, tid, generation=self.generation)
        conn.chan.pins[:] = -1
        self.arena.attach(cid, seg.buf, states_off)
        self.conns[cid] = conn
        # the workers serve its direct reads from now on (the segment and wake-up exist), under
        # what this table says: lease and tenant salt first, the generation last
        for w in self.workers:
            table = w.rings.conns
            table["lease_start"][cid], table["lease_count"][cid] = start, nb
            table["salt"][cid] = np.frombuffer(salt, dtype=np.uint8)
            LIB.kv_fence()
            table["gen"][cid] = self.generation
        fds = [wake_fd]
        try:
            try:
                fds.append(seg.open_fd())
                socket.send_fds(s, [P.encode_frame({
                    **self.hello, "v": P.VERSION, "ok": True, "client_id": cid, "max_batch": nb, "lease_start": start,
                    "lease_count": nb, "segment": seg.name, "states_offset": states_off,
                    "buffers_offset": _buffers_off, "salt": salt,
                    "generation": self.generation, "tenant": tenant})], fds[::-1])  # segment, wake-up
            finally:
                for fd in fds:
                    os.close(fd)
        except OSError as e:  # a fresh socket's buffer takes a hello answer; failing here means it is gone
            conn.alive = False
            s.close()
            self.log.warning("client hello failed", error=str(e), pid=cred.pid)
            return
        self.stats.add("clients_total")
        self.log.info("client connected", client=cid, pid=cred.pid, uid=cred.uid, tenant=tenant)

    # ---- closing ---------------------------------------------------------------------------
    def reap(self) -> None:
        """Notice clients that closed their socket (or broke the protocol by sending on it);
        drop them once no I/O uses their buffers."""
        socks = [c.sock for c in self.conns.values() if c.alive]
        if socks:
            for s in P.readable(socks):
                conn = next(c for c in self.conns.values() if c.sock is s)
                try:
                    data = s.recv(64)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    self.log.warning("client sent bytes after its hello; disconnected", client=conn.id,
                                     pid=conn.pid)
                else:  # EOF: the client is gone (closed or died)
                    self.log.info("client disconnected", client=conn.id, pid=conn.pid)
                conn.alive = False
                s.close()
        for conn in [c for c in self.conns.values() if not c.alive and c.ops == 0]:
            # no worker takes another of its reads (none of the service's I/Os uses its buffers:
            # a worker lets go of a lease only once the supervisor names none of it)
            self._unserve(conn)
            if self._direct_settled(conn):
                self.drop(conn)

    def refuse(self, cid: int, generation: int,
               why: str = "a direct-read record no honest client writes") -> None:
        """Connection ``cid`` (of that generation's low 32 bits) wrote what no honest client
        writes (a worker refused its direct-read record, or its request ring is impossible):
        disconnect it; it is dropped like any gone client, and costs nobody else anything."""
        conn = self.conns.get(cid)
        if conn is None or conn.generation & 0xFFFFFFFF != generation or not conn.alive:
            return
        self.stats.add("clients_refused")
        self.log.warning("client refused and disconnected", reason=why, client=cid,
                         pid=conn.pid, uid=conn.cred.uid, tenant=conn.tenant)
        conn.alive = False  # the workers serve it no more already; it goes once its I/Os are done
        try:
            conn.sock.close()
        except OSError:
            pass

    def _unserve(self, conn: Conn) -> None:
        for w in self.workers:
            if int(w.rings.conns["gen"][conn.id]) == conn.generation:
                w.rings.conns["gen"][conn.id] = 0
        LIB.kv_fence()  # pairs with the worker's: it acknowledges, then looks at the generation again

    def _direct_settled(self, conn: Conn) -> bool:
        """Whether no worker can still read into the gone client's buffers: take back those handed
        over and not taken yet, then ask the workers' own counts (a worker raises its count
        before it takes a buffer: after this sweep and the fence, a count of 0 means none holds
        or will take one). A worker being replaced holds nothing; the reads it had taken were
        failed when it was lost."""
        for b in range(conn.lease_start, conn.lease_start + conn.lease_count):
            st = self.arena.state(b)
            if A.kind(st) == A.DIRECT:
                self.arena.cas_state(b, st, A.FREE)  # fails only if a worker took it just now
        LIB.kv_fence()
        return all(w.proc is None or int(w.rings.conns["busy"][conn.id]) <= 0 for w in self.workers)

    def drop(self, conn: Conn) -> None:
        """Forget a connection: its counters are added, its lease freed (except what a hung
        worker may still use), its segment removed."""
        self.count(conn)
        self._unserve(conn)
        del self.conns[conn.id]
        conn.alive = False
        # its lease goes with its segment, whatever the client left in its state words (a hung
        # worker that may still transfer into it keeps its own mapping of the memory)
        conn.inuse.clear()
        conn.dropped = True
        self.arena.detach(conn.id)
        conn.seg.close()
        conn.seg.unlink()
        conn.wake.close()
        unlink_wake(conn.wake_name)

    def close(self) -> None:
        """Stop accepting (shutdown): the socket and its file go, handshakes in progress are dropped."""
        if self.handshakes is not None:
            self.handshakes.close()
            self.handshakes = None
        if self.lsock is not None:
            self.lsock.close()
            self.lsock = None
            try:
                self.sock_path.unlink()
            except FileNotFoundError:
                pass

    def drop_all(self) -> None:
        """Disconnect and drop every connection (shutdown, once no worker runs)."""
        for conn in list(self.conns.values()):
            try:
                conn.sock.close()
            except OSError:
                pass
            self.drop(conn)

    # ---- what the rest of the service asks ---------------------------------------------------
    def count(self, conn: Conn) -> None:
        """Add what a client answered itself since last time (lookups, direct gets) to the stats.
        The words are the client's: an increment that goes backwards or is implausibly large is
        ignored (and not counted later either)."""
        now = conn.chan.counters.copy()
        delta = now - conn.counted
        if (now >= conn.counted).all() and (delta < (1 << 40)).all():
            for name, i in (("lookups", P.C_LOOKUPS), ("lookup_keys", P.C_LOOKUP_KEYS), ("gets", P.C_GETS),
                            ("misses", P.C_GET_MISSES)):
                if delta[i]:
                    self.stats.add(name, int(delta[i]))
            self.stats.hist[0] += delta[P.C_HIST:P.C_HIST + P.HIST_BUCKETS]
        conn.counted = now

    def count_all(self) -> int:
        """``count`` every connection; returns how many clients are connected."""
        for conn in self.conns.values():
            self.count(conn)
        return sum(1 for c in self.conns.values() if c.alive)

    def reading(self, gids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """For each slot of ``gids``, whether a worker's direct read pins it (the allocator asks
        before it reuses retired slots). The fence pairs with the worker's between pinning and
        reading the register: the slots were retired before this call, so a worker that pinned
        one after our look sees it retired and does not read it. The clients' own pin words are
        not asked: a client could name anyone's slots there."""
        LIB.kv_fence()
        if len(gids) < 4:  # a compiled search per slot and worker costs less than numpy's calls
            return np.array([any(w.rings.pinned(g) for w in self.workers) for g in gids.tolist()], dtype=bool)
        pins = np.concatenate([w.rings.pins for w in self.workers]) if self.workers else np.zeros(0, np.int64)
        # a copy, taken after the fence (most I/O slots pin nothing); a pin the worker is writing
        # or clearing meanwhile may read torn, which answers "not pinned": as for a pin made
        # just after our look (the worker then sees the slot retired and does not read it) or
        # one being cleared (its read is done)
        pins = pins[pins >= 0]
        return np.isin(gids, pins) if len(pins) else np.zeros(len(gids), dtype=bool)

    def fail_direct_reads(self, device: int) -> None:
        """The worker of ``device`` is gone (no more DMA can land): fail the direct reads it had
        taken, so that their clients see a miss now instead of waiting for their timeout."""
        for conn in self.conns.values():
            ch = conn.chan
            for b in range(conn.lease_count):
                i = conn.lease_start + b
                st = self.arena.state(i)
                if A.kind(st) == A.READING and int(ch.ddev[b]) == device:
                    ch.pins[b] = -1
                    ch.set_done(b, int(ch.dseq[b]), ST_WORKER_LOST)
                    self.arena.set_state(i, A.CLIENT)
                    conn.wake.post()


__all__ = ["Clients"]
