"""The shape every dashboard table shares: fixed columns, rows rebuilt from each snapshot."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.widgets import DataTable


class SnapshotTable(DataTable[str]):
    """Subclasses name ``COLUMNS`` and turn one server's entry into rows (``rows_of``)."""

    COLUMNS: tuple[str, ...] = ()
    KEYED = False
    """Rows keyed by server name (one row per server), so tests and callers can ``get_row(name)``."""

    def on_mount(self) -> None:
        self.add_columns(*self.COLUMNS)

    def rows_of(self, name: str, entry: dict[str, Any]) -> Iterable[tuple[str, ...]]:
        """The rows of server ``name`` (its snapshot ``entry``)."""
        raise NotImplementedError

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Replace the rows with this snapshot."""
        self.clear()
        for name, e in snap.items():
            for row in self.rows_of(name, e):
                self.add_row(*row, key=name if self.KEYED else None)
