"""The devices table: queues and latency percentiles per server and device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...shm.stats import Histogram
from .table import SnapshotTable


def pct(h: dict[str, Any], q: float) -> str:
    """A percentile of a histogram record, as text."""
    v = Histogram(tuple(h["buckets"])).percentile(q)
    return "-" if v == 0 else (f"{v * 1e3:.1f}ms" if v >= 1e-3 else f"{v * 1e6:.0f}us")


class DevicesTable(SnapshotTable):
    """Area use, reads, writes, queue depths and latency per device of each running server."""

    COLUMNS = ("server", "dev", "area used", "reads", "writes", "r queue", "w queue", "read p50", "read p99",
               "write p99")
    NARROW = ("server", "dev", "r queue", "w queue", "read p99")
    MEDIUM = ("server", "dev", "area used", "reads", "writes", "r queue", "w queue", "read p99")

    def rows_of(self, name: str, e: dict[str, Any]) -> Iterable[tuple[str, ...]]:
        st = e.get("stats")
        if st is None:
            return
        for d, dev in enumerate(st["devices"]):
            used = f"{dev['own_slots_valid'] / dev['own_slots']:.0%}" if dev.get("own_slots") else "-"
            yield (name, str(d), used, str(dev["reads"]), str(dev["writes"]),
                   f"{dev['reads_inflight']}+{dev['reads_queued']}",
                   f"{dev['writes_inflight']}+{dev['writes_queued']}",
                   pct(st["read_latency"][d], 50), pct(st["read_latency"][d], 99),
                   pct(st["write_latency"][d], 99))
