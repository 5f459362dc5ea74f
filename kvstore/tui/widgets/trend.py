"""Hit rate and bytes per second over time, as sparklines.

Rates are differences between two snapshots divided by the time between them
as the services measured it (their ``heartbeat_ns``), so a late or manual
refresh does not distort them.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

from ..._units import format_size


class Trend(Vertical):
    """Keeps the last ``width`` refreshes of the store-wide hit rate and read/write rates."""

    def __init__(self, width: int = 120, **kw: Any) -> None:
        super().__init__(**kw)
        self.hits: deque[float] = deque([0.0], maxlen=width)
        self.read: deque[float] = deque([0.0], maxlen=width)
        self.written: deque[float] = deque([0.0], maxlen=width)
        self._last: tuple[int, int, int, int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Label("hit rate", id="hits-label")
        yield Sparkline(list(self.hits), id="hits")
        yield Label("read per second", id="read-label")
        yield Sparkline(list(self.read), id="read")
        yield Label("written per second", id="written-label")
        yield Sparkline(list(self.written), id="written")

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Add one point from this snapshot (rates since the previous one)."""
        hits = misses = rb = wb = now_ns = 0
        for e in snap.values():
            if e.get("stats"):
                sv = e["stats"]["service"]
                hits += sv["hits"]
                misses += sv["misses"]
                rb += sv["bytes_read"]
                wb += sv["bytes_written"]
                now_ns = max(now_ns, sv["heartbeat_ns"])
        if self._last is not None:
            h0, m0, r0, w0, t0 = self._last
            dh, dm, dt = hits - h0, misses - m0, (now_ns - t0) / 1e9
            if dt <= 0:
                return  # the services have not moved on since the last point: keep it
            if dh < 0 or dm < 0 or dh + dm == 0:  # nothing asked, or a service restarted (counters reset)
                self.hits.append(self.hits[-1] if self.hits else 0.0)
            else:
                self.hits.append(dh / (dh + dm))
            self.read.append(max(0, rb - r0) / dt)
            self.written.append(max(0, wb - w0) / dt)
        self._last = (hits, misses, rb, wb, now_ns)
        self.query_one("#hits", Sparkline).data = list(self.hits)
        self.query_one("#read", Sparkline).data = list(self.read)
        self.query_one("#written", Sparkline).data = list(self.written)
        self.query_one("#hits-label", Label).update(f"hit rate (now {self.hits[-1]:.0%})")
        self.query_one("#read-label", Label).update(f"read (now {format_size(int(self.read[-1]))}/s)")
        self.query_one("#written-label", Label).update(f"written (now {format_size(int(self.written[-1]))}/s)")
