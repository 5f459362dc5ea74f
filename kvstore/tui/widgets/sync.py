"""Replication and tenants: what each server exchanged with its peers, and tenant usage."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable


class SyncTable(DataTable[str]):
    """Per server: updates sent, received, merged, rejected messages, requests, hints, tenants."""

    COLUMNS = ("server", "sent", "received", "merged", "rejected", "requests", "hints", "tenants")

    def on_mount(self) -> None:
        self.add_columns(*self.COLUMNS)

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Replace the rows with this snapshot."""
        self.clear()
        for name, e in snap.items():
            st = e.get("stats")
            if st is None:
                continue
            sv = st["service"]
            tenants = ", ".join(f"{t or '(default)'} {u['slots']}" for t, u in sorted(e.get("tenants", {}).items()))
            self.add_row(name, str(sv["sync_records_sent"]), str(sv["sync_records_received"]),
                         str(sv["sync_records_merged"]), str(sv["sync_messages_rejected"]),
                         str(sv["sync_requests_sent"]), str(sv["hints_received"]), tenants or "-")
