"""Hit rate and bytes per second over time, as sparklines."""

from __future__ import annotations

from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline


class Trend(Vertical):
    """Keeps the last ``width`` refreshes of the store-wide hit rate and read/write rates."""

    def __init__(self, width: int = 120, **kw: Any) -> None:
        super().__init__(**kw)
        self.hits: deque[float] = deque([0.0], maxlen=width)
        self.read: deque[float] = deque([0.0], maxlen=width)
        self.written: deque[float] = deque([0.0], maxlen=width)
        self._last: tuple[int, int, int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Label("hit rate", id="hits-label")
        yield Sparkline(list(self.hits), id="hits")
        yield Label("read / written per refresh", id="bytes-label")
        yield Sparkline(list(self.read), id="read")
        yield Sparkline(list(self.written), id="written")

    def show(self, snap: dict[str, dict[str, Any]]) -> None:
        """Add one point from this snapshot (differences since the previous one)."""
        hits = misses = rb = wb = 0
        for e in snap.values():
            if e.get("stats"):
                sv = e["stats"]["service"]
                hits += sv["hits"]
                misses += sv["misses"]
                rb += sv["bytes_read"]
                wb += sv["bytes_written"]
        if self._last is not None:
            h0, m0, r0, w0 = self._last
            dh, dm = hits - h0, misses - m0
            self.hits.append(dh / (dh + dm) if dh + dm else (self.hits[-1] if self.hits else 0.0))
            self.read.append(float(max(0, rb - r0)))
            self.written.append(float(max(0, wb - w0)))
        self._last = (hits, misses, rb, wb)
        self.query_one("#hits", Sparkline).data = list(self.hits)
        self.query_one("#read", Sparkline).data = list(self.read)
        self.query_one("#written", Sparkline).data = list(self.written)
        self.query_one("#hits-label", Label).update(f"hit rate (now {self.hits[-1]:.0%})")
