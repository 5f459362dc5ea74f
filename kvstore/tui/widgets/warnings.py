"""Recent warnings from the services' structured logs (published on their notice boards)."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static


def format_warning(server: str, w: dict[str, Any]) -> str:
    """One line: time, server, level, event and the other fields."""
    extra = ", ".join(f"{k}={v}" for k, v in w.items()
                      if k not in ("event", "level", "timestamp", "store", "server"))
    t = str(w.get("timestamp", ""))[11:19]
    return f"{t} {server} {w.get('level', 'warning')}: {w.get('event')}" + (f" ({extra})" if extra else "")


class WarningsPanel(Static):
    """The newest warnings of all servers, newest last (as many as fit)."""

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Replace the lines with this snapshot's warnings."""
        rows = sorted(((str(w.get("timestamp", "")), name, w) for name, e in snap.items()
                       for w in e.get("warnings", [])), key=lambda r: r[0])
        lines = [format_warning(name, w) for _, name, w in rows[-3:]]
        self.update("\n".join(lines) if lines else "no warnings")
