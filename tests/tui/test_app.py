"""The dashboard driven like a user: keys pressed, screens switched, values checked against the stats."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Label

from kvstore import KVCacheClient
from kvstore.shm.stats import DeviceCounters, Histogram, ServiceCounters, StoreStatistics
from kvstore.testing import make_store, wait_for
from kvstore.tui.app import DashboardApp, HelpScreen
from kvstore.tui.source import CannedSource, LiveSource
from kvstore.tui.widgets.servers import ServersTable
from kvstore.tui.widgets.replication import SyncTable
from kvstore.tui.widgets.warnings import WarningsPanel


def stats(hits: int, misses: int, read: int) -> dict[str, Any]:
    h = Histogram(tuple([0] * 8 + [10] + [0] * 23))
    s = StoreStatistics(ServiceCounters(hits=hits, misses=misses, bytes_read=read, own_slots=100, own_slots_valid=40,
                                        slots_total=200, slots_valid=90, clients_connected=2, evictions=7,
                                        heartbeat_ns=hits * 10**9),
                        (DeviceCounters(reads=5, writes=3),), h, (h,), (h,))
    return dataclasses.asdict(s)


WARN = {"timestamp": "2026-12-02T10:00:01Z", "level": "warning", "event": "I/O worker lost; restarting",
        "device": 1}


def canned() -> CannedSource:
    snaps = [{"a": {"running": True, "pid": 11, "stats": stats(h, 10, h << 20), "tenants": {"": {"slots": 40}},
                    "peers": {"b": {"heard_s": 1.25, "behind": 7, "catching_up": True}}, "warnings": [WARN]},
              "b": {"running": False, "pid": None, "stats": None, "tenants": {}, "peers": {}, "warnings": []}}
             for h in (10, 30, 90)]
    return CannedSource("demo", snaps)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_keys_screens_and_values(size: tuple[int, int]) -> None:
    app = DashboardApp(canned(), interval=60)
    async with app.run_test(size=size) as pilot:
        table = app.query_one(ServersTable)
        assert table.row_count == 2
        assert [table.get_cell("a", c) for c in ("state", "own slots used", "hit rate")] == ["up 11", "40/100",
                                                                                            "50.0%"]
        # b runs on another machine: seen through a's sync agent, never "down" while a hears it
        assert table.get_cell("b", "state") == "elsewhere, heard 1.2 s"
        await pilot.press("r")
        assert app.query_one(ServersTable).get_cell("a", "hit rate") == "75.0%"  # 30 hits, 10 misses
        # 20 MiB more read over 20 s more of the service's clock
        assert str(app.query_one("#read-label", Label).render()) == "read (now 1.0 MiB/s)"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("p")
        assert app.paused
        status = str(app.query_one("#status").render())
        assert "2/2 servers up" in status and "paused" in status
        # a terminal too narrow for every column says so
        assert ("columns hidden" in status) == (size[0] < 160)
        assert app.query_one(SyncTable).get_cell("a", "peer lag (s/updates)") == "b 1.2/7"
        assert str(app.query_one(WarningsPanel).render()) == \
            "10:00:01 a warning: I/O worker lost; restarting (device=1)"
        await pilot.press("q")
    assert app.return_code == 0


async def test_live_source_shows_what_the_service_holds(home: Path, file_devices: Any, services: Any) -> None:
    ps = 16 << 10
    (dev,) = file_devices.make(1, (1 << 20) + 64 * (4096 + ps))
    make_store(home, "d", [dev], ps)
    svc = services(home, "d")
    with KVCacheClient.connect("d", home=home) as c:
        c.put([b"a", b"b"], [bytes(ps), bytes(ps)], wait=True)
        with c.get([b"a", b"zz"]) as v:
            assert v.hits == 1
    src = LiveSource("d", home)
    # the hit is reported by the device worker, the miss by the client: both reach the stats at a tick
    assert wait_for(lambda: src.snapshot()["local"]["stats"]["service"]["misses"] == 1)
    snap = src.snapshot()
    assert snap["local"]["running"] and snap["local"]["pid"] == svc.pid
    assert snap["local"]["stats"]["service"]["hits"] == 1
    app = DashboardApp(src, interval=60)
    async with app.run_test(size=(80, 24)):
        t = app.query_one(ServersTable)
        assert t.get_cell("local", "hit rate") == "50.0%" and t.get_cell("local", "written") == "32.0 KiB"


async def test_live_peers_lag_and_warnings(home: Path, file_devices: Any, services: Any) -> None:
    import socket

    from kvstore.testing import free_port_pair, wait_for

    ps = 16 << 10
    devs = file_devices.make(1, (1 << 20) + 2 * 64 * (4096 + ps))
    make_store(home, "d", devs, ps, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
    sa = services(home, "d", "a")
    services(home, "d", "b")
    with socket.socket(socket.AF_UNIX) as s:  # a client that says nonsense: the service logs a warning
        s.connect(str(sa.sock))
        s.sendall(b"not a hello" * 10)
    src = LiveSource("d", home)
    assert wait_for(lambda: src.snapshot()["a"]["peers"].get("b", {}).get("heard_s") is not None)
    assert wait_for(lambda: any(w["event"] == "client handshake dropped" for w in src.snapshot()["a"]["warnings"]))
    snap = src.snapshot()
    w = next(w for w in snap["a"]["warnings"] if w["event"] == "client handshake dropped")
    assert w["store"] == "d" and w["server"] == "a" and w["level"] == "warning"
    assert snap["a"]["peers"]["b"]["heard_s"] < 5 and snap["a"]["peers"]["b"]["behind"] == 0
    app = DashboardApp(src, interval=60)
    async with app.run_test(size=(160, 48)):
        assert app.query_one(SyncTable).get_cell("a", "peer lag (s/updates)").startswith("b ")
        assert "client handshake dropped" in str(app.query_one(WarningsPanel).render())
    # every line of the service's log names its store and server, workers' and agent's too
    lines = [json.loads(x) for x in sa.log.read_text().splitlines() if x.startswith("{")]
    assert {x.get("component") for x in lines} >= {"supervisor", "sync", "io0"}
    assert all(x["store"] == "d" and x["server"] == "a" for x in lines)
