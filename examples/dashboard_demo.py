"""The dashboard on canned statistics (no service needed); also writes docs/dashboard.svg.

    python examples/dashboard_demo.py            # interactive (q quits)
    python examples/dashboard_demo.py --svg      # write the screenshot used in the README
"""

import asyncio
import dataclasses
import sys
from pathlib import Path

from kvstore.shm.stats import DeviceCounters, Histogram, ServiceCounters, StoreStatistics
from kvstore.tui.app import DashboardApp
from kvstore.tui.source import CannedSource


def snapshot(step: int) -> dict:
    def server(pid: int, hits: int, dev: int) -> dict:
        lat = Histogram(tuple([0] * 8 + [20 + step, 40, 5] + [0] * 21))
        # uneven traffic (so the sparklines move), counters only ever grow
        h = sum(hits * (3 + i * i % 7) // 4 for i in range(1, step + 1))
        m = sum(10 + 4 * (i * i % 5) for i in range(1, step + 1))
        w = sum(12 + 3 * (i * i % 7) for i in range(1, step + 1))
        sv = ServiceCounters(hits=h, misses=m, bytes_read=h << 20, bytes_written=w << 20,
                             heartbeat_ns=1_800_000_000_000_000_000 + 2 * step * 10**9,  # every 2 s
                             own_slots=4096, own_slots_valid=2400 + 60 * step + pid % 7 * 40,
                             slots_total=8192, slots_valid=5000 + 120 * step, clients_connected=3,
                             evictions=40 * step, sync_records_sent=800 * step, sync_records_received=760 * step,
                             sync_records_merged=700 * step, hints_received=55 * step)
        devs = tuple(DeviceCounters(reads=hits * step + d, writes=6 * step, reads_inflight=d, writes_queued=2,
                                    own_slots=2048, own_slots_valid=1200 + 30 * step + 20 * pid % 7 * 10 + 50 * d)
                     for d in range(dev))
        st = StoreStatistics(sv, devs, lat, tuple(lat for _ in range(dev)), tuple(lat for _ in range(dev)))
        peer = "gpu02" if pid == 4242 else "gpu01"
        return {"running": True, "pid": pid, "stats": dataclasses.asdict(st),
                "tenants": {"": {"slots": 600 * step}, "team-a": {"slots": 300 * step}},
                "peers": {peer: {"heard_s": 0.2, "behind": 3 * (step % 2), "catching_up": False},
                          "gpu03": {"heard_s": None, "behind": 0, "catching_up": False}},
                "warnings": [{"timestamp": "2026-12-02T10:41:07.120Z", "level": "warning",
                              "event": "page failed validation; location dropped", "gid": 1812,
                              "reason": "checksum"}] if pid == 4343 else []}

    return {"gpu01": server(4242, 90, 2), "gpu02": server(4343, 60, 2),
            "gpu03": {"running": False, "pid": None, "stats": None, "tenants": {}, "peers": {}, "warnings": []}}


def app(clock: str | None = None) -> DashboardApp:
    """The demo app; ``clock`` fixes the time shown (for screenshots and snapshot tests)."""
    if clock is None:
        return DashboardApp(CannedSource("demo", [snapshot(i) for i in range(1, 16)]), interval=1.0)
    return DashboardApp(CannedSource("demo", [snapshot(i) for i in range(1, 16)]), interval=3600,
                        clock=lambda: clock)


async def svg(path: Path) -> None:
    a = app(clock="10:41:09")
    async with a.run_test(size=(120, 36)) as pilot:
        for _ in range(12):
            await pilot.press("r")
        a.save_screenshot(str(path.name), str(path.parent))


if __name__ == "__main__":
    if "--svg" in sys.argv:
        asyncio.run(svg(Path(__file__).parents[1] / "docs" / "dashboard.svg"))
    else:
        app().run()
