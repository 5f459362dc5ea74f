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
    a dict> | None, "tenants": {...}, "peers": {name: {"heard_s", "behind", "catching_up"}}, "warnings":
    [...]}`` (the shape of ``mass-ctl kvcache status --json``)."""

    store: str

    def snapshot(self) -> dict[str, dict[str, Any]]: ...


def read_service(home: Path, store: str, server: str) -> dict[str, Any]:
    """One server's entry: pid, statistics, tenants, peers' sync lag and recent warnings."""
    pidf = run_dir(store, home) / f"{server}.pid"
    try:
        pid = int(pidf.read_text())
    except (FileNotFoundError, ValueError):
        pid = 0
    entry: dict[str, Any] = {"running": bool(pid and pid_alive(pid)), "pid": pid or None,
                             "stats": None, "tenants": {}, "peers": {}, "warnings": []}
    if not entry["running"]:
        return entry
    prefix = name_prefix(home, store, server)
    try:
        seg = Segment.attach(prefix + "stats")
        entry["stats"] = dataclasses.asdict(StatsBlock.attach(seg.buf).snapshot())
        seg.close()
        seg = Segment.attach(prefix + "board")
        board = Board(seg.buf).read() or {}
        seg.close()
        entry["tenants"] = board.get("tenants", {})
        warnings = list(board.get("warnings", []))
    except Exception:  # a service starting or stopping: shown as running without stats
        return entry
    try:  # the sync agent's board: only in a store of several servers
        seg = Segment.attach(prefix + "peers")
        peers = Board(seg.buf).read() or {}
        seg.close()
        entry["peers"] = peers.get("peers", {})
        warnings += peers.get("warnings", [])
    except Exception:
        pass
    entry["warnings"] = sorted(warnings, key=lambda w: str(w.get("timestamp", "")))[-10:]
    return entry


HEARD_RECENTLY_S = 10.0
"""A server not running here counts as up while a local service heard it within this long."""


def with_remote(snap: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``snap`` with a ``remote`` entry for each server not running on this machine: how the
    local services' sync agents last heard it (``heard_s``, ``behind``, ``by`` which local
    server; the most recent), or ``None`` when none did. A server on another machine is
    seen through its peers, not this machine's process table."""
    out = {}
    for name, e in snap.items():
        e = dict(e)
        if not e.get("running"):
            best: dict[str, Any] | None = None
            for other, o in snap.items():
                lag = (o.get("peers") or {}).get(name) if o.get("running") else None
                if lag and lag.get("heard_s") is not None and (best is None or lag["heard_s"] < best["heard_s"]):
                    best = {"heard_s": lag["heard_s"], "behind": lag.get("behind", 0), "by": other}
            e["remote"] = best
        out[name] = e
    return out


def is_up(e: dict[str, Any]) -> bool:
    """Running here, or heard by a local service within ``HEARD_RECENTLY_S``."""
    r = e.get("remote")
    return bool(e.get("running")) or bool(r and r["heard_s"] <= HEARD_RECENTLY_S)


def state_of(e: dict[str, Any]) -> str:
    """One word or phrase for a server's state, as the dashboard and status print it."""
    if e.get("running"):
        return f"up {e['pid']}" if e.get("stats") is not None else "starting"
    if e.get("denied"):
        return "denied"
    r = e.get("remote")
    if r:
        return f"elsewhere, heard {r['heard_s']:.1f} s" if r["heard_s"] <= HEARD_RECENTLY_S else \
            f"elsewhere, silent {r['heard_s']:.0f} s"
    return "down"


class LiveSource:
    """Reads the stats block and notice boards of every service of the store running on this machine."""

    def __init__(self, store: str, home: Path | None = None) -> None:
        self.home = home or mass_home()
        self.cfg = load_store(store, self.home)
        self.store = store

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {s.name: {**read_service(self.home, self.store, s.name), "denied": s.denied} for s in self.cfg.servers}


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
