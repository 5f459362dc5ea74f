"""Run inside LMCache's environment (.venv-lmcache) by tests/engines/test_lmcache_real.py.

The kvstore service stalls (SIGSTOP, by pid) under an adapter that holds locks, as the
outside review of the lookups' own connection did it: lookups and unlocks while it is
stopped (more than the connection's 8 request slots), a burst of lookups, then the service
runs again and every lock is released; then a second adapter closed right after its first
lookup (which the read lane answers). Prints one JSON line: the longest any call took in
LMCache's thread, and the pages pinned on the service's board after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from kvstore.engines.lmcache import KVStoreL2Adapter
from lmcache.v1.distributed.api import ObjectKey

from lmcache_locks import obj, pinned, wait  # type: ignore[import-not-found]


def key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(4, "little") * 8, model_name="tiny", kv_rank=0)


def store(ad: KVStoreL2Adapter, keys: list[ObjectKey]) -> bool:
    tid = ad.submit_store_task(keys, [obj(ad.page_size, i) for i in range(len(keys))])
    done: dict[int, object] = {}
    while tid not in done:
        wait(ad.get_store_event_fd())
        done.update(ad.pop_completed_store_tasks())
    return bool(done[tid].is_successful())  # type: ignore[attr-defined]


def lookup(ad: KVStoreL2Adapter, keys: list[ObjectKey]) -> int:
    t = ad.submit_lookup_and_lock_task(keys, {})
    r = ad.query_lookup_and_lock_result(t)
    while r is None:
        wait(ad.get_lookup_and_lock_event_fd())
        r = ad.query_lookup_and_lock_result(t)
    return int(r.popcount())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--home", required=True)
    a = ap.parse_args()
    pid = int((Path(a.home) / "run" / a.store / "local.pid").read_text())
    out: dict[str, object] = {}
    ad = KVStoreL2Adapter({"store": a.store, "mass_home": a.home})
    keys = [key(i) for i in range(12)]
    out["stored"] = store(ad, keys)
    lookup(ad, keys[11:12])  # the read lane opens the lookups' connection
    ad.submit_unlock(keys[11:12])
    slowest = 0.0
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(10):  # more pins than the connection has request slots
            t0 = time.monotonic()
            lookup(ad, keys[i:i + 1])
            slowest = max(slowest, time.monotonic() - t0)
        for i in range(3):
            t0 = time.monotonic()
            ad.submit_unlock(keys[i:i + 1])
            slowest = max(slowest, time.monotonic() - t0)
        for _ in range(50):
            t0 = time.monotonic()
            ad.submit_lookup_and_lock_task(keys[10:11], {})
            ad.submit_unlock(keys[10:11])
            slowest = max(slowest, time.monotonic() - t0)
    finally:
        os.kill(pid, signal.SIGCONT)
    out["slowest_call_s"] = slowest
    for i in range(3, 12):
        ad.submit_unlock(keys[i:i + 1])
    lookup(ad, keys[11:12])  # a lookup after the stall posts the unpins still owed first
    ad.submit_unlock(keys[11:12])
    out["locks_left"] = len(ad._locks)
    out["pinned_after_stall"] = pinned(a.home, a.store)
    ad.close()
    out["pinned_after_close"] = pinned(a.home, a.store)
    ad2 = KVStoreL2Adapter({"store": a.store, "mass_home": a.home})
    ad2.submit_lookup_and_lock_task(keys[:8], {})  # answered on the read lane: closed right away
    ad2.close()
    out["pinned_after_quick_close"] = pinned(a.home, a.store)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
