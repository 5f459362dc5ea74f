from __future__ import annotations

import mmap

from kvstore.shm.stats import Histogram, StatsBlock, bucket_of, stats_nbytes


def test_counters_histograms_and_attach() -> None:
    m = mmap.mmap(-1, stats_nbytes(2))
    s = StatsBlock(m, 2, init=True)
    s.add("hits", 3)
    s.dev_add(1, "reads", 5)
    s.observe(0, 150e-6)
    snap = StatsBlock.attach(m).snapshot()
    assert snap.service.hits == 3
    assert snap.devices[1].reads == 5 and snap.devices[0].reads == 0
    assert snap.get_latency.count == 1
    assert 150e-6 <= snap.get_latency.percentile(50) <= 256e-6


def test_percentile_bounds() -> None:
    assert bucket_of(0) == 0 and bucket_of(1e-6) == 1 and bucket_of(1e4) == 31
    h = Histogram(tuple([0] * 5 + [99, 1] + [0] * 25))
    assert h.percentile(50) == 32e-6 and h.percentile(100) == 64e-6
    assert Histogram(tuple([0] * 32)).percentile(99) == 0.0
