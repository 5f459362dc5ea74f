"""Per-key round trip through LMCache's own L2 adapter machinery (run with .venv-lmcache's Python).

``lmcache bench l2 --no-skip-verify`` fills object i of every round with the byte ``i``
and checks only the last round: an adapter that loads each object from the wrong key of
another round passes it. This script uses LMCache's own pieces (its adapter config parser
and factory, ``ObjectKey`` and ``TensorMemoryObj`` from its benchmark helpers, its event
fds and bitmaps) and gives every object of every round its own random bytes; then it
loads every key, in random order, into buffers filled with something else, and compares
each with what was stored under *that* key. ``--in-flight`` load tasks are submitted before
any is waited for (an adapter may read them as one stream), and each also asks for a key that
was never stored, which must be its only miss: a task's answer is about its own keys. The
second task of each wave also asks, last, for a stored key into a read-only buffer: that
object must fail alone (its task's other objects, and the other tasks, load). Before its
load, each task's keys are looked up and locked, and the answer must be exactly the keys
stored (all but the absent one); they are unlocked after the load.

    python lmcache_verify_keys.py ADAPTER_JSON --keys 64 --rounds 3 --size-kb 100 [--in-flight 4] [--wrong-key]

``--wrong-key`` asks each load for the key after it (a deliberately wrong adapter): every
key must then count as mismatched or missed, which shows the check can fail. Prints one
JSON line: stored, loaded, verified, mismatched, missed, absent keys asked for and found (a
key never stored, reported loaded), read-only objects asked for and reported loaded, and the
adapter's numeric status, and lookup answers that were wrong (a key found that was never
stored, or one stored not found).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import (create_l1_memory_desc, make_aligned_tensor,
                                                              make_memory_objects, make_object_keys, wait_eventfd)
from lmcache.cli.commands.bench.l2_adapter_bench.runner import _PLACEHOLDER_LAYOUT_DESC
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

BATCH = 16
TIMEOUT_S = 60.0


class ReadOnly:
    """A memory object like ``o`` whose buffer cannot be written (a load into it must fail)."""

    def __init__(self, o: object) -> None:
        self.metadata = o.metadata  # type: ignore[attr-defined]
        self.get_size = o.get_size  # type: ignore[attr-defined]
        self.byte_array = bytes(o.get_size())  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("adapter")
    ap.add_argument("--keys", type=int, default=64, help="keys per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-kb", type=int, default=100)
    ap.add_argument("--in-flight", type=int, default=4, help="load tasks submitted before any is waited for")
    ap.add_argument("--wrong-key", action="store_true")
    a = ap.parse_args()
    size = a.size_kb * 1024
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[a.adapter])).adapters[0]
    per = BATCH + 1  # objects of a load task: BATCH keys and one never stored
    buf = make_aligned_tensor((BATCH + a.in_flight * per) * size)
    adapter = create_l2_adapter(cfg, l1_memory_desc=create_l1_memory_desc(buf))
    gen = torch.Generator().manual_seed(1234)
    stored: dict[int, torch.Tensor] = {}  # kv_rank (unique per key) -> the bytes stored under it
    keys = []
    try:
        for r in range(a.rounds):
            for start in range(0, a.keys, BATCH):
                n = min(BATCH, a.keys - start)
                ks = make_object_keys(n, key_offset=r * a.keys + start)
                objs = make_memory_objects(buf, n, size, 0)
                for k, o in zip(ks, objs):  # every object of every round its own bytes
                    o.raw_data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
                    stored[k.kv_rank] = o.raw_data.clone()
                task = adapter.submit_store_task(ks, objs)
                done: dict[int, object] = {}
                while task not in done:
                    if not wait_eventfd(adapter.get_store_event_fd(), TIMEOUT_S):
                        print(json.dumps({"error": "store timed out"}))
                        return 1
                    done.update(adapter.pop_completed_store_tasks())
                if int(done[task]) < 0:  # type: ignore[call-overload]
                    print(json.dumps({"error": f"store task of round {r} failed"}))
                    return 1
                keys += ks
        order = list(range(len(keys)))
        random.Random(99).shuffle(order)
        verified = mismatched = missed = absent = absent_found = readonly = readonly_found = lookup_wrong = 0
        starts = list(range(0, len(order), BATCH))
        for w in range(0, len(starts), a.in_flight):  # a wave of load tasks in flight at once
            wave = []
            locked: list[list[object]] = []
            for q, start in enumerate(starts[w:w + a.in_flight]):
                idx = order[start:start + BATCH]
                ks = [keys[i] for i in idx]
                asked = [keys[(i + 1) % len(keys)] for i in idx] if a.wrong_key else list(ks)
                # one key never stored, at a position of its own in each task
                hole = (w + q) % (len(ks) + 1)
                asked.insert(hole, make_object_keys(1, key_offset=10**9 + start)[0])
                objs = make_memory_objects(buf, len(asked), size, (BATCH + q * per) * size, fill_offset=0x5A)
                ro = q == 1
                if ro:  # a stored key, into a buffer that cannot take it
                    asked.append(asked[0] if hole else asked[1])
                    objs.append(ReadOnly(objs[0]))
                # looked up and locked first (LMCache's order), with the layout it learnt from the
                # stores (the placeholder describes none): every key found but the absent one
                lk = adapter.submit_lookup_and_lock_task(asked, {0: _PLACEHOLDER_LAYOUT_DESC})
                found = None
                while found is None:
                    if not wait_eventfd(adapter.get_lookup_and_lock_event_fd(), TIMEOUT_S):
                        print(json.dumps({"error": "lookup timed out"}))
                        return 1
                    found = adapter.query_lookup_and_lock_result(lk)
                lookup_wrong += sum(bool(found.test(j)) != (j != hole) for j in range(len(asked)))
                wave.append((adapter.submit_load_task(asked, objs), ks, objs, hole, ro))
                locked.append(asked)
            answers: dict[int, object] = {}
            while len(answers) < len(wave):
                if not wait_eventfd(adapter.get_load_event_fd(), TIMEOUT_S):
                    print(json.dumps({"error": "load timed out"}))
                    return 1
                for task, *_ in wave:
                    if task not in answers:
                        got = adapter.query_load_result(task)
                        if got is not None:
                            answers[task] = got
            for asked in locked:
                adapter.submit_unlock(asked)
            for task, ks, objs, hole, ro in wave:
                bitmap = answers[task]
                absent += 1
                absent_found += int(bitmap.test(hole))  # type: ignore[attr-defined]
                if ro:
                    readonly += 1
                    readonly_found += int(bitmap.test(len(objs) - 1))  # type: ignore[attr-defined]
                    objs = objs[:-1]
                real = [(j, o) for j, o in enumerate(objs) if j != hole]
                for k, (j, o) in zip(ks, real):
                    if not bitmap.test(j):  # type: ignore[attr-defined]
                        missed += 1
                    elif torch.equal(o.raw_data, stored[k.kv_rank]):
                        verified += 1
                    else:
                        mismatched += 1
        status = adapter.report_status()  # LMCache's status API (`lmcache server`'s /info shows it)
        print(json.dumps({"stored": len(stored), "loaded": len(keys), "verified": verified,
                          "mismatched": mismatched, "missed": missed, "absent": absent, "absent_found": absent_found,
                          "readonly": readonly, "readonly_found": readonly_found, "lookup_wrong": lookup_wrong,
                          "status": {k: v for k, v in status.items() if isinstance(v, (int, float))}}))
        return 0
    finally:
        adapter.close()


if __name__ == "__main__":
    sys.exit(main())
