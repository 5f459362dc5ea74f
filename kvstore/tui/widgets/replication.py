"""Replication and tenants: what each server exchanged with its peers, how far behind each peer it
is, and tenant usage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .table import SnapshotTable


class SyncTable(SnapshotTable):
    """Per server: updates sent, received, merged, rejected messages, peer lag, hints, tenants.

    Peer lag reads ``NAME AGE/BEHIND``: seconds since that peer was last heard from, and updates
    it announced that this server has not merged yet."""

    COLUMNS = ("server", "sent", "received", "merged", "rejected", "peer lag (s/updates)", "hints", "tenants")
    NARROW = ("server", "received", "merged", "rejected", "peer lag (s/updates)")
    KEYED = True

    def rows_of(self, name: str, e: dict[str, Any]) -> Iterable[tuple[str, ...]]:
        st = e.get("stats")
        if st is None:
            return
        sv = st["service"]
        tenants = ", ".join(f"{t or '(default)'} {u['slots']}" for t, u in sorted(e.get("tenants", {}).items()))
        yield (name, str(sv["sync_records_sent"]), str(sv["sync_records_received"]),
               str(sv["sync_records_merged"]), str(sv["sync_messages_rejected"]),
               peer_lag(e.get("peers", {})), str(sv["hints_received"]), tenants or "-")

def peer_lag(peers: dict[str, dict[str, Any]]) -> str:
    """``b 0.2/0, c never`` : per peer, seconds since heard and updates behind."""
    parts = []
    for p, lag in sorted(peers.items()):
        if lag.get("heard_s") is None:
            parts.append(f"{p} never")
        else:
            parts.append(f"{p} {lag['heard_s']:.1f}/{lag['behind']}")
    return ", ".join(parts) or "-"
