"""The sync agent process: moves location updates between this server and its peers.

It owns no state of the store: the supervisor keeps the slot table, the delta
log and the sequence numbers; the agent is a validated, authenticated pump.

Each turn of its loop (2 ms poll):

* drain the ``out`` ring: own deltas are batched and published on the PUB
  (every ``flush_interval_s`` or ``flush_records``); answer records are
  collected per peer and sent on the ROUTER when their end marker comes;
* receive from every peer's SUB and DEALER: decode and validate (owner must be
  that peer, see ``delta.decode``), hand registers to the supervisor on the
  ``in`` ring, and track the peer's (epoch, next seq); a gap, a new epoch, or
  a heartbeat showing we are behind triggers a request for what is missing
  (one outstanding per peer, re-sent after ``request_timeout_s``);
* receive requests on the ROUTER and hand them to the supervisor;
* publish a heartbeat every ``heartbeat_s``.

A message that fails validation is dropped and counted; nothing a peer sends
can stop the loop.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import zmq

from ..shm.board import Board
from ..shm.segment import Segment
from ..shm.wake import WakeWriter
from ..shm.slots import SlotMap
from ..shm.stats import StatsBlock
from .delta import BadMessage, decode, encode
from .log import (END_LAST, END_SNAPSHOT, K_ANSWER, K_ANSWER_END, K_DELTA, K_HINT, K_REMOTE, K_REQUEST,
                  SYNC_REC, SyncRings, to_registers, to_sync)

log = structlog.get_logger(__name__)

EXIT_ADDRESS_IN_USE = 3
ADDRESS_IN_USE_HINT = ("another listener holds it (this machine's own metrics or events address included: "
                       "'mass-ctl kvcache show STORE' lists them), or, for a port inside "
                       "net.ipv4.ip_local_port_range, an outgoing connection's local end; give the server a sync "
                       "port (and PORT+1) outside that range")


@dataclass(frozen=True)
class Peer:
    """Another server of the store, as the agent needs it."""

    name: str
    area: int
    pub: str
    router: str
    public_key: bytes


@dataclass(frozen=True)
class AgentParams:
    """Everything the agent needs, as plain values."""

    store: str
    server: str
    area: int
    epoch: int
    pub: str
    router: str
    public_key: bytes
    secret_key: bytes
    peers: tuple[Peer, ...]
    counts: tuple[tuple[int, ...], ...]
    page_size: int
    sync_segment: str
    stats_name: str
    doorbell: str
    flush_interval_s: float
    flush_records: int
    heartbeat_s: float
    request_timeout_s: float
    peers_board: str = ""
    """Shared-memory notice board where the agent publishes each peer's lag and its own warnings."""
    start_seq: int = 0
    """The supervisor's next delta sequence number when it spawned this agent: its heartbeats
    announce at least this (an agent that replaced another after a membership change would
    otherwise announce 0, and a peer that returned meanwhile would think it has everything)."""
    snapshot_from: tuple[int, ...] = ()
    """Areas of peers whose pages the supervisor forgot (denied, then allowed again): ask each
    for a snapshot at first contact, since its delta stream alone would not repeat them."""


@dataclass
class PeerState:
    """What we know of one peer's delta stream."""

    epoch: int = -1
    next: int = 0
    requested_at: float = 0.0
    outstanding: bool = False
    heard_at: float = 0.0
    """monotonic time of the last valid message from the peer (0: never)."""
    announced: int = 0
    """The highest sequence number the peer said it has published (its deltas and heartbeats)."""
    answer: list[np.ndarray[Any, Any]] = field(default_factory=list)


class Agent:
    """See the module docstring."""

    def __init__(self, p: AgentParams) -> None:
        from .transport import Transport

        self.p = p
        self.smap = SlotMap(p.counts)
        self.seg = Segment.attach(p.sync_segment)
        self.rings = SyncRings(self.seg.buf)
        self.stats_seg = Segment.attach(p.stats_name)
        self.stats = StatsBlock.attach(self.stats_seg.buf)
        self.doorbell = WakeWriter.open(p.doorbell)
        self.t = Transport(p.public_key, p.secret_key, [x.public_key for x in p.peers])
        try:
            self.pub = self.t.publisher(p.pub)
            self.router = self.t.router(p.router)
            self.subs = {x.area: self.t.subscriber(x.pub, x.public_key) for x in p.peers}
            self.dealers = {x.area: self.t.dealer(x.router, x.public_key, p.server.encode()) for x in p.peers}
        except BaseException:
            self.t.close()
            raise
        self.by_key = {x.public_key.decode(): x for x in p.peers}  # ZAP User-Id (z85 key) -> peer
        self.route: dict[int, bytes] = {}  # peer area -> routing id its authenticated requests came from
        self.state = {x.area: PeerState() for x in p.peers}
        self.answers: dict[int, list[np.ndarray[Any, Any]]] = {x.area: [] for x in p.peers}
        self.pending: list[np.ndarray[Any, Any]] = []
        self.pending_n = 0
        self.pending_seq = 0
        self.last_flush = time.monotonic()
        self.last_hb = 0.0
        self.next_seq = p.start_seq  # after the last own delta published (by us or an agent before us)
        self.stop = False
        self.poller = zmq.Poller()
        for s in [self.router, *self.subs.values(), *self.dealers.values()]:
            self.poller.register(s, zmq.POLLIN)
        self.sock_peer = {id(s): a for a, s in self.subs.items()}
        self.sock_peer.update({id(s): a for a, s in self.dealers.items()})
        self.parent = os.getppid()
        self.want_snapshot = set(p.snapshot_from) & set(self.state)
        self.board_seg = Segment.attach(p.peers_board) if p.peers_board else None
        self.board = Board(self.board_seg.buf) if self.board_seg is not None else None

    # ---- to the supervisor ---------------------------------------------------------------------
    def _to_supervisor(self, recs: np.ndarray[Any, Any]) -> bool:
        inn = self.rings.inn
        if inn.free() < len(recs):
            return False
        inn.put_many(recs)
        self.doorbell.post()
        return True

    def _accept(self, peer: int, regs: np.ndarray[Any, Any]) -> bool:
        ok = self._to_supervisor(to_sync(regs, K_REMOTE, peer))
        if ok:
            self.stats.add("sync_records_received", len(regs))
        return ok

    # ---- requests ------------------------------------------------------------------------------
    def _request(self, peer: int, now: float, force: bool = False) -> None:
        st = self.state[peer]
        if st.outstanding and not force and now - st.requested_at < self.p.request_timeout_s:
            return
        st.outstanding = True
        st.requested_at = now
        st.answer = []
        # epoch 0 names no run of the peer: it answers with a snapshot of its areas
        epoch = 0 if peer in self.want_snapshot else max(st.epoch, 0)
        self.dealers[peer].send(encode("q", peer, epoch, st.next), zmq.NOBLOCK)
        self.stats.add("sync_requests_sent")

    # ---- receiving -------------------------------------------------------------------------------
    def _on_message(self, peer: int, data: bytes, now: float) -> None:
        try:
            m = decode(data, self.smap, self.p.page_size, peer)
        except BadMessage as e:
            self.stats.add("sync_messages_rejected")
            log.warning("dropped a bad peer message", peer=peer, reason=str(e))
            return
        st = self.state[peer]
        st.heard_at = now
        if m.kind == "d":
            if m.epoch != st.epoch:  # the peer restarted (or we just joined): catch up from its start
                st.epoch, st.next = m.epoch, 0
                st.outstanding = False
                st.announced = 0
            if not self._accept(peer, m.records):
                self._request(peer, now)
                return
            st.announced = max(st.announced, m.seq + len(m.records))
            if m.seq <= st.next:
                st.next = max(st.next, m.seq + len(m.records))
            else:
                self._request(peer, now)
        elif m.kind == "hb":
            if m.epoch != st.epoch:
                st.epoch, st.next = m.epoch, 0
                st.outstanding = False
                st.announced = 0
            st.announced = max(st.announced, m.seq)
            if m.seq > st.next or peer in self.want_snapshot:
                self._request(peer, now)
        elif m.kind == "a":
            if m.epoch != st.epoch and not m.snapshot:
                return  # an answer about an older run of the peer
            if not self._accept(peer, m.records):
                st.outstanding = False
                return
            if m.last:
                if m.snapshot:
                    self.want_snapshot.discard(peer)
                # a snapshot of the peer's new run: its sequence numbers start again, so the old
                # run's count must not hide a later gap below it
                st.next = m.next_seq if m.epoch != st.epoch else max(st.next, m.next_seq)
                st.epoch = m.epoch
                st.outstanding = False
        else:
            self.stats.add("sync_messages_rejected")

    def _on_request(self, frames: list[Any]) -> None:
        """A message on the ROUTER. The sender is the owner of the CURVE key that authenticated
        the connection (the ZAP User-Id of the frame), never the routing id it chose; a routing
        id that is not that peer's name is a spoofing attempt and is dropped."""
        if len(frames) != 2:
            self.stats.add("sync_messages_rejected")
            return
        try:
            who = self.by_key.get(frames[1].get("User-Id"))
        except zmq.ZMQError:
            who = None
        if who is None or frames[0].bytes != who.name.encode():
            self.stats.add("sync_messages_rejected")
            log.warning("dropped a peer request whose routing id is not its key's owner",
                        routing_id=frames[0].bytes[:64].decode("utf-8", "replace"),
                        key_owner=who.name if who is not None else None)
            return
        peer = who.area
        self.route[peer] = frames[0].bytes
        try:
            m = decode(frames[1].bytes, self.smap, self.p.page_size, self.p.area)
        except BadMessage:
            self.stats.add("sync_messages_rejected")
            return
        if m.kind == "h":  # lossy by design: dropped if the supervisor is behind
            self._to_supervisor(to_sync(m.records, K_HINT, peer))
            return
        if m.kind != "q":
            self.stats.add("sync_messages_rejected")
            return
        rec = np.zeros(1, dtype=SYNC_REC)
        rec["kind"], rec["peer"], rec["seq"], rec["gen"] = K_REQUEST, peer, m.seq, m.epoch
        self._to_supervisor(rec)

    # ---- sending ---------------------------------------------------------------------------------
    def _flush(self) -> None:
        if not self.pending:
            return
        regs = np.concatenate(self.pending)
        self.pub.send(encode("d", self.p.area, self.p.epoch, self.pending_seq, regs))
        self.stats.add("sync_records_sent", len(regs))
        self.next_seq = max(self.next_seq, self.pending_seq + len(regs))
        self.pending = []
        self.pending_n = 0
        self.last_flush = time.monotonic()

    def _drain_out(self) -> None:
        recs = self.rings.out.get_batch(1 << 16)
        if not len(recs):
            return
        kinds = recs["kind"]
        i = 0
        n = len(recs)
        while i < n:
            k = kinds[i]
            j = i
            while j < n and kinds[j] == k:
                j += 1
            chunk = recs[i:j]
            if k == K_DELTA:
                seqs = chunk["seq"].astype(np.int64)
                # a seq gap (the supervisor dropped records when this ring was full) starts a new message
                if self.pending and int(seqs[0]) != self.pending_seq + self.pending_n:
                    self._flush()
                if not self.pending:
                    self.pending_seq = int(seqs[0])
                self.pending.append(to_registers(chunk))
                self.pending_n += len(chunk)
                if self.pending_n >= self.p.flush_records:
                    self._flush()
            elif k == K_HINT:
                for peer in np.unique(chunk["peer"]):
                    p = int(peer)
                    if p in self.dealers:
                        regs = to_registers(chunk[chunk["peer"] == peer])
                        try:
                            self.dealers[p].send(encode("h", p, 0, 0, regs), zmq.NOBLOCK)
                        except zmq.Again:
                            pass  # hints are lossy
            elif k == K_ANSWER:
                for peer in np.unique(chunk["peer"]):
                    self.answers[int(peer)].append(to_registers(chunk[chunk["peer"] == peer]))
            elif k == K_ANSWER_END:
                for r in chunk:
                    peer = int(r["peer"])
                    parts = self.answers.get(peer, [])
                    regs = np.concatenate(parts) if parts else np.zeros(0, dtype=to_registers(chunk[:0]).dtype)
                    self.answers[peer] = []
                    flags = int(r["state"])
                    self.router.send_multipart([
                        self.route.get(peer) or next(x.name.encode() for x in self.p.peers if x.area == peer),
                        encode("a", self.p.area, self.p.epoch, int(r["seq"]), regs, next_seq=int(r["gen"]),
                               snapshot=bool(flags & END_SNAPSHOT), last=bool(flags & END_LAST))])
                    self.stats.add("sync_records_sent", len(regs))
            i = j

    def run(self) -> None:
        """Serve until SIGTERM or the supervisor is gone."""
        last_parent_check = 0.0
        while not self.stop:
            events = dict(self.poller.poll(2))
            now = time.monotonic()
            if self.router in events:
                for _ in range(1000):
                    try:
                        self._on_request(self.router.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
            for s in [*self.subs.values(), *self.dealers.values()]:
                if s in events:
                    peer = self.sock_peer[id(s)]
                    for _ in range(1000):
                        try:
                            self._on_message(peer, s.recv(zmq.NOBLOCK), now)
                        except zmq.Again:
                            break
            self._drain_out()
            if self.pending and now - self.last_flush >= self.p.flush_interval_s:
                self._flush()
            if now - self.last_hb >= self.p.heartbeat_s:
                self.last_hb = now
                self.pub.send(encode("hb", self.p.area, self.p.epoch, self.next_seq))
                for peer, st in self.state.items():
                    if st.outstanding and now - st.requested_at > self.p.request_timeout_s:
                        self._request(peer, now, force=True)
                self._publish_board(now)
            if now - last_parent_check > 0.5:
                last_parent_check = now
                if os.getppid() != self.parent:
                    break

    def _publish_board(self, now: float) -> None:
        """Each peer's lag (seconds since we last heard it, updates it announced that we lack) and
        this process's recent warnings, for ``status`` and the dashboard."""
        if self.board is None:
            return
        from ..logging import recent_warnings

        peers = {}
        for x in self.p.peers:
            st = self.state[x.area]
            peers[x.name] = {"heard_s": round(now - st.heard_at, 3) if st.heard_at else None,
                             "behind": max(0, st.announced - st.next), "catching_up": st.outstanding}
        self.board.write({"peers": peers, "warnings": recent_warnings()[-10:]})

    def close(self) -> None:
        """Close sockets and mappings."""
        self.t.close()
        self.doorbell.close()
        self.board = None
        if self.board_seg is not None:
            self.board_seg.close()


def agent_main(p: AgentParams) -> None:
    """Process entry point (spawned by the supervisor)."""
    from ..logging import configure_logging

    configure_logging(store=p.store, server=p.server, component="sync")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        a = Agent(p)
    except zmq.ZMQError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        # the supervisor starts another agent; say why in words, not a traceback each time
        log.error("sync address in use: another socket on this machine holds it", error=str(e),
                  addresses=[p.pub, p.router], hint=ADDRESS_IN_USE_HINT)
        sys.exit(EXIT_ADDRESS_IN_USE)

    def _term(signum: int, frame: Any) -> None:
        a.stop = True

    signal.signal(signal.SIGTERM, _term)
    log.info("sync agent started", peers=len(p.peers))
    try:
        a.run()
    finally:
        a.close()
