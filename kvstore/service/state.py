"""The store's state on this server: built once from the config, owned by the service.

``StoreState.build`` maps the control segment (slot table, key index, reference bits), the
stats block and the board; fills the slot table from the checkpoint if one is usable, else
from every slot header on the devices (``rebuild.scan_devices``); indexes it; and sets up
the allocator of this server's own area and the lease states of the clients' buffers. The
parts of the service (requests, clients, workers, the sync link, membership) read and change
it; every change of the slot table that others publish goes through ``changes``.

``turn(now)`` writes a checkpoint when one is due (in a thread); ``close`` writes the last one
(exact: nothing changes any more) and removes the segments. The service loop is the only
writer of the slot table and the key index (readers in clients use the index's seqlock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from ..config import StoreConfig
from ..ipc import lease as A
from ..ipc.iorings import REQUEST_RING
from ..shm.board import BOARD_BYTES, Board
from ..shm.control import ControlLayout
from ..shm.index import KeyIndex
from ..shm.slots import EMPTY, VALID, SlotMap, entry_words
from ..shm.stats import StatsBlock, stats_nbytes
from ..storage.superblock import Superblock
from .allocator import Allocator, Generations
from .changes import ChangeFeed
from .checkpoint import CheckpointWriter, checkpoint_path, layout_fingerprint, load_checkpoint
from .rebuild import scan_devices
from .runtime import Runtime

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class StoreState:
    """One store's state as this server sees it (see the module doc)."""

    cfg: StoreConfig
    """The config in force (replaced when the membership changes)."""
    server: str
    area: int
    sbs: tuple[Superblock, ...]
    """The devices' superblocks in force (replaced with ``cfg``)."""
    smap: SlotMap
    layout: ControlLayout
    slots: np.ndarray[Any, Any]
    index: KeyIndex
    alloc: Allocator
    stats: StatsBlock
    board: Board
    arena: A.LeaseStates
    own: list[range]
    """This server's area on each device (gid ranges)."""
    local: np.ndarray[Any, Any]
    """Own slots (bool per gid): preferred when a key has several copies."""
    changes: ChangeFeed = field(default_factory=ChangeFeed)
    ckpt: CheckpointWriter | None = None
    hints: list[int] = field(default_factory=list)
    """Peers' slots read since the last tick (the sync link tells their owners)."""
    keyspace: int = 0
    """Counts the reloads that may have changed tenant salts (key epochs, namespaces): the
    clients part gives its connections the new ones."""
    stopping: bool = False
    refused: str = ""
    """Why the service stopped itself (denied, its key not here): ``serve`` raises it."""
    log: Any = log
    _last_ckpt: float = 0.0

    @classmethod
    def build(cls, cfg: StoreConfig, server: str, area: int, sbs: tuple[Superblock, ...], rt: Runtime,
              home: Any = None) -> StoreState:
        """Map the state's memory through ``rt`` and fill it (checkpoint or scan); ``home``: where
        the checkpoint lives (None: no checkpoint, whatever the config says)."""
        lg = log.bind(store=cfg.name, server=server)
        smap = SlotMap([[a.slot_count for a in sb.areas] for sb in sbs])
        arena_count = cfg.service.max_clients * cfg.service.client_buffers
        if arena_count > REQUEST_RING:
            raise ValueError(f"max_clients x client_buffers must be <= {REQUEST_RING}, got {arena_count}")
        lay = ControlLayout.of(smap.total)
        ctl = rt.segment("control", lay.nbytes, rt.read_mode)
        slots = lay.slot_table(ctl.buf)
        stats = StatsBlock(rt.segment("stats", stats_nbytes(len(cfg.devices)), rt.read_mode).buf,
                           len(cfg.devices), init=True)
        board = Board(rt.segment("board", BOARD_BYTES, rt.read_mode).buf)
        stats.set("started_ns", time.time_ns())
        ckpt = None
        if home is not None and cfg.service.checkpoint_interval_s > 0:
            ckpt = CheckpointWriter(checkpoint_path(home, cfg.name, server), slots, cfg.uuid_bytes,
                                    layout_fingerprint(sbs))
        max_gen = _fill(cfg, sbs, smap, slots, ckpt, lg,
                        "checkpoints are off (service.checkpoint_interval_s = 0)" if home is not None else
                        "no checkpoint for this state")
        for i, sv in enumerate(cfg.servers):  # a denied server's pages are never read
            if sv.denied:
                _clear_area(slots, smap, i)
        # other areas were filled first, so our own copy wins a duplicate key
        index = KeyIndex(lay.index_entries(ctl.buf), slots, init=True, seq=lay.index_seq(ctl.buf))
        index.rebuild()
        own = [smap.area_gids(d, area) for d in range(smap.n_devices)]
        local = np.zeros(smap.total, dtype=bool)
        for r in own:
            local[r.start:r.stop] = True
        changes = ChangeFeed()
        alloc = Allocator(slots, own, [Generations(max_gen[d][area]) for d in range(smap.n_devices)],
                          cfg.service.retire_grace_s, on_retire=changes.retired, ref=lay.ref_bits(ctl.buf))
        return cls(cfg, server, area, tuple(sbs), smap, lay, slots, index, alloc, stats, board,
                   A.LeaseStates(cfg.service.client_buffers, cfg.service.max_clients), own, local,
                   changes=changes, ckpt=ckpt, log=lg, _last_ckpt=time.monotonic())

    # ---- what the parts ask ----------------------------------------------------------------------
    def digests(self, gids: Any) -> list[bytes]:
        """The salted key digests the slots hold (what KV events and peers name pages by)."""
        return [bytes(x) for x in entry_words(self.slots[np.asarray(gids, dtype=np.int64)])]

    def own_device(self, gid: int) -> int | None:
        """The device of ``gid`` if it is in this server's area, else None."""
        d, a, _s = self.smap.locate(gid)
        return d if a == self.area else None

    def forget_area(self, area: int) -> int:
        """Drop every page of ``area`` from this server's view (its server was denied).

        Slots go back to EMPTY, generation 0: the index stops finding them at once, and if the
        server is allowed again its own snapshot tells us what it holds. Reads already in
        flight still validate the header against what they expected."""
        n = 0
        for d in range(self.smap.n_devices):
            r = self.smap.area_gids(d, area)
            valid = np.nonzero(self.slots["state"][r.start:r.stop] == VALID)[0] + r.start
            self.changes.forgotten(valid)
            n += len(valid)
        _clear_area(self.slots, self.smap, area)
        return n

    def give_up(self, why: str) -> None:
        """Stop: this machine may no longer serve as this server (``serve`` raises ``why``)."""
        self.log.error("this machine may no longer serve as this server; stopping", reason=why)
        self.refused = why
        self.stopping = True

    # ---- the state's own turn --------------------------------------------------------------------
    def turn(self, now: float) -> None:
        """Start a background checkpoint when one is due (never waits for one)."""
        iv = self.cfg.service.checkpoint_interval_s
        if self.ckpt is None or iv <= 0 or now - self._last_ckpt < iv:
            return
        if self.ckpt.last_error:
            self.log.warning("slot-table checkpoint failed", error=self.ckpt.last_error)
            self.ckpt.last_error = ""
        if self.ckpt.start():
            self._last_ckpt = now

    def close(self, checkpoint: bool) -> None:
        """Write the last checkpoint if ``checkpoint`` (the table changes no more: it is exact)."""
        if self.ckpt is not None and checkpoint:
            self.ckpt.join(60.0)
            self.ckpt.write()
            if self.ckpt.last_error:
                self.log.warning("slot-table checkpoint at stop failed", error=self.ckpt.last_error)
        self.ckpt = None


def _fill(cfg: StoreConfig, sbs: tuple[Superblock, ...], smap: SlotMap, slots: np.ndarray[Any, Any],
          ckpt: CheckpointWriter | None, lg: Any, no_ckpt: str) -> Any:
    """Fill the slot table from the checkpoint if there is a usable one, else from every slot
    header on the devices; returns the highest generation per (device, area)."""
    if ckpt is not None:
        loaded, why = load_checkpoint(ckpt.path, slots, cfg.uuid_bytes, ckpt.layout, smap)
    else:
        loaded, why = None, no_ckpt
    if loaded is not None:
        lg.info("slot table loaded from checkpoint", valid=loaded.valid, age_s=round(loaded.age_s, 1),
                seconds=round(loaded.seconds, 3))
        return loaded.max_gen
    lg.info("no usable checkpoint: reading every slot header", reason=why)
    rep = scan_devices(cfg.devices, sbs, smap, slots)
    lg.info("rebuilt location table from slot headers", scanned=rep.scanned, valid=rep.valid,
            seconds=round(rep.seconds, 3))
    return rep.max_gen


def _clear_area(slots: np.ndarray[Any, Any], smap: SlotMap, area: int) -> None:
    for d in range(smap.n_devices):
        r = smap.area_gids(d, area)
        part = slots[r.start:r.stop]
        part["state"] = EMPTY
        part["gen"] = 0


__all__ = ["StoreState"]
