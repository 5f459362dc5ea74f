"""A flood of puts is slowed down, not queued without bound; reads keep being served meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig, WorkerConfig
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.testing import make_store

pytestmark = pytest.mark.integration
PS = 64 << 10


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_flood_of_puts_is_bounded_and_reads_go_on(home: Path, file_devices: Any, services: Any) -> None:
    (dev,) = file_devices.make(1, (1 << 20) + 600 * (4096 + PS))
    make_store(home, "b", [dev], PS, service=ServiceConfig(client_buffers=16, max_clients=2),
               worker=WorkerConfig(max_inflight_writes=2))
    svc = services(home, "b")
    hot = [b"hot/%d" % i for i in range(8)]
    with KVCacheClient.connect("b", home=home) as c:
        c.put(hot, [page_bytes(k, PS) for k in hot], wait=True)
    seg = Segment.attach(svc.prefix + "stats")
    sb = StatsBlock.attach(seg.buf)
    rss0 = rss_kib(svc.pid)
    peak = {"queued": 0, "inflight": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            d = sb.snapshot().devices[0]
            peak["queued"] = max(peak["queued"], d.writes_queued)
            peak["inflight"] = max(peak["inflight"], d.writes_inflight)
            time.sleep(0.002)

    page = np.full(PS, 7, dtype=np.uint8)
    flood_keys = [b"flood/%d" % i for i in range(500)]
    reads = {"ok": 0, "wrong": 0}

    def read_loop() -> None:
        with KVCacheClient.connect("b", home=home) as r:
            while not stop.is_set():
                with r.get(hot) as v:
                    for k, x in zip(hot, v):
                        ok = x is not None and np.array_equal(np.frombuffer(x, np.uint8), page_bytes(k, PS))
                        reads["ok" if ok else "wrong"] += 1

    threads = [threading.Thread(target=watch), threading.Thread(target=read_loop)]
    for t in threads:
        t.start()
    try:
        with KVCacheClient.connect("b", home=home) as w:
            t0 = time.monotonic()
            r = w.put(flood_keys, [page] * len(flood_keys))  # one call, no wait: 31 MiB of pages
            took = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert r.queued + r.stored == 500
    # the writer was held back by its 16 leased buffers: writes queued never exceeded them, the
    # device never had more than max_inflight_writes outstanding, and the service did not grow
    assert peak["queued"] <= 16 and peak["inflight"] <= 2, peak
    assert rss_kib(svc.pid) - rss0 < 20 * 1024
    assert took > 0.05  # the call waited for buffers rather than returning at once
    assert reads["ok"] > 0 and reads["wrong"] == 0
    del sb
    seg.close()
