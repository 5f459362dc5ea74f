"""Lookups are answered in the client from the shared index: no round trip, so they keep working
while the supervisor is stopped, and they still count in the service's stats and keep found pages
from being evicted first."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.errors import ServiceLost
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store, wait_for

from .test_service import PS, dev_size, keys_of, own_slots, stats

import pytest

pytestmark = pytest.mark.integration


def test_lookup_needs_no_supervisor(file_devices: Any, home: Path, services: Any) -> None:
    make_store(home, "lk", file_devices.make(1, dev_size(300)), PS, service=ServiceConfig(client_buffers=64))
    svc = services(home, "lk")
    present, absent = keys_of("P", 300), keys_of("A", 200)
    with KVCacheClient.connect("lk", home=home, timeout=10) as c:
        assert c.put(present, [page_bytes(k, PS) for k in present], wait=True).stored == 300
        before = stats(svc)
        os.kill(svc.pid, signal.SIGSTOP)  # the supervisor cannot answer anything now
        try:
            t0 = time.monotonic()
            assert c.lookup(present + absent, timeout=0.5) == 300  # one call, longer than max_batch
            assert c.contains(absent[:3] + present[:2], timeout=0.5) == [False, False, False, True, True]
            assert c.lookup(absent + present, timeout=0.5) == 0  # a prefix count
            assert time.monotonic() - t0 < 0.5
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        # the service adds the client's lookups to its stats within a tick or so
        assert wait_for(lambda: stats(svc).service.lookups == before.service.lookups + 3, timeout=60)
        after = stats(svc)
        assert after.service.lookup_keys == before.service.lookup_keys + 500 + 5 + 500


def test_lookup_reports_a_dead_service(file_devices: Any, home: Path, services: Any) -> None:
    """Stale shared memory must not be taken for a live store: once the service is gone, a
    lookup raises ServiceLost as every other call does."""
    make_store(home, "ld", file_devices.make(1, dev_size(50)), PS)
    svc = services(home, "ld")
    keys = keys_of("K", 10)
    c = KVCacheClient.connect("ld", home=home, timeout=5)
    try:
        c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        assert c.lookup(keys) == 10
        svc.stop()
        with pytest.raises(ServiceLost):
            c.lookup(keys)
    finally:
        c.close()


def test_pages_read_outlive_others_under_eviction(file_devices: Any, home: Path, services: Any) -> None:
    """A page a client reads gets its slot's reference bit set (by the I/O worker that served the
    direct read: clients write nothing of the service's), which the service's CLOCK reads: pages
    read survive a wave of writes that evicts the pages around them."""
    make_store(home, "le", file_devices.make(1, dev_size(64)), PS, service=ServiceConfig(client_buffers=32))
    svc = services(home, "le")
    n = own_slots(svc)
    fill, wave = keys_of("F", n), keys_of("W", n // 2)
    with KVCacheClient.connect("le", home=home, timeout=10) as c:
        for i in range(0, n, 16):  # fills the area in slot order; every written page starts referenced
            assert c.put(fill[i:i + 16], [page_bytes(k, PS) for k in fill[i:i + 16]], wait=True).stored
        # one more page: the first eviction sweeps the whole area once, clearing every reference bit
        assert c.put([b"one more"], [page_bytes(b"one more", PS)], wait=True).stored == 1
        hot, near = fill[2:10], fill[10:10 + n // 4]  # the hand stands before both now
        assert c.lookup(hot) == 8
        with c.get(hot) as got:  # read directly: the worker sets the hot pages' reference bits
            assert got.hits == 8
        for i in range(0, len(wave), 16):
            c.put(wave[i:i + 16], [page_bytes(k, PS) for k in wave[i:i + 16]], wait=True)
        assert c.contains(hot) == [True] * 8
        assert sum(c.contains(near)) < len(near) // 2, "nothing was evicted around the hot pages"
