"""Pins that outlive churn, pin quotas, per-tenant capacity quotas, and their place in status."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient, QuotaExceeded
from kvstore.config import ServiceConfig, save_store
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store, wait_for
from tests.integration.test_multiserver import stats

pytestmark = pytest.mark.integration
PS = 16 << 10


def store(home: Path, devices: Any, slots: int, **cfg: Any) -> None:
    (dev,) = devices.make(1, (1 << 20) + slots * (4096 + PS))
    c = make_store(home, "q", [dev], PS, service=ServiceConfig(client_buffers=16, max_clients=4,
                                                                 trust_declared_tenant=True))
    if cfg:
        save_store(dataclasses.replace(c, **cfg), home)


def flood(c: KVCacheClient, prefix: str, n: int) -> None:
    for s in range(0, n, 16):
        ks = [f"{prefix}/{i}".encode() for i in range(s, s + 16)]
        c.put(ks, [page_bytes(k, PS) for k in ks], wait=True)


def test_pinned_pages_outlive_churn(home: Path, file_devices: Any, services: Any) -> None:
    store(home, file_devices, 40)
    svc = services(home, "q")
    prompt = [b"system/%d" % i for i in range(8)]
    with KVCacheClient.connect("q", home=home, tenant="sys") as s, \
            KVCacheClient.connect("q", home=home, tenant="sys") as s2:
        s.put(prompt, [page_bytes(k, PS) for k in prompt], wait=True)
        assert s.pin(prompt) == 8
        assert s.pin(prompt) == 8  # idempotent
    with KVCacheClient.connect("q", home=home, tenant="sys") as c:
        flood(c, "churn", 400)  # ten times the store: everything unpinned is evicted many times over
        assert stats(svc).evictions > 300
        with c.get(prompt) as v:  # pins belong to the tenant and outlived their connection
            assert all(x is not None and bytes(x) == page_bytes(k, PS).tobytes() for k, x in zip(prompt, v))
        assert c.unpin(prompt) == 8 and c.unpin(prompt) == 0
        flood(c, "churn2", 200)
        assert c.lookup(prompt[:1]) == 0  # no longer protected
    del s2


def test_pins_posted_without_waiting_take_effect_in_order(home: Path, file_devices: Any, services: Any) -> None:
    """``pin(wait=False)`` (the LMCache adapter's lock) returns before the service answers; the
    pins hold through churn all the same, and an unpin after it undoes it (requests of one
    connection are taken in order)."""
    store(home, file_devices, 40)
    svc = services(home, "q")
    prompt = [b"doc/%d" % i for i in range(8)]
    with KVCacheClient.connect("q", home=home, tenant="sys") as c:
        c.put(prompt, [page_bytes(k, PS) for k in prompt], wait=True)
        for _ in range(12):  # more than the connection's 8 request descriptors: they come back
            assert c.pin(prompt, wait=False) == 0
        flood(c, "churn", 400)
        assert stats(svc).evictions > 300
        with c.get(prompt) as v:
            assert all(x is not None and bytes(x) == page_bytes(k, PS).tobytes() for k, x in zip(prompt, v))
        c.pin(prompt[:4], wait=False)
        assert c.unpin(prompt[:4]) == 4  # taken after the pin posted before it
        flood(c, "churn2", 200)
        assert c.contains(prompt) == [False] * 4 + [True] * 4
        assert c.unpin(prompt) == 4


def test_pin_quota(home: Path, file_devices: Any, services: Any) -> None:
    store(home, file_devices, 40, pin_quotas={"*": 4})
    services(home, "q")
    keys = [b"k/%d" % i for i in range(6)]
    with KVCacheClient.connect("q", home=home, tenant="a") as a, KVCacheClient.connect("q", home=home, tenant="b") as b:
        a.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        with pytest.raises(QuotaExceeded, match="2 page.* not pinned.*pin quota"):
            a.pin(keys)
        assert a.unpin(keys) == 4
        assert b.pin(keys) == 0  # b's key space holds none of a's pages: nothing to pin


def test_capacity_quota_keeps_a_noisy_tenant_in_its_place(home: Path, file_devices: Any, services: Any) -> None:
    store(home, file_devices, 48, quotas={"noisy": 10})
    services(home, "q")
    quiet = [b"quiet/%d" % i for i in range(24)]
    with KVCacheClient.connect("q", home=home, tenant="quiet") as q, \
            KVCacheClient.connect("q", home=home, tenant="noisy") as n:
        q.put(quiet, [page_bytes(k, PS) for k in quiet], wait=True)
        flood(n, "noise", 200)
        for part in (quiet[:12], quiet[12:]):  # the quiet tenant lost nothing
            with q.get(part) as v:
                assert all(x is not None and bytes(x) == page_bytes(k, PS).tobytes() for k, x in zip(part, v))
        last_batch = [f"noise/{i}".encode() for i in range(192, 208)]
        assert n.contains(last_batch).count(True) == 10  # its newest pages, never more than its quota
    env = dict(os.environ, MASS_HOME=str(home))

    def tenants() -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", "status", "q", "--json"], env=env,
                           capture_output=True, text=True, check=True)
        return dict(json.loads(r.stdout)["servers"]["local"].get("tenants", {}))

    assert wait_for(lambda: tenants().get("noisy", {}).get("slots") == 10)
    t = tenants()
    assert t["noisy"]["quota"] == 10 and t["quiet"]["slots"] == 24 and t["quiet"]["quota"] is None


def test_a_put_names_the_pages_it_dropped(home: Path, file_devices: Any, services: Any) -> None:
    """Every slot pinned: new pages are dropped, and ``PutResult.dropped_at`` says which (the
    LMCache adapter fails exactly the stores whose pages were dropped from a grouped put)."""
    store(home, file_devices, 40, pin_quotas={"*": 1000})
    svc = services(home, "q")
    with KVCacheClient.connect("q", home=home, tenant="sys") as c:
        n = stats(svc).own_slots
        held = [b"held/%d" % i for i in range(n)]
        for s in range(0, n, 16):
            c.put(held[s:s + 16], [page_bytes(k, PS) for k in held[s:s + 16]], wait=True)
        assert c.pin(held) == n
        keys = [held[0], b"new/0", held[1], b"new/1"]
        r = c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        assert (r.stored, r.skipped, r.dropped, r.dropped_at) == (0, 2, 2, (1, 3))
        assert c.unpin(held) == n
