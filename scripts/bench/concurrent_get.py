#!/usr/bin/env python3
"""Aggregate get throughput of several client processes against fio at the same total queue depth.

    .venv/bin/python scripts/bench/concurrent_get.py --clients 8 --page-size 1MiB --size 1GiB

On a loop device over /dev/shm (needs root; ``--device PATH`` for another one, whose content
is destroyed): one client puts ``size`` bytes of pages, then, ``--repeat`` times, alternating:

* fio randread, libaio + O_DIRECT, block size one slot, ``--clients`` jobs at queue depth
  ``read_queue_depth / clients`` each (the same total queue depth as kvstore's workers allow);
* ``--clients`` processes, each getting its share of the pages in its own random order, in
  batches of ``--batch`` (default ``read_queue_depth / clients``: the same total queue depth
  as fio's; every byte checked after the timed part).

A first round of both is a warm-up (the worker's first read into each buffer faults its pages
in) and is not counted. Reports GB/s of both and the median ratio of the other rounds. Gets go straight from each client to the device
worker (direct reads); the worker's read queue depth bounds what is in flight in all.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from kvstore import KVCacheClient, ServiceConfig
from kvstore._units import parse_size
from kvstore.config import WorkerConfig
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

from throughput import fio


def page_of(i: int, ps: int) -> np.ndarray:
    return np.random.default_rng(i % 8).integers(0, 256, ps, dtype=np.uint8)


def client(home: str, keys: list[bytes], batch: int, seed: int, go: object, out: object) -> None:
    order = list(range(len(keys)))
    random.Random(seed).shuffle(order)
    with KVCacheClient.connect("cg", home=home) as c:
        go.wait()  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        hits = 0
        for s in range(0, len(order), batch):
            with c.get([keys[i] for i in order[s:s + batch]]) as b:
                hits += b.hits
        t = time.perf_counter() - t0
        wrong = 0
        ps = c.page_size
        for s in range(0, len(order), batch):
            idx = order[s:s + batch]
            with c.get([keys[i] for i in idx]) as b:
                for i, v in zip(idx, b):
                    k = int(keys[i].rsplit(b"/", 1)[1])
                    if v is not None and not np.array_equal(np.frombuffer(v, np.uint8), page_of(k, ps)):
                        wrong += 1
    out.put((t0, t0 + t, hits, wrong))  # type: ignore[attr-defined]


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--page-size", default="1MiB")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--batch", type=int, help="keys per get (default: read_queue_depth / clients)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", help="a device or file to use (destroyed); default a loop device over /dev/shm")
    a = ap.parse_args()
    ps = parse_size(a.page_size)
    n = parse_size(a.size) // ps
    slot = 4096 + ps
    nbytes = (2 << 20) + (n + 64) * slot
    work = Path(tempfile.mkdtemp(prefix="kvbench-cg-", dir="/dev/shm" if a.device is None else "/var/tmp"))
    cleanup: list[list[str]] = []
    if a.device:
        dev = a.device
    else:
        img = work / "dev.img"
        with open(img, "wb") as f:
            f.truncate(nbytes)
        dev = subprocess.run(["losetup", "--find", "--show", str(img)], capture_output=True, text=True,
                             check=True).stdout.strip()
        cleanup.append(["losetup", "-d", dev])
    wcfg = WorkerConfig()
    qd = max(1, wcfg.read_queue_depth // a.clients)
    a.batch = a.batch or qd
    res: dict = {"clients": a.clients, "batch": a.batch, "page_size": ps, "pages": n, "fio_jobs_qd": qd, "runs": []}
    try:
        fio(dev, "write", 1 << 20, 8, nbytes - (1 << 20), 1 << 20)  # first touch, unmeasured
        home = work / "mass"
        home.mkdir()
        make_store(home, "cg", [dev], ps, force=True, worker=wcfg,
                   service=ServiceConfig(client_buffers=max(a.batch, 16), max_clients=a.clients + 1))
        keys = [b"cg/%d" % i for i in range(n)]
        with ServiceProcess(home, "cg"):
            with KVCacheClient.connect("cg", home=home) as c:
                for s in range(0, n, c.max_batch):
                    c.put(keys[s:s + c.max_batch], [page_of(i, ps) for i in range(s, min(n, s + c.max_batch))],
                          wait=True)
                assert c.lookup(keys) == n, "not every page was stored"
            ctx = multiprocessing.get_context("spawn")
            for rep in range(a.repeat + 1):
                f = fio_jobs(dev, slot, qd, a.clients, n * slot, 1 << 20)
                go, out = ctx.Event(), ctx.Queue()
                procs = [ctx.Process(target=client, args=(str(home), keys[i::a.clients], a.batch, rep * 100 + i, go, out))
                         for i in range(a.clients)]
                for p in procs:
                    p.start()
                time.sleep(2.0)  # let every client connect
                go.set()
                got = [out.get(timeout=600) for _ in procs]
                for p in procs:
                    p.join(60)
                span = max(g[1] for g in got) - min(g[0] for g in got)
                hits = sum(g[2] for g in got)
                run = {"fio_gbps": f, "kvstore_gbps": hits * ps / span / 1e9, "hits": hits,
                       "wrong": sum(g[3] for g in got)}
                run["ratio"] = run["kvstore_gbps"] / f
                if rep:
                    res["runs"].append(run)
                print(f"{'warm-up' if rep == 0 else f'rep {rep}'}: fio {f:.2f} GB/s ({a.clients} jobs x qd{qd}), kvstore {run['kvstore_gbps']:.2f} GB/s "
                      f"({a.clients} clients x {a.batch} keys), ratio {run['ratio']:.2f}, hits {hits}/{n}, wrong {run['wrong']}")
        res["ratio_median"] = statistics.median(r["ratio"] for r in res["runs"])
        print(f"median ratio {res['ratio_median']:.2f}")
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, check=False)
        subprocess.run(["rm", "-rf", str(work)], check=False)
    write_record(a.json, res, a)
    return 0


def fio_jobs(dev: str, bs: int, qd: int, jobs: int, size: int, offset: int) -> float:
    """Aggregate GB/s of ``jobs`` fio randread jobs at queue depth ``qd`` each."""
    cmd = ["fio", "--name=b", f"--filename={dev}", "--ioengine=libaio", "--direct=1", "--rw=randread",
           f"--bs={bs}", f"--iodepth={qd}", f"--size={size}", f"--offset={offset}", f"--numjobs={jobs}",
           "--group_reporting", "--output-format=json", "--randrepeat=1", "--norandommap",
           "--runtime=3", "--time_based"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return float(out["jobs"][0]["read"]["bw_bytes"]) / 1e9


if __name__ == "__main__":
    if os.geteuid() != 0 and "--device" not in sys.argv:
        print("needs root for the loop device (or pass --device)", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
