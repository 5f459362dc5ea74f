"""The servers table: one row per server of the store."""

from __future__ import annotations

from typing import Any

from textual.widgets import DataTable

from ..._units import format_size


def hit_rate(sv: dict[str, Any]) -> float:
    """Hits over gets of keys (0 when nothing was asked)."""
    n = sv["hits"] + sv["misses"]
    return sv["hits"] / n if n else 0.0


class ServersTable(DataTable[str]):
    """Capacity, hit rate, traffic and faults per server."""

    COLUMNS = ("server", "state", "own slots used", "store slots used", "hit rate", "read", "written",
               "clients", "evictions", "faults")

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*self.COLUMNS)

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Replace the rows with this snapshot."""
        self.clear()
        for name, e in snap.items():
            st = e.get("stats")
            if not e["running"] or st is None:
                self.add_row(name, "down" if not e["running"] else "starting", *(["-"] * 8), key=name)
                continue
            sv = st["service"]
            faults = sv["validation_failures"] + sv["io_errors"]
            self.add_row(name, f"up {e['pid']}", f"{sv['own_slots_valid']}/{sv['own_slots']}",
                         f"{sv['slots_valid']}/{sv['slots_total']}", f"{hit_rate(sv):.1%}",
                         format_size(sv["bytes_read"]), format_size(sv["bytes_written"]),
                         str(sv["clients_connected"]), str(sv["evictions"]), str(faults), key=name)
