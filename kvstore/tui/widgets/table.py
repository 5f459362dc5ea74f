"""The shape every dashboard table shares: fixed columns, rows rebuilt from each snapshot."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.widgets import DataTable


#: Terminal widths from which a table shows more of its columns: below 120 the ``NARROW`` set,
#: from 120 the ``MEDIUM`` set, from 160 all of ``COLUMNS``. Each set is chosen to fit its
#: narrowest width without cutting a column (tests/tui checks this at 80, 120 and 160).
MEDIUM_WIDTH, WIDE_WIDTH = 120, 160


class SnapshotTable(DataTable[str]):
    """Subclasses name ``COLUMNS`` and turn one server's entry into rows (``rows_of``, one value
    per column of ``COLUMNS``); ``NARROW`` and ``MEDIUM`` name the columns shown on narrower
    terminals (empty: all)."""

    COLUMNS: tuple[str, ...] = ()
    NARROW: tuple[str, ...] = ()
    MEDIUM: tuple[str, ...] = ()
    KEYED = False
    """Rows keyed by server name (one row per server), so tests and callers can ``get_row(name)``."""

    _shown: tuple[str, ...] = ()

    def columns_for(self, width: int) -> tuple[str, ...]:
        """The columns shown on a terminal ``width`` cells wide, in ``COLUMNS`` order."""
        if width >= WIDE_WIDTH:
            return self.COLUMNS
        if width >= MEDIUM_WIDTH:
            return self.MEDIUM or self.COLUMNS
        return self.NARROW or self.MEDIUM or self.COLUMNS

    @property
    def hidden(self) -> int:
        """Columns this terminal's width leaves out (the status line says so)."""
        return len(self.COLUMNS) - len(self._shown) if self._shown else 0

    def on_mount(self) -> None:
        self._shown = self.columns_for(self.app.size.width)
        self._add_columns()

    def _add_columns(self) -> None:
        for c in self._shown:  # keyed by label: get_cell(server, "hit rate") whatever is shown
            self.add_column(c, key=c)

    def rows_of(self, name: str, entry: dict[str, Any]) -> Iterable[tuple[str, ...]]:
        """The rows of server ``name`` (its snapshot ``entry``)."""
        raise NotImplementedError

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Replace the rows with this snapshot (and the columns, if the terminal was resized)."""
        shown = self.columns_for(self.app.size.width)
        if shown != self._shown:
            self.clear(columns=True)
            self._shown = shown
            self._add_columns()
        else:
            self.clear()
        self.border_subtitle = f"+{self.hidden} columns at a wider terminal" if self.hidden else ""
        pick = [self.COLUMNS.index(c) for c in shown]
        for name, e in snap.items():
            for row in self.rows_of(name, e):
                self.add_row(*(row[i] for i in pick), key=name if self.KEYED else None)
