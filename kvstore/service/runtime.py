"""The names, modes and wake-ups of one service run, and the memory it creates.

Every shared object of a run is named from one prefix (``shm.segment.name_prefix``): the
control segment, stats, board, each worker's rings and wake-up, each client's segment and
wake-up, the sync rings. ``Runtime`` is the one place those names and their modes are
decided, and the one source of what clients and workers are told: the hello's fields
(``hello``) and a worker's parameters (``worker_params``) both come from it, so they cannot
disagree.

It also creates the run's memory and remembers it: ``close`` removes every segment and
wake-up the run made. ``anonymous=True`` gives anonymous mappings instead of named segments
(for the service's in-process unit tests: nothing under /dev/shm, nothing to leak).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import StoreConfig, run_dir
import zmq

from ..errors import AddressUnavailable, KVStoreError
from ..ioworkers.worker import WorkerParams
from ..shm.segment import Segment, name_prefix
from ..shm.wake import WakeReader, client_wake_prefix, doorbell_name, unlink_wake, worker_wake_name

if TYPE_CHECKING:
    from .state import StoreState

FD_MARGIN = 256
"""Open files a service needs besides its connections' (``raise_fd_limit``)."""


@dataclass
class Runtime:
    """One run of store ``store``'s service as ``server`` (see the module doc)."""

    store: str
    server: str
    home: Path
    group: int | None = None
    """The access group (``service.access_group``): its members may connect."""
    anonymous: bool = False
    segments: list[Segment] = field(default_factory=list)
    wakes: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: StoreConfig, server: str, home: Path) -> Runtime:
        """The run of ``cfg``'s service as ``server`` (resolves the access group)."""
        group = None
        if cfg.service.access_group:
            import grp

            try:
                group = grp.getgrnam(cfg.service.access_group).gr_gid
            except KeyError:
                raise ValueError(f"service.access_group {cfg.service.access_group!r} is not a group here") from None
        return cls(cfg.name, server, home, group)

    # ---- names -------------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return name_prefix(self.home, self.store, self.server)

    @property
    def rundir(self) -> Path:
        return run_dir(self.store, self.home)

    @property
    def sock_path(self) -> Path:
        return self.rundir / f"{self.server}.sock"

    def name(self, what: str) -> str:
        """The shm name of this run's segment ``what`` (``control``, ``stats``, ``sync``, ...)."""
        return self.prefix + what

    @property
    def doorbell(self) -> str:
        return doorbell_name(self.prefix)

    def worker_wake(self, device: int) -> str:
        return worker_wake_name(self.prefix, device)

    def client_wake(self, cid: int) -> str:
        """The wake-up of client connection ``cid`` (the workers' ``wake_prefix`` + cid)."""
        return client_wake_prefix(self.prefix) + str(cid)

    # ---- modes: who may map what (docs/SECURITY.md "Who maps what") ---------------------------
    @property
    def mode(self) -> int:
        """What clients write (their connections, the socket, wake-ups they post)."""
        return 0o660 if self.group is not None else 0o600

    @property
    def read_mode(self) -> int:
        """What clients only read (the lookup tables, statistics): never group-writable."""
        return 0o640 if self.group is not None else 0o600

    # ---- memory --------------------------------------------------------------------------------
    def segment(self, what: str, size: int, mode: int | None = None) -> Segment:
        """A segment of this run: ``mode`` 0o600 for the service's own (no group), ``read_mode``
        for what clients read, the default (``mode``) for what clients write."""
        mode = self.mode if mode is None else mode
        if self.anonymous:
            seg = Segment.__new__(Segment)
            seg.name, seg.size, seg.owner = self.name(what), size, False
            seg.buf = mmap.mmap(-1, size)
        else:
            seg = Segment.create(self.name(what), size, mode, self.group if mode & 0o070 else None)
        self.segments.append(seg)
        return seg

    def wake(self, name: str) -> WakeReader:
        """A consumer's wake-up (shm/wake.py): group members may post, never wait."""
        self.wakes.append(name)
        return WakeReader.create(name, 0o620 if self.group is not None else 0o600, self.group)

    def close(self) -> None:
        """Remove every segment and wake-up this run created."""
        for seg in self.segments:
            seg.close()
            if not self.anonymous:
                seg.unlink()
        self.segments = []
        for n in self.wakes:
            unlink_wake(n)
        self.wakes = []

    # ---- what clients and workers are told ------------------------------------------------------
    def hello(self, st: StoreState, worker_wakes: list[str]) -> dict[str, Any]:
        """The fields every accepted hello carries (``Clients`` adds the connection's own)."""
        cfg = st.cfg
        return {"page_size": cfg.page_size, "control": self.name("control"), "doorbell": self.doorbell,
                "service_pid": os.getpid(), "store": cfg.name, "server": self.server,
                "stats": self.name("stats"), "slots": st.smap.total, "max_clients": cfg.service.max_clients,
                "workers": list(worker_wakes), "areas": [list(c) for c in st.smap.counts]}

    def worker_params(self, st: StoreState, device: int, path: str) -> WorkerParams:
        """What the worker of ``device`` is started with (each time: the config may have changed)."""
        cfg = st.cfg
        sb = st.sbs[device]
        return WorkerParams(
            device_path=path, device_index=device, store_uuid=cfg.uuid_bytes, page_size=cfg.page_size,
            control_name=self.name("control"), lease_buffers=cfg.service.client_buffers,
            worker_segment=self.name(f"w{device}"),
            stats_name=self.name("stats"), doorbell=self.doorbell, wakeup=self.worker_wake(device),
            read_depth=cfg.worker.read_queue_depth, max_inflight_writes=cfg.worker.max_inflight_writes,
            store=cfg.name, server=self.server,
            max_clients=cfg.service.max_clients, conn_prefix=self.name("c"),
            wake_prefix=client_wake_prefix(self.prefix), n_devices=st.smap.n_devices,
            slot_size=sb.slot_size, area_offsets=tuple(a.offset for a in sb.areas),
            area_slots=tuple(a.slot_count for a in sb.areas),
            own_area=st.area, area_gids=tuple(st.smap.bases[device]), ref_offset=st.layout.ref_offset)


def raise_fd_limit(max_clients: int) -> None:
    """Raise the soft limit on open files to what ``max_clients`` needs (the workers inherit it).

    Each connection holds three descriptors in the supervisor (its socket, its wake-up's write
    end, and the one Python's mmap keeps of its segment) and two in each worker (the mapping's
    and the wake-up's); handshakes, devices, logs and ZeroMQ take the rest of a fixed margin.
    A hard limit below that is a clear start-up error, not EMFILE at some later client."""
    need = 3 * max_clients + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise KVStoreError(f"service.max_clients = {max_clients} needs {need} open files, but this process may "
                           f"open at most {hard} (ulimit -Hn; LimitNOFILE= under systemd): raise it or lower "
                           f"max_clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@contextlib.contextmanager
def binding(what: str, address: str, server: str) -> Iterator[None]:
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


__all__ = ["FD_MARGIN", "Runtime", "binding", "raise_fd_limit"]
