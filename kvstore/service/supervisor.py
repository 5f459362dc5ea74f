"""The supervisor: owns one store's state on this server and serves its clients.

Processes: this one (index, allocation, request loop), one I/O worker per
device (``kvstore.ioworkers.worker``), spawned and restarted by ``workers.Workers``.
Client requests and device completions are ``requests.Requests``; client
connections (hellos, reaping, pins) ``clients.Clients``; the sync agent's
process ``agent.AgentProcess``; slot-table checkpoints ``checkpoint``. This
module owns the store's state (slot table, index, allocator, shared memory),
starts and stops everything, applies membership changes, and runs the loop
that composes them.

Shared memory (names from ``shm.segment.name_prefix``):

    <p>control   slot table | index head | key index | reference bits | arena buffer
                 states | connection table (shm/control.py)
    <p>arena     page buffers (header block + page each)
    <p>stats     stats block
    <p>w<d>      rings of worker d
    <p>c<id>     one per client connection (request ring, descriptors, counters, direct-read
                 rings, pins; ipc/connection.py)
    <p>wake.bell   doorbell (a FIFO, shm/wake.py): every producer toward the supervisor posts it
    <p>wake.w<d>   wake-up of worker d;  <p>wake.c<id>  wake-up of client id (its read end
                   goes to the client with the hello)

The loop drains worker completions, then client requests (one per connection
per turn), then waits on the doorbell (20 ms at most); every 20 ms it also
advances handshakes and reaps connections, checks workers (dead, or a device
I/O older than ``io_timeout_s``) and updates gauges. It never blocks on a
client or waits for a process: lost workers and a replaced sync agent are
reaped by polling.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import multiprocess
import numpy as np
import structlog
import zmq
import zmq.utils.z85

from ..config import StoreConfig, mass_home, run_dir, seen_record
from ..errors import AddressUnavailable, AlreadyRunning, KVStoreError, NotAllowed
from ..logging import recent_warnings
from ..ipc.iorings import REQUEST_RING, WorkerRings
from ..crdt.log import SyncRings
from ..ioworkers.worker import WorkerParams
from ..ipc import lease as A
from ..shm.board import BOARD_BYTES, Board
from ..shm.control import ControlLayout
from ..shm.index import KeyIndex
from ..shm.segment import Segment, name_prefix, remove_leftovers
from ..shm.wake import WakeReader, client_wake_prefix, doorbell_name, unlink_wake, worker_wake_name
from ..shm.slots import EMPTY, VALID, SlotMap, entry_words
from ..shm.stats import StatsBlock, stats_nbytes
from ..crdt.keys import serving_key
from ..storage.membership import Membership, read_membership
from .allocator import Allocator, Generations
from .connections import Conn
from .membership import MembershipWatcher, RefusedCopies
from .agent import AgentProcess
from .requests import Requests
from .clients import Clients
from .workers import WorkerSlot, Workers
from .checkpoint import CheckpointWriter, checkpoint_path, layout_fingerprint, load_checkpoint
from .rebuild import scan_devices
from .sync import SyncLink, new_epoch

log = structlog.get_logger(__name__)

TICK_S = 0.02


FD_MARGIN = 256
"""Open files a service needs besides its connections' (``Supervisor._raise_fd_limit``)."""


class Supervisor:
    """Serves one store as one server. Invariant: it is the only writer of the slot
    table and key index, and every buffer it holds (SERVICE/QUARANTINE) is given
    back exactly once."""

    def __init__(self, cfg: StoreConfig, server: str, home: Path | None = None) -> None:
        self.cfg = cfg
        self.server = server
        self.home = (home or mass_home()).resolve()
        self.area = cfg.check_allowed(server)
        # only with this server's private key: before anything is mapped, locked or written
        serving_key(cfg.name, server, cfg.servers[self.area].public_key, self.home)
        self.refused = ""
        """Why the service stopped itself (denied, its key not here): ``serve`` raises it."""
        self.prefix = name_prefix(self.home, cfg.name, server)
        self.rundir = run_dir(cfg.name, self.home)
        self.sock_path = self.rundir / f"{server}.sock"
        self.stop = False
        self._segments: list[Segment] = []
        self._wakes: list[str] = []
        self.doorbell: WakeReader | None = None
        self._lock_fd: int | None = None
        self.workers: list[WorkerSlot] = []  # the Workers' slots, once started
        self.pool: Workers | None = None
        self.clients: Clients | None = None
        self.requests: Requests | None = None
        self.ckpt: CheckpointWriter | None = None
        self._last_ckpt = time.monotonic()
        self.started = False
        self.sync: SyncLink | None = None
        self.agent: AgentProcess | None = None
        self.to_publish: list[tuple[int, Any]] = []
        self.epoch = new_epoch()
        self.events: Any = None
        self.metrics: Any = None
        self.hints: list[int] = []
        self.log = log.bind(store=cfg.name, server=server)
        self.watcher: MembershipWatcher | None = None
        self.resnapshot: set[int] = set()
        # who may use this service: its own user, plus a group when configured
        self.group: int | None = None
        if cfg.service.access_group:
            import grp

            try:
                self.group = grp.getgrnam(cfg.service.access_group).gr_gid
            except KeyError:
                raise ValueError(f"service.access_group {cfg.service.access_group!r} is not a group here") from None
        self.mode = 0o660 if self.group is not None else 0o600
        # what clients only read (the lookup tables, statistics) is group-readable, never
        # group-writable; what only the service and its children use is owner-only whatever
        # the group (docs/SECURITY.md "Who maps what")
        self.read_mode = 0o640 if self.group is not None else 0o600

    # ---- start-up -------------------------------------------------------------------------
    def _lock(self) -> None:
        self.rundir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.group is not None:
            os.chown(self.rundir, -1, self.group)
            os.chmod(self.rundir, 0o750)
        else:
            os.chmod(self.rundir, 0o700)
        fd = os.open(self.rundir / f"{self.server}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise AlreadyRunning(
                    f"a service of store {self.cfg.name!r} as server {self.server!r} already runs here "
                    f"(lock {self.rundir / (self.server + '.lock')} is held)") from None
            raise
        self._lock_fd = fd

    def _load_slot_table(self) -> tuple[tuple[int, ...], ...]:
        """Fill the slot table from the checkpoint if there is a usable one, else from every slot
        header on the devices; returns the highest generation per (device, area)."""
        cfg = self.cfg
        layout = layout_fingerprint(self.sbs)
        path = checkpoint_path(self.home, cfg.name, self.server)
        if cfg.service.checkpoint_interval_s > 0:
            self.ckpt = CheckpointWriter(path, self.slots, cfg.uuid_bytes, layout)
            loaded, why = load_checkpoint(path, self.slots, cfg.uuid_bytes, layout, self.smap)
        else:
            loaded, why = None, "checkpoints are off (service.checkpoint_interval_s = 0)"
        if loaded is not None:
            self.log.info("slot table loaded from checkpoint", valid=loaded.valid, age_s=round(loaded.age_s, 1),
                          seconds=round(loaded.seconds, 3))
            return loaded.max_gen
        self.log.info("no usable checkpoint: reading every slot header", reason=why)
        rep = scan_devices(cfg.devices, self.sbs, self.smap, self.slots)
        self.log.info("rebuilt location table from slot headers", scanned=rep.scanned, valid=rep.valid,
                      seconds=round(rep.seconds, 3))
        return rep.max_gen

    def _maybe_checkpoint(self, now: float) -> None:
        """Start a background checkpoint when one is due (never waits for one)."""
        iv = self.cfg.service.checkpoint_interval_s
        if self.ckpt is None or iv <= 0 or now - self._last_ckpt < iv:
            return
        if self.ckpt.last_error:
            self.log.warning("slot-table checkpoint failed", error=self.ckpt.last_error)
            self.ckpt.last_error = ""
        if self.ckpt.start():
            self._last_ckpt = now

    def _segment(self, what: str, size: int, mode: int | None = None) -> Segment:
        """A segment of this service: ``mode`` 0o600 for the service's own (no group), 0o640 for
        what clients read, the default (``self.mode``) for what clients write."""
        mode = self.mode if mode is None else mode
        seg = Segment.create(self.prefix + what, size, mode, self.group if mode & 0o070 else None)
        self._segments.append(seg)
        return seg

    def _wake(self, name: str) -> WakeReader:
        """A consumer's wake-up (shm/wake.py): group members may post, never wait."""
        self._wakes.append(name)
        return WakeReader.create(name, 0o620 if self.group is not None else 0o600, self.group)

    def _raise_fd_limit(self) -> None:
        """Raise the soft limit on open files to what ``max_clients`` needs (the workers inherit it).

        Each connection holds three descriptors in the supervisor (its socket, its wake-up's write
        end, and the one Python's mmap keeps of its segment) and two in each worker (the mapping's
        and the wake-up's); handshakes, devices, logs and ZeroMQ take the rest of a fixed margin.
        A hard limit below that is a clear start-up error, not EMFILE at some later client."""
        n = self.cfg.service.max_clients
        need = 3 * n + FD_MARGIN
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= need:
            return
        if hard != resource.RLIM_INFINITY and hard < need:
            raise KVStoreError(f"service.max_clients = {n} needs {need} open files, but this process may open "
                               f"at most {hard} (ulimit -Hn; LimitNOFILE= under systemd): raise it or lower "
                               f"max_clients")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))

    def start(self) -> None:
        """Lock, clean a crashed predecessor's leftovers, verify devices, build shm, rebuild, spawn."""
        cfg = self.cfg
        self._lock()
        try:
            stale = remove_leftovers(self.prefix)
            if stale:
                self.log.warning("removed leftovers of a crashed service", count=len(stale))
            # a device rolled back to an older membership is read as this machine last saw it;
            # a torn one stops the start (its path may lead to another device now)
            m = read_membership(cfg.devices, store_uuid=cfg.uuid_bytes,
                                admin_key=bytes.fromhex(cfg.admin_key) if cfg.admin_key else None,
                                min_gen=cfg.membership_gen, seen=seen_record(cfg.name, self.home).load())
            # a change made since cfg was composed is applied by the watcher's first read (it only
            # renames or flags areas: the layout taken from these superblocks is the same)
            for why in m.refused:
                self.log.warning("superblock copy refused", reason=why)
            mine = m.newest.areas[self.area]
            if mine.server != self.server or mine.denied or \
                    zmq.utils.z85.encode(mine.public_key).decode() != cfg.servers[self.area].public_key:
                # the config handed in is not the devices' word (a library caller's own): the devices decide
                raise NotAllowed(f"the devices give area {self.area} to server {mine.server!r}"
                                 f"{' (denied)' if mine.denied else ''} with another key than the config this "
                                 f"service was started with: start it from the store's own config")
            self.sbs = m.sbs
            self.smap = SlotMap([[a.slot_count for a in sb.areas] for sb in self.sbs])
            total = self.smap.total
            self.arena_count = cfg.service.max_clients * cfg.service.client_buffers
            if self.arena_count > REQUEST_RING:
                raise ValueError(f"max_clients x client_buffers must be <= {REQUEST_RING}, "
                                 f"got {self.arena_count}")
            self._raise_fd_limit()
            lay = ControlLayout.of(total)
            self.layout = lay
            ctl = self._segment("control", lay.nbytes, self.read_mode)
            self.slots = lay.slot_table(ctl.buf)
            # each connection's buffers live in its own segment (Clients attaches them here)
            self.arena = A.LeaseStates(cfg.service.client_buffers, cfg.service.max_clients)
            st = self._segment("stats", stats_nbytes(len(cfg.devices)), self.read_mode)
            self.stats = StatsBlock(st.buf, len(cfg.devices), init=True)
            self.board = Board(self._segment("board", BOARD_BYTES, self.read_mode).buf)
            self.stats.set("started_ns", time.time_ns())
            self.doorbell = self._wake(doorbell_name(self.prefix))
            # rebuild from headers, then index: other areas first so our own copy wins a duplicate
            max_gen = self._load_slot_table()
            for i, sv in enumerate(cfg.servers):
                if sv.denied:  # a denied server's pages are never read
                    self._forget_area(i)
            self.index = KeyIndex(lay.index_entries(ctl.buf), self.slots, init=True, seq=lay.index_seq(ctl.buf))
            self.index.rebuild()
            gens = [Generations(max_gen[d][self.area]) for d in range(self.smap.n_devices)]
            self.own = [self.smap.area_gids(d, self.area) for d in range(self.smap.n_devices)]
            self.local = np.zeros(total, dtype=bool)  # own slots: preferred when a key has several copies
            for r in self.own:
                self.local[r.start:r.stop] = True
            self.alloc = Allocator(self.slots, self.own, gens, cfg.service.retire_grace_s,
                                   on_retire=self._on_retire, ref=lay.ref_bits(ctl.buf),
                                   reading=self._clients_reading)

            for d, path in enumerate(cfg.devices):
                # the worker's rings and connection table: the service's and the worker's alone
                seg = self._segment(f"w{d}", WorkerRings.nbytes(cfg.service.max_clients), 0o600)
                wake_name = worker_wake_name(self.prefix, d)
                wake = self._wake(wake_name)  # drained by the worker; this end keeps it open and posts
                rings = WorkerRings(seg.buf, cfg.service.max_clients)
                rings.pins[:] = -1  # no direct read pins anything yet
                self.workers.append(WorkerSlot(d, path, seg, rings, wake, wake_name))
            self._mp = multiprocess.get_context("spawn")
            self.requests = Requests(self)
            self.pool = Workers(cfg=lambda: self.cfg, stopping=lambda: self.stop, mp=self._mp, stats=self.stats,
                                log=self.log, arena=self.arena, params=self._worker_params,
                                queued=self._queued,
                                on_lost=self._worker_lost, on_replaced=self._worker_replaced)
            self.pool.slots = self.workers
            for w in self.workers:
                self.pool.spawn(w)
            self.stats.set("config_generation", cfg.membership_gen)
            if len(cfg.servers) > 1:
                self._start_sync()
            me = cfg.servers[self.area]
            if me.metrics:
                from .metrics import serve_metrics

                with _binding("metrics", me.metrics, self.server):
                    self.metrics = serve_metrics(me.metrics, self.stats, cfg.name, self.server)
            if me.events:
                from .events import EventPublisher

                host, _, port = me.events.rpartition(":")
                with _binding("events", me.events, self.server):
                    self.events = EventPublisher(f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}",
                                                 f"kvstore:{cfg.name}")
                self.events.add({"type": "AllBlocksCleared"})
                self._emit_stored(np.nonzero(self.slots["state"] == VALID)[0])
            self.clients = Clients(
                cfg=lambda: self.cfg, stopping=lambda: self.stop, arena=self.arena, stats=self.stats, log=self.log,
                prefix=self.prefix, mode=self.mode, group=self.group, sock_path=self.sock_path,
                workers=self.workers, n_devices=len(self.workers), lease_buffers=cfg.service.client_buffers,
                page_size=cfg.page_size, hello={
                    "page_size": cfg.page_size, "control": self.prefix + "control",
                    "doorbell": doorbell_name(self.prefix), "service_pid": os.getpid(), "store": cfg.name,
                    "server": self.server, "stats": self.prefix + "stats", "slots": self.smap.total,
                    "max_clients": cfg.service.max_clients, "workers": [w.wake_name for w in self.workers],
                    "areas": [[a.slot_count for a in sb.areas] for sb in self.sbs]})
            self.clients.listen()
            self.watcher = MembershipWatcher(cfg.name, self.home, cfg.membership_gen)
            self.watcher.start()
            (self.rundir / f"{self.server}.pid").write_text(f"{os.getpid()}\n")
            self.log.info("service started", pid=os.getpid(), devices=len(cfg.devices), slots=total,
                          own_slots=sum(len(r) for r in self.own), socket=str(self.sock_path))
            self.started = True
        except BaseException:
            self.shutdown()
            raise

    def _start_sync(self) -> None:
        self._segment("peers", BOARD_BYTES, self.read_mode)
        seg = self._segment("sync", SyncRings.nbytes(), 0o600)  # the agent's and ours alone
        self.sync = SyncLink(seg.buf, self.slots, self.smap, self.index, self.area, self.epoch,
                             self.cfg.sync.delta_log_records, self.stats, on_change=self._on_merge,
                             on_hint=self._on_hint)
        self.agent = AgentProcess(cfg=lambda: self.cfg, server=self.server, area=self.area, home=self.home,
                                  epoch=self.epoch, smap=self.smap, prefix=self.prefix, mp=self._mp,
                                  stats=self.stats, log=self.log, sync=self.sync, resnapshot=self.resnapshot,
                                  stopping=lambda: self.stop, give_up=self._give_up)
        self.agent.spawn()

    # ---- membership: allow / deny while running ------------------------------------------------
    def _forget_area(self, area: int) -> int:
        """Drop every page of ``area`` from this server's view (its server was denied).

        Slots go back to EMPTY, generation 0: the index stops finding them at once, and
        if the server is allowed again its own snapshot tells us what it holds. Reads
        already in flight still validate the header against what they expected."""
        n = 0
        for d in range(self.smap.n_devices):
            r = self.smap.area_gids(d, area)
            part = self.slots[r.start:r.stop]
            valid = np.nonzero(part["state"] == VALID)[0] + r.start
            self._emit_removed(self._digests(valid))
            n += len(valid)
            part["state"] = EMPTY
            part["gen"] = 0
        return n

    def _check_membership(self) -> None:
        """Apply what the watcher read: an allow/deny from any machine (via the superblocks), or
        this machine's edited config. Errors are logged; the service serves on as it was."""
        assert self.watcher is not None
        for item in self.watcher.take():
            if isinstance(item, RefusedCopies):
                self.log.warning("superblock copy refused", reason=str(item))
                continue
            if isinstance(item, Exception):
                self.log.warning("store config changed but was not applied", error=str(item))
                continue
            try:
                self._apply_config(*item)
            except (ValueError, KVStoreError, OSError) as e:
                self.log.warning("store config changed but was not applied", error=str(e))

    def _apply_config(self, new: StoreConfig, m: Membership) -> None:
        old = self.cfg
        if new.membership_gen < old.membership_gen:
            raise ValueError(f"the devices' membership went back from generation {old.membership_gen} to "
                             f"{new.membership_gen}: refused")
        for what in ("uuid", "page_size", "devices", "salt"):
            if getattr(new, what) != getattr(old, what):
                raise ValueError(f"the config's {what} changed: restart the service to use it")
        if len(new.servers) < len(old.servers) or any(
                o.name != n.name and not o.denied for o, n in zip(old.servers, new.servers)):
            raise ValueError("servers were removed or reordered (deny them instead; areas never shift)")
        if new.servers == old.servers:
            self.cfg = new  # this machine's settings changed, or nothing that concerns us
            self.stats.set("config_generation", new.membership_gen)
            return
        sbs = m.sbs
        if [[a.slot_count for a in sb.areas] for sb in sbs] != self.smap.counts:
            raise ValueError("the devices' area layout changed: restart the service")
        if new.servers[self.area].denied or new.servers[self.area].name != self.server:
            self._give_up(f"server {self.server!r} was denied on store {new.name!r} (membership generation "
                          f"{new.membership_gen}); stopped")
            return
        if new.servers[self.area].public_key != old.servers[self.area].public_key:
            try:  # the administrator rotated this server's key: serve on only if the new one is here
                serving_key(new.name, self.server, new.servers[self.area].public_key, self.home)
            except NotAllowed as e:
                self._give_up(f"{e}; stopped")
                return
        dropped = 0
        for i, sv in enumerate(new.servers):
            was = old.servers[i].denied if i < len(old.servers) else False
            if sv.denied and not was:
                dropped += self._forget_area(i)
                self.log.warning("server denied: its area is no longer read", denied=sv.name, area=i)
            elif was and not sv.denied:
                self.resnapshot.add(i)  # we forgot its pages; its deltas will not repeat them
                self.log.info("server allowed again" if sv.name == old.servers[i].name
                              else "server allowed into a denied server's area", allowed=sv.name, area=i)
            elif i >= len(old.servers):
                self.log.info("server allowed", allowed=sv.name, area=i)
        self.cfg = new
        self.sbs = sbs
        self.stats.add("areas_dropped", dropped)
        self.stats.add("config_reloads")
        self.stats.set("config_generation", new.membership_gen)
        if self.sync is None:
            if len(new.servers) > 1:
                self._start_sync()
            return
        # the agent takes its peers and the keys it admits at spawn: replace it, without
        # waiting here (the new one binds the same addresses once the old one has exited)
        if self.agent is not None:
            self.agent.replace()

    def _worker_params(self, w: WorkerSlot) -> WorkerParams:
        cfg = self.cfg
        return WorkerParams(
            device_path=w.path, device_index=w.device, store_uuid=cfg.uuid_bytes, page_size=cfg.page_size,
            control_name=self.prefix + "control", lease_buffers=cfg.service.client_buffers,
            worker_segment=self.prefix + f"w{w.device}",
            stats_name=self.prefix + "stats", doorbell=doorbell_name(self.prefix), wakeup=w.wake_name,
            read_depth=cfg.worker.read_queue_depth, max_inflight_writes=cfg.worker.max_inflight_writes,
            store=cfg.name, server=self.server,
            max_clients=cfg.service.max_clients, conn_prefix=self.prefix + "c",
            wake_prefix=client_wake_prefix(self.prefix), n_devices=len(self.workers),
            slot_size=self.sbs[w.device].slot_size,
            area_offsets=tuple(a.offset for a in self.sbs[w.device].areas),
            area_slots=tuple(a.slot_count for a in self.sbs[w.device].areas),
            own_area=self.area, area_gids=tuple(self.smap.bases[w.device]), ref_offset=self.layout.ref_offset)

    def _digests(self, gids: Any) -> list[bytes]:
        return [bytes(x) for x in entry_words(self.slots[np.asarray(gids, dtype=np.int64)])]

    def _note(self, gid: int) -> None:
        """Queue the slot's register *as it is now* for peers (it may change again before the
        batch is published: a retired slot is often rewritten in the same turn)."""
        if self.sync is not None:
            self.to_publish.append((gid, self.slots[gid].copy()))

    def _on_retire(self, gid: int) -> None:
        self._note(gid)
        if self.events is not None:  # the digest costs more than the rest of a retirement
            self._emit_removed(self._digests([gid]))

    def _on_hint(self, gids: Any) -> None:
        self.alloc.touch(gids)  # peers read these: give them CLOCK's second chance

    def _on_merge(self, removed: list[bytes], stored_gids: Any) -> None:
        self._emit_removed(removed)
        self._emit_stored(stored_gids)

    def _emit_stored(self, gids: Any) -> None:
        if self.events is not None and len(gids):
            for s in range(0, len(gids), 1024):
                self.events.stored(self._digests(gids[s:s + 1024]))

    def _emit_removed(self, digests: list[bytes]) -> None:
        if self.events is not None and digests:
            self.events.removed(digests)

    # ---- index helpers ----------------------------------------------------------------------
    def _clients_reading(self, gid: int) -> bool:
        return self.clients is not None and self.clients.reading(gid)

    def _give_up(self, why: str) -> None:
        """Stop: this machine may no longer serve as this server (``serve`` raises ``why``)."""
        self.log.error("this machine may no longer serve as this server; stopping", reason=why)
        self.refused = why
        self.stop = True

    def _worker_lost(self, device: int, dead: bool) -> list[tuple[Conn, int]]:
        assert self.requests is not None
        return self.requests.fail_device(device, dead)

    def _queued(self, device: int) -> bool:
        return self.requests is not None and any(op.device == device for op in self.requests.pending.values())

    def _worker_replaced(self, device: int) -> None:
        if self.clients is not None:
            self.clients.fail_direct_reads(device)

    # ---- loop ----------------------------------------------------------------------------------
    def _gauges(self, full: bool) -> None:
        """Cheap gauges every tick; the ones that scan the slot table (O(slots)) only when ``full``."""
        s = self.stats
        s.set("heartbeat_ns", time.time_ns())
        assert self.clients is not None
        s.set("clients_connected", self.clients.count_all())
        s.set("pins", self.alloc.pinned_slots)
        if not full:
            return
        st = self.slots["state"]
        s.set("slots_total", self.smap.total)
        s.set("slots_valid", int(np.count_nonzero(st == VALID)))
        own = sum(len(r) for r in self.own)
        own_valid = [int(np.count_nonzero(st[r.start:r.stop] == VALID)) for r in self.own]
        for d, r in enumerate(self.own):
            s.dev_set(d, "own_slots", len(r))
            s.dev_set(d, "own_slots_valid", own_valid[d])
        s.set("own_slots", own)
        s.set("own_slots_valid", sum(own_valid))
        tenants = {}
        for name, tid in self.clients.tenant_ids.items():
            tenants[name] = {"slots": self.alloc.used_by.get(tid, 0), "quota": self.cfg.quota_for(name),
                             "pinned": len(self.alloc.pinned_by.get(tid, ())),
                             "pin_quota": self.cfg.pin_quota_for(name, own)}
        board = {"tenants": tenants, "warnings": recent_warnings()[-10:]}
        if board != getattr(self, "_last_board", None):
            self.board.write(board)
            self._last_board = board

    def run(self) -> None:
        """Serve until ``stop`` is set (SIGTERM/SIGINT), then shut down."""
        last = last_full = 0.0
        try:
            while not self.stop:
                assert self.requests is not None
                n = self.requests.drain() + self.requests.serve()
                if self.sync is not None:
                    n += self.sync.drain() + self.sync.serve_answers()
                    if self.to_publish:
                        self.sync.publish(self.to_publish)
                        self.to_publish.clear()
                else:
                    self.to_publish.clear()
                now = time.monotonic()
                if now - last >= TICK_S:
                    last = now
                    assert self.clients is not None
                    self.clients.poll()
                    if self.hints:
                        if self.sync is not None:
                            self.sync.send_hints(self.hints)
                        self.hints = []
                    if self.events is not None:
                        self.events.tick()
                    assert self.pool is not None
                    self.pool.check()
                    if self.agent is not None:
                        self.agent.check()
                    if self.watcher is not None:
                        self._check_membership()
                    full = now - last_full >= 1.0
                    if full:
                        last_full = now
                        self._maybe_checkpoint(now)
                    self._gauges(full)
                if n == 0:
                    assert self.doorbell is not None
                    self.doorbell.wait(TICK_S)
        finally:
            self.shutdown()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop cleanly; SIGHUP re-reads the membership and config now."""
        def _stop(signum: int, frame: Any) -> None:
            self.stop = True

        def _hup(signum: int, frame: Any) -> None:
            if self.watcher is not None:
                self.watcher.poke()
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGHUP, _hup)

    def shutdown(self) -> None:
        """Stop workers, disconnect clients, remove every segment, wake-up, socket and pid file."""
        self.stop = True
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
            self.metrics = None
        if self.clients is not None:
            self.clients.close()
        if self.agent is not None:
            self.agent.stop()
        if self.pool is not None:
            self.pool.stop_all()
        if self.ckpt is not None and self.started:  # the table changes no more: an exact checkpoint
            self.ckpt.join(60.0)
            self.ckpt.write()
            if self.ckpt.last_error:
                self.log.warning("slot-table checkpoint at stop failed", error=self.ckpt.last_error)
            self.ckpt = None
        if self.clients is not None:
            self.clients.drop_all()
        if self.pool is not None:
            self.pool.close()
        else:
            for w in self.workers:
                w.wake.close()
        self.workers = []
        for seg in self._segments:
            seg.close()
            seg.unlink()
        self._segments = []
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None
        for n in self._wakes:
            unlink_wake(n)
        self._wakes = []
        try:
            (self.rundir / f"{self.server}.pid").unlink()
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self.log.info("service stopped")


@contextlib.contextmanager
def _binding(what: str, address: str, server: str) -> Iterator[None]:
    """Turn a failed bind of a listening address into one clear error (not a traceback)."""
    try:
        yield
    except (OSError, zmq.ZMQError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise AddressUnavailable(
            f"server {server}: {what} address {address} cannot be bound: {reason} (another process holds it, "
            "an outgoing connection took it when it lies in net.ipv4.ip_local_port_range, or the host is "
            f"not this machine's); give another with 'mass-ctl kvcache connect STORE --{what} HOST:PORT', or turn "
            f"it off with --{what} ''") from e


def serve(cfg: StoreConfig, server: str, home: Path | None = None) -> None:
    """Run the service in this process until SIGTERM/SIGINT (``mass-ctl kvcache connect``)."""
    sup = Supervisor(cfg, server, home)
    sup.install_signal_handlers()
    sup.start()
    sup.run()
    if sup.refused:  # denied, or its key is gone: a failure to whoever started it (systemd too)
        raise NotAllowed(sup.refused)


__all__ = ["Supervisor", "serve"]
