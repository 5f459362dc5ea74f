"""The servers table: one row per server of the store."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..._units import format_size
from ..source import state_of
from .table import SnapshotTable


def hit_rate(sv: dict[str, Any]) -> float:
    """Hits over gets of keys (0 when nothing was asked)."""
    n = sv["hits"] + sv["misses"]
    return sv["hits"] / n if n else 0.0


class ServersTable(SnapshotTable):
    """Capacity, hit rate, traffic and faults per server."""

    COLUMNS = ("server", "state", "own slots used", "store slots used", "hit rate", "read", "written",
               "clients", "evictions", "faults")
    NARROW = ("server", "state", "own slots used", "hit rate", "read", "written", "faults")
    KEYED = True

    def on_mount(self) -> None:  # Textual also runs SnapshotTable.on_mount (handlers run up the MRO)
        self.cursor_type = "row"

    def rows_of(self, name: str, e: dict[str, Any]) -> Iterable[tuple[str, ...]]:
        st = e.get("stats")
        if not e["running"] or st is None:
            yield (name, state_of(e), *(["-"] * 8))
            return
        sv = st["service"]
        faults = sv["validation_failures"] + sv["io_errors"]
        yield (name, f"up {e['pid']}", f"{sv['own_slots_valid']}/{sv['own_slots']}",
               f"{sv['slots_valid']}/{sv['slots_total']}", f"{hit_rate(sv):.1%}",
               format_size(sv["bytes_read"]), format_size(sv["bytes_written"]),
               str(sv["clients_connected"]), str(sv["evictions"]), str(faults))
