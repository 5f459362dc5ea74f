"""Run inside LMCache's environment (.venv-lmcache) by tests/engines/test_lmcache_real.py.

Drives ``KVStoreL2Adapter`` directly with LMCache's own ``ObjectKey``, ``TensorMemoryObj``
and event fds, as LMCache's controllers do: stores 8 "locked" and 8 "free" one-page
objects, locks the first 8 (``submit_lookup_and_lock_task``), twice for one of them,
then floods the store with other pages through a plain kvstore client until the area
has turned over several times. Prints one JSON line: lookup bitmaps, pinned pages
during and after the locks, which objects still load byte-exact, and what an unlock raced
into a lookup of the same object left (``race``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import threading
import time
from pathlib import Path

import torch

from kvstore import KVCacheClient
from kvstore.engines.lmcache import KVStoreL2Adapter
from kvstore.tui.source import read_service
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj


def obj(size: int, fill: int) -> TensorMemoryObj:
    t = torch.full((size,), fill, dtype=torch.uint8)
    meta = MemoryObjMetadata(shape=torch.Size([size]), dtype=torch.uint8, address=0, phy_size=size,
                             fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


def wait(fd: int) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    if not p.poll(30_000):
        raise SystemExit("no completion within 30 s")
    os.read(fd, 8)


def pinned(home: str, store: str) -> int:
    """Pages pinned, as the service's board says (it is refreshed once a second: wait for it)."""
    time.sleep(1.5)
    t = read_service(Path(home), store, "local")["tenants"]
    return int(sum(x["pinned"] for x in t.values()))


def lookup(ad: KVStoreL2Adapter, keys: list[ObjectKey], layout: dict[int, object]) -> int:
    """Look up and lock ``keys``; how many were found."""
    t = ad.submit_lookup_and_lock_task(keys, layout)
    r = ad.query_lookup_and_lock_result(t)
    while r is None:
        wait(ad.get_lookup_and_lock_event_fd())
        r = ad.query_lookup_and_lock_result(t)
    return int(r.popcount())


def race(ad: KVStoreL2Adapter, k: ObjectKey, k2: ObjectKey, layout: dict[int, object],
         a: argparse.Namespace) -> dict[str, object]:
    """Object ``k`` locked once; then, while a lookup of ``k`` and ``k2`` runs, an unlock of
    ``k`` on another thread (started from inside the lookup's pin: after the lookup looked at
    the locks held, before it counted its own). ``k`` must stay locked once with its page
    pinned, and ``k2`` be locked and pinned: the service is sent one pin, no unpin."""
    lookup(ad, [k], layout)
    real = ad._lk_client
    sent: list[list[object]] = []
    racers: list[threading.Thread] = []

    class Spy:  # the lookups' connection, recording what it is sent
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def pin(self, pkeys: list[bytes], **kw: object) -> object:
            th = threading.Thread(target=ad.submit_unlock, args=([k],))
            th.start()
            racers.append(th)
            th.join(0.5)  # the unlock goes as far as it can now
            sent.append(["pin", len(pkeys)])
            return real.pin(pkeys, **kw)  # type: ignore[union-attr]

        def unpin(self, pkeys: list[bytes], **kw: object) -> object:
            sent.append(["unpin", len(pkeys)])
            return real.unpin(pkeys, **kw)  # type: ignore[union-attr]

    ad._lk_client = Spy()  # type: ignore[assignment]
    found = lookup(ad, [k, k2], layout)
    for th in racers:
        th.join(30)
    ad._lk_client = real
    out = {"found": found, "sent": sent, "locks": [ad._locks.get(x, (0, []))[0] for x in (k, k2)],
           "pinned": pinned(a.home, a.store)}
    ad.submit_unlock([k, k2])
    out["pinned_after"] = pinned(a.home, a.store)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--flood", type=int, default=400)
    a = ap.parse_args()
    ad = KVStoreL2Adapter({"store": a.store, "mass_home": a.home})
    ps = ad.page_size
    keys = [ObjectKey(chunk_hash=bytes([i]) * 32, model_name="tiny", kv_rank=0) for i in range(16)]
    objs = [obj(ps, i) for i in range(16)]
    tid = ad.submit_store_task(keys, objs)
    done: dict[int, object] = {}
    while tid not in done:
        wait(ad.get_store_event_fd())
        done.update(ad.pop_completed_store_tasks())
    out: dict[str, object] = {"stored": bool(done[tid].is_successful())}  # type: ignore[attr-defined]
    layout = {}  # the group's layout is learned from the store above
    t1 = ad.submit_lookup_and_lock_task(keys[:8], layout)
    t2 = ad.submit_lookup_and_lock_task(keys[:1], layout)  # nested lock of object 0
    found = []
    for t in (t1, t2):
        r = ad.query_lookup_and_lock_result(t)
        while r is None:
            wait(ad.get_lookup_and_lock_event_fd())
            r = ad.query_lookup_and_lock_result(t)
        found.append(r.popcount())
    out["found"] = found
    out["pinned_locked"] = pinned(a.home, a.store)
    with KVCacheClient.connect(a.store, home=a.home) as c:  # turn the area over, in batches
        for s in range(0, a.flood, c.max_batch):
            n = min(c.max_batch, a.flood - s)
            c.put([b"flood/%d" % (s + i) for i in range(n)], [bytes([255]) * ps] * n, wait=True)
    loads = [obj(ps, 0) for _ in range(16)]
    for o in loads:
        o.tensor.fill_(7)
    t = ad.submit_load_task(keys, loads)
    bm = ad.query_load_result(t)
    while bm is None:
        wait(ad.get_load_event_fd())
        bm = ad.query_load_result(t)
    ok = [bool(bm.test(i)) and bool(torch.all(loads[i].tensor == i)) for i in range(16)]
    out["loaded_locked"] = sum(ok[:8])
    out["loaded_free"] = sum(ok[8:])
    ad.submit_unlock(keys[:8])
    out["pinned_after_one_unlock"] = pinned(a.home, a.store)  # object 0 is still locked once
    ad.submit_unlock(keys[:1])
    out["pinned_after_unlock"] = pinned(a.home, a.store)
    out["race"] = race(ad, keys[0], keys[1], layout, a)
    # the service goes away: tasks complete as failed (LMCache recomputes), none hangs
    pid = int((Path(a.home) / "run" / a.store / "local.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    while (Path(a.home) / "run" / a.store / "local.pid").exists():
        time.sleep(0.05)
    t0 = time.monotonic()
    tid = ad.submit_store_task(keys[:2], objs[:2])
    done = {}
    while tid not in done:
        wait(ad.get_store_event_fd())
        done.update(ad.pop_completed_store_tasks())
    tid2 = ad.submit_store_task(keys[2:4], objs[2:4])  # this one has to connect first: that fails too
    while tid2 not in done:
        wait(ad.get_store_event_fd())
        done.update(ad.pop_completed_store_tasks())
    t = ad.submit_load_task(keys[:2], [obj(ps, 0) for _ in range(2)])
    bm = ad.query_load_result(t)
    while bm is None:
        wait(ad.get_load_event_fd())
        bm = ad.query_load_result(t)
    out["after_service_gone"] = {"store_ok": bool(done[tid].is_successful() or done[tid2].is_successful()),  # type: ignore[attr-defined]
                                 "loaded": bm.popcount(), "seconds": round(time.monotonic() - t0, 2)}
    ad.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
