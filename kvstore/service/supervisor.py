"""The supervisor: starts one store's service on this server, turns its parts, stops them.

The service is state and parts. ``state.StoreState`` is the store as this server sees it
(slot table, key index, allocator, stats; the feed of slot changes); ``runtime.Runtime``
names everything a run shares and creates it. The parts each take the state (and the
runtime) explicitly and expose ``turn(now)`` and a way to close:

    requests.Requests     client requests and device completions     every loop turn
    sync.SyncLink         peers' registers in, own changes out        every loop turn
    clients.Clients       the socket, hellos, gone clients            every tick
    workers.Workers       one I/O worker process per device           every tick
    agentproc.AgentProcess the sync agent's process                  every tick
    reloads.Reloads       allow/deny and config edits                 every tick
    events.EventPublisher KV events (subscribed to the change feed)   every tick
    gauges.Gauges         stats gauges and the dashboard's board      every tick
    StoreState.turn       background slot-table checkpoints           every tick

This module wires them (a part's callbacks go to another part, never back here) and owns the
lock, the doorbell, the signal handlers and the order of start and stop. Nothing calls into it.

Shared memory (names from ``shm.segment.name_prefix``):

    <p>control   slot table | index head | key index | reference bits (shm/control.py)
    <p>stats     stats block;   <p>board  the dashboard's board;   <p>w<d>  rings of worker d
    <p>c<id>     one per client connection (request ring, descriptors, counters, direct-read
                 rings, pins, its buffers; ipc/connection.py)
    <p>sync, <p>peers   the sync agent's rings and board (with two or more servers)
    <p>wake.bell   doorbell (a FIFO, shm/wake.py): every producer toward the supervisor posts it
    <p>wake.w<d>   wake-up of worker d;  <p>wake.c<id>  wake-up of client id (its read end
                   goes to the client with the hello)

The loop turns the requests and the sync link, then waits on the doorbell (20 ms at most);
every 20 ms it turns the other parts. It never blocks on a client or waits for a process:
lost workers and a replaced sync agent are reaped by polling.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import time
from pathlib import Path
from typing import Any

import multiprocess
import structlog

from ..config import StoreConfig, mass_home
from ..crdt.serverkeys import serving_key
from ..crdt.log import SyncRings
from ..errors import AlreadyRunning, KVStoreError, NotAllowed
from ..shm.board import BOARD_BYTES
from ..shm.segment import remove_leftovers
from ..shm.wake import WakeReader
from .agentproc import AgentProcess
from .clients import Clients
from .gauges import Gauges
from .reloads import Reloads, verified_membership
from .requests import Requests
from .runtime import Runtime, binding, raise_fd_limit
from .state import StoreState
from .sync import SyncLink, new_epoch
from .workers import Workers

log = structlog.get_logger(__name__)

TICK_S = 0.02


class Supervisor:
    """Serves one store as one server (see the module doc)."""

    def __init__(self, cfg: StoreConfig, server: str, home: Path | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.home = (home or mass_home()).resolve()
        self.area = cfg.check_allowed(server)
        # only with this server's private key: before anything is mapped, locked or written
        serving_key(cfg.name, server, cfg.servers[self.area].public_key, self.home)
        self.rt = Runtime.of(cfg, server, self.home)
        self.log = log.bind(store=cfg.name, server=server)
        self.stop = self.started = False
        self.refused = ""
        """Why the service stopped itself (denied, its key not here): ``serve`` raises it."""
        self.st: StoreState | None = None
        self.doorbell: WakeReader | None = None
        self._lock_fd: int | None = None
        self._mp = multiprocess.get_context("spawn")
        self.epoch = new_epoch()
        self.parts: dict[str, Any] = {}
        """Started parts by name (``requests``, ``clients``, ``workers``, ``reloads``, ``sync``,
        ``agent``, ``events``, ``metrics``, ``gauges``): stopped in reverse order."""

    # ---- start-up -------------------------------------------------------------------------------
    def _lock(self) -> None:
        rundir = self.rt.rundir
        rundir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.rt.group is not None:
            os.chown(rundir, -1, self.rt.group)
        os.chmod(rundir, 0o750 if self.rt.group is not None else 0o700)
        fd = os.open(rundir / f"{self.server}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise AlreadyRunning(
                    f"a service of store {self.cfg.name!r} as server {self.server!r} already runs here "
                    f"(lock {rundir / (self.server + '.lock')} is held)") from None
            raise
        self._lock_fd = fd

    def start(self) -> None:
        """Lock, clean a crashed predecessor's leftovers, verify devices, build the state, start parts."""
        cfg, rt = self.cfg, self.rt
        self._lock()
        try:
            stale = remove_leftovers(rt.prefix)
            if stale:
                self.log.warning("removed leftovers of a crashed service", count=len(stale))
            # a change made since cfg was composed is applied by the first reload (it only
            # renames or flags areas: the layout taken from these superblocks is the same)
            m = verified_membership(cfg, self.server, self.area, self.home, self.log)
            raise_fd_limit(cfg.service.max_clients)
            self.st = st = StoreState.build(cfg, self.server, self.area, tuple(m.sbs), rt, home=self.home)
            self.doorbell = rt.wake(rt.doorbell)
            p = self.parts
            p["workers"] = pool = Workers(st, rt, self._mp, queued=lambda d: p["requests"].queued(d),
                                          on_lost=lambda d, dead: p["requests"].fail_device(d, dead),
                                          on_replaced=lambda d: p["clients"].fail_direct_reads(d))
            p["clients"] = clients = Clients(st, rt, pool.slots)
            st.alloc.reading = clients.reading
            p["requests"] = Requests(st, pool.slots, clients)
            pool.spawn_all()
            st.stats.set("config_generation", cfg.membership_gen)
            p["reloads"] = Reloads(st, self.home)
            if len(cfg.servers) > 1:
                self._start_sync()
            self._start_publishers()
            p["gauges"] = Gauges(st, clients)
            clients.listen()
            p["reloads"].start()
            (rt.rundir / f"{self.server}.pid").write_text(f"{os.getpid()}\n")
            self.started = True
            self.log.info("service started", pid=os.getpid(), devices=len(cfg.devices), slots=st.smap.total,
                          own_slots=sum(len(r) for r in st.own), socket=str(rt.sock_path))
        except BaseException:
            self.shutdown()
            raise

    def _start_sync(self) -> None:
        assert self.st is not None
        self.rt.segment("peers", BOARD_BYTES, self.rt.read_mode)
        seg = self.rt.segment("sync", SyncRings.nbytes(), 0o600)  # the agent's and ours alone
        self.parts["sync"] = sync = SyncLink.of(self.st, seg.buf, self.epoch)
        self.parts["agent"] = agent = AgentProcess(self.st, self.rt, epoch=self.epoch, mp=self._mp, sync=sync,
                                                   resnapshot=self.parts["reloads"].resnapshot)
        agent.spawn()

    def _start_publishers(self) -> None:
        """Prometheus metrics and KV events, where this server's config gives them an address."""
        assert self.st is not None
        st = self.st
        me = st.cfg.servers[self.area]
        if me.metrics:
            from .metrics import serve_metrics

            with binding("metrics", me.metrics, self.server):
                self.parts["metrics"] = serve_metrics(me.metrics, st.stats, st.cfg.name, self.server)
        if me.events:
            from .events import ChangeEvents, EventPublisher

            host, _, port = me.events.rpartition(":")
            with binding("events", me.events, self.server):
                pub = EventPublisher(f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}", f"kvstore:{st.cfg.name}")
            self.parts["events"] = pub
            pub.add({"type": "AllBlocksCleared"})
            ChangeEvents.subscribe(pub, st)

    # ---- loop -----------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        st, p = self.st, self.parts
        assert st is not None
        p["clients"].turn(now)
        hints, st.hints = st.hints, []
        if "sync" in p:
            p["sync"].send_hints(hints)
        if "events" in p:
            p["events"].tick()
        p["workers"].turn(now)
        if "agent" in p:
            p["agent"].turn(now)
        if p["reloads"].turn(now):  # the servers changed: start replicating, or re-peer the agent
            try:
                if "agent" in p:
                    p["agent"].replace()  # without waiting: the new one binds once the old one exited
                elif len(st.cfg.servers) > 1:
                    self._start_sync()
            except (ValueError, KVStoreError, OSError) as e:  # the service serves on as it was
                self.log.warning("store config changed but was not applied", error=str(e))
        p["clients"].follow_keys()  # before any request is served under an invalidated salt
        st.stats.set("config_generation", st.cfg.membership_gen)  # what mass-ctl waits for
        st.turn(now)
        p["gauges"].turn(now)

    def run(self) -> None:
        """Serve until ``stop`` is set (SIGTERM/SIGINT) or the service gives up, then shut down."""
        st, p = self.st, self.parts
        assert st is not None and self.doorbell is not None
        last = 0.0
        try:
            while not (self.stop or st.stopping):
                now = time.monotonic()
                n = p["requests"].turn(now)
                if "sync" in p:
                    n += p["sync"].turn(now)
                if now - last >= TICK_S:
                    last = now
                    self._tick(now)
                if n == 0:
                    self.doorbell.wait(TICK_S)
        finally:
            self.refused = st.refused
            self.shutdown()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop cleanly; SIGHUP re-reads the membership and config now."""
        def _stop(signum: int, frame: Any) -> None:
            self.stop = True
            if self.st is not None:  # the parts respawn and accept nothing more from now on
                self.st.stopping = True

        def _hup(signum: int, frame: Any) -> None:
            if "reloads" in self.parts:
                self.parts["reloads"].poke()
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGHUP, _hup)

    def shutdown(self) -> None:
        """Stop workers, disconnect clients, remove every segment, wake-up, socket and pid file."""
        self.stop = True
        if self.st is not None:
            self.st.stopping = True
        p = self.parts
        if "reloads" in p:
            p.pop("reloads").close()
        if "events" in p:
            p.pop("events").close()
        if "metrics" in p:
            m = p.pop("metrics")
            m.shutdown()
            m.server_close()
        if "clients" in p:
            p["clients"].close()
        if "agent" in p:
            p.pop("agent").stop()
        if "workers" in p:
            p["workers"].stop_all()
        if self.st is not None:
            self.st.close(checkpoint=self.started)
        if "clients" in p:
            p.pop("clients").drop_all()
        if "workers" in p:
            p.pop("workers").close()
        p.clear()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        self.rt.close()
        try:
            (self.rt.rundir / f"{self.server}.pid").unlink()
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.log.info("service stopped")


def serve(cfg: StoreConfig, server: str, home: Path | None = None) -> None:
    """Run the service in this process until SIGTERM/SIGINT (``mass-ctl kvcache connect``)."""
    sup = Supervisor(cfg, server, home)
    sup.install_signal_handlers()
    sup.start()
    sup.run()
    if sup.refused:  # denied, or its key is gone: a failure to whoever started it (systemd too)
        raise NotAllowed(sup.refused)


__all__ = ["Supervisor", "TICK_S", "serve"]
