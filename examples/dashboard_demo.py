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
        sv = ServiceCounters(hits=hits * step, misses=10 * step, bytes_read=hits * step << 20,
                             bytes_written=12 * step << 20, own_slots=4096, own_slots_valid=min(4096, 900 * step),
                             slots_total=8192, slots_valid=min(8192, 1700 * step), clients_connected=3,
                             evictions=40 * step, sync_records_sent=800 * step, sync_records_received=760 * step,
                             sync_records_merged=700 * step, hints_received=55 * step)
        devs = tuple(DeviceCounters(reads=hits * step + d, writes=6 * step, reads_inflight=d, writes_queued=2)
                     for d in range(dev))
        st = StoreStatistics(sv, devs, lat, tuple(lat for _ in range(dev)), tuple(lat for _ in range(dev)))
        return {"running": True, "pid": pid, "stats": dataclasses.asdict(st),
                "tenants": {"": {"slots": 600 * step}, "team-a": {"slots": 300 * step}}}

    return {"gpu01": server(4242, 90, 2), "gpu02": server(4343, 60, 2),
            "gpu03": {"running": False, "pid": None, "stats": None, "tenants": {}}}


def app() -> DashboardApp:
    return DashboardApp(CannedSource("demo", [snapshot(i) for i in range(1, 5)]), interval=1.0)


async def svg(path: Path) -> None:
    a = app()
    async with a.run_test(size=(120, 36)) as pilot:
        for _ in range(3):
            await pilot.press("r")
        a.save_screenshot(str(path.name), str(path.parent))


if __name__ == "__main__":
    if "--svg" in sys.argv:
        asyncio.run(svg(Path(__file__).parents[1] / "docs" / "dashboard.svg"))
    else:
        app().run()
