"""``mass-ctl kvcache dashboard STORE``: the whole store at a glance, refreshed every second.

Reads only shared-memory statistics (through a ``StatsSource``), so watching
never slows the data path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Static

from .source import StatsSource, is_up, with_remote
from .widgets.devices import DevicesTable
from .widgets.servers import ServersTable
from .widgets.replication import SyncTable
from .widgets.trend import Trend
from .widgets.warnings import WarningsPanel
from .widgets.table import SnapshotTable

HELP = """kvstore dashboard

  servers   capacity (own slots used / total), hit rate, bytes, faults
  devices   queue depths (in flight + queued) and latency percentiles
  trend     hit rate, bytes read and written per second
  sync      updates exchanged with peers, peer lag (seconds since
            heard / updates behind), hit hints, tenants
  warnings  the newest warnings from the services' logs

  r  refresh now        p  pause / resume
  tab  next table       ?  this help        q  quit
"""


class HelpScreen(ModalScreen[None]):
    """Keys and what the panels show."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")


class DashboardApp(App[None]):
    """Invariant: every panel shows the same snapshot (taken once per refresh)."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "kvstore"
    BINDINGS = [Binding("q", "quit", "quit"), Binding("r", "refresh", "refresh"),
                Binding("p", "pause", "pause"), Binding("question_mark", "help", "help")]

    def __init__(self, source: StatsSource, interval: float = 1.0,
                 clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
        """``clock`` gives the "updated" time shown (fixed in snapshot tests)."""
        super().__init__()
        self.source = source
        self.clock = clock
        self.interval = interval
        self.paused = False
        self.refreshes = 0
        self._last: dict[str, dict[str, Any]] | None = None
        self.sub_title = f"store {source.store}"

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="top"):
            yield ServersTable(id="servers")
        with Horizontal(id="middle"):
            yield DevicesTable(id="devices")
            yield Trend(id="trend")
        yield SyncTable(id="sync")
        yield WarningsPanel("", id="warnings")
        yield Static("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.action_refresh()
        self.set_interval(self.interval, self._tick)

    def on_resize(self) -> None:
        """Show the columns that fit the new width at once: the same snapshot, shown again."""
        self.call_after_refresh(self._reshow)  # after the app has taken the new size

    def _reshow(self) -> None:
        if self._last is not None:
            self._show(self._last)

    def _tick(self) -> None:
        if not self.paused:
            self.action_refresh()

    def action_refresh(self) -> None:
        """Take one snapshot and show it everywhere."""
        self._last = self.source.snapshot()
        self.refreshes += 1
        self._show(self._last)

    def _show(self, snap: dict[str, dict[str, Any]]) -> None:
        snap = with_remote(snap)
        self.query_one(ServersTable).show(snap)
        self.query_one(DevicesTable).show(snap)
        self.query_one(Trend).show(snap)
        self.query_one(SyncTable).show(snap)
        self.query_one(WarningsPanel).show(snap)
        up = sum(1 for e in snap.values() if is_up(e))
        state = "paused" if self.paused else "live"
        hidden = sum(t.hidden for t in self.query(SnapshotTable))
        more = f"  ·  {hidden} columns hidden" if hidden else ""
        self.query_one("#status", Static).update(
            f"{up}/{len(snap)} servers up  ·  {state}  ·  updated {self.clock()}{more}  ·  ? help")

    def action_pause(self) -> None:
        """Stop or resume the periodic refresh."""
        self.paused = not self.paused
        self.action_refresh()

    def action_help(self) -> None:
        """Show the help screen."""
        self.push_screen(HelpScreen())
