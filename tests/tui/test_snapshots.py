"""SVG snapshots of the dashboard at 80x24 and 160x48 (pytest-textual-snapshot).

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


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_dashboard_snapshot(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(demo_app(), terminal_size=size, press=["r"] * 8)


def test_help_screen_snapshot(snap_compare: Any) -> None:
    assert snap_compare(demo_app(), terminal_size=(80, 24), press=["question_mark"])
