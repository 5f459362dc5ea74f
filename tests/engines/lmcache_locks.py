"""Run inside LMCache's environment (.venv-lmcache) by tests/engines/test_lmcache_real.py.

Drives ``KVStoreL2Adapter`` directly with LMCache's own ``ObjectKey``, ``TensorMemoryObj``
and event fds, as LMCache's controllers do: stores 8 "locked" and 8 "free" one-page
objects, locks the first 8 (``submit_lookup_and_lock_task``), twice for one of them,
then floods the store with other pages through a plain kvstore client until the area
has turned over several times. Prints one JSON line: lookup bitmaps, pinned pages
during and after the locks, and which objects still load byte-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
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
