"""SVG snapshots of the dashboard at 80x24, 120x40 and 160x48 (pytest-textual-snapshot), and a
check that no table cuts a column at those sizes.

The app runs on the canned statistics of examples/dashboard_demo.py with a fixed
clock, so the screen is the same on every machine. After a deliberate change of
the layout, look at the report and update with ``pytest --snapshot-update``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).parents[2] / "examples" / "dashboard_demo.py"


def demo_app() -> Any:
    spec = importlib.util.spec_from_file_location("dashboard_demo", DEMO)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.app(clock="10:41:09")


SIZES = [(80, 24), (120, 40), (160, 48)]
IDS = ["80x24", "120x40", "160x48"]


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_dashboard_snapshot(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(demo_app(), terminal_size=size, press=["r"] * 8)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
async def test_no_table_cuts_a_column(size: tuple[int, int]) -> None:
    from kvstore.tui.widgets.table import SnapshotTable

    app = demo_app()
    async with app.run_test(size=size) as pilot:
        await pilot.press(*["r"] * 8)
        await pilot.pause()
        tables = list(app.query(SnapshotTable))
        assert len(tables) == 3
        for t in tables:
            assert t.row_count > 0
            # every shown column fits: nothing scrolls sideways, nothing is cut at the border
            assert t.virtual_size.width <= t.scrollable_content_region.width, (t.id, size)
            assert [str(c.label) for c in t.columns.values()] == list(t.columns_for(size[0]))
        servers = next(t for t in tables if t.id == "servers")
        wide = size[0] >= 120
        assert ("store slots used" in servers.columns_for(size[0])) == wide


async def test_resizing_shows_the_columns_that_fit() -> None:
    from kvstore.tui.widgets.replication import SyncTable

    app = demo_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        sync = app.query_one(SyncTable)
        assert "tenants" in [str(c.label) for c in sync.columns.values()]
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert "tenants" not in [str(c.label) for c in sync.columns.values()]
        assert sync.virtual_size.width <= sync.scrollable_content_region.width


def test_help_screen_snapshot(snap_compare: Any) -> None:
    assert snap_compare(demo_app(), terminal_size=(80, 24), press=["question_mark"])
