"""Where the dashboard's numbers come from: a protocol, the live source and a canned one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from ..config import load_store, mass_home, run_dir
from ..shm.board import Board
from ..shm.segment import Segment, name_prefix, pid_alive
from ..shm.stats import StatsBlock


class StatsSource(Protocol):
    """Returns, per server of the store, ``{"running": bool, "pid": int | None, "stats": <StoreStatistics as
    a dict> | None, "tenants": {...}}`` (the shape of ``mass-ctl kvcache status --json``)."""

    store: str

    def snapshot(self) -> dict[str, dict[str, Any]]: ...


class LiveSource:
    """Reads the stats block and notice board of every service of the store running on this machine."""

    def __init__(self, store: str, home: Path | None = None) -> None:
        self.home = home or mass_home()
        self.cfg = load_store(store, self.home)
        self.store = store

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for s in self.cfg.servers:
            pidf = run_dir(self.store, self.home) / f"{s.name}.pid"
            try:
                pid = int(pidf.read_text())
            except (FileNotFoundError, ValueError):
                pid = 0
            entry: dict[str, Any] = {"running": bool(pid and pid_alive(pid)), "pid": pid or None,
                                     "stats": None, "tenants": {}}
            if entry["running"]:
                prefix = name_prefix(self.home, self.store, s.name)
                try:
                    seg = Segment.attach(prefix + "stats")
                    entry["stats"] = dataclasses.asdict(StatsBlock.attach(seg.buf).snapshot())
                    seg.close()
                    board = Segment.attach(prefix + "board")
                    entry["tenants"] = (Board(board.buf).read() or {}).get("tenants", {})
                    board.close()
                except Exception:  # a service starting or stopping: shown as running without stats
                    pass
            out[s.name] = entry
        return out


class CannedSource:
    """A scripted sequence of snapshots (the last one repeats): for tests and the demo."""

    def __init__(self, store: str, snapshots: list[dict[str, dict[str, Any]]]) -> None:
        self.store = store
        self.snapshots = snapshots
        self.i = 0

    def snapshot(self) -> dict[str, dict[str, Any]]:
        s = self.snapshots[min(self.i, len(self.snapshots) - 1)]
        self.i += 1
        return s
