#!/usr/bin/env python3
"""Throughput and latency of kvstore against fio on the same device, in one run.

    .venv/bin/python scripts/bench/throughput.py --target shm-loop --target disk-file \
        --page-size 1MiB --size 1GiB --json bench-results/throughput.json

For each target device it runs, back to back:

0. an unmeasured sequential write over the whole device (first-touch allocation);
1. fio, libaio + O_DIRECT, block size = one slot (4 KiB header + page), one job:
   sequential write at queue depth ``max_inflight_writes`` (kvstore's write
   limit), random read at queue depth ``read_queue_depth``, and random read at
   queue depth 1 (single-request latency); also, for comparison only, random
   read at ``read_queue_depth`` with fio checking an xxhash of every block
   (``--verify=xxhash``, blocks written with fio's verification headers just
   before, unmeasured), the work kvstore's validated get does and plain fio
   does not;
2. kvstore through the client library (fio and kvstore alternate, ``--repeat`` times;
   medians of the figures and of the per-repetition ratios are reported): put of ``size`` bytes of pages (batches of
   ``max_batch``, completion measured until every page is written), get of all
   of them in random order in batches of 32 kept in flight by ``get_many`` (the
   pipelined get, each page looked at as a caller copying it out would), the
   same with synchronous ``get`` calls of 32 (for comparison), every byte
   checked after the timed part, then single-page gets for latency; also
   ``put(wait=True)`` in batches of 32 (an engine's save that waits), against
   fio's write, and single-page ``put(wait=True)`` for latency, against fio writing one
   block at a time (queue depth 1).

It prints GB/s for both, the ratios, and get and put p50/p99 against fio's qd1 latency.
Targets: ``shm-loop`` is a loop device over a file in /dev/shm (needs root;
software overhead dominates), ``disk-file`` a plain file on the disk under
``--dir``, ``PATH`` any existing device or file (its content is destroyed).
Needs fio on PATH (scripts/setup installs it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


from kvstore import KVCacheClient, ServiceConfig
from kvstore._units import parse_size
from kvstore.config import WorkerConfig
from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.testing import ServiceProcess, make_store, script_args, write_record


def fio(dev: str, rw: str, bs: int, qd: int, size: int, offset: int, runtime: float | None = None,
        verify: str = "") -> dict[str, Any]:
    """One fio job; ``verify``: "write" writes blocks with xxhash verification headers,
    "read" reads them back (in the same random order) and checks every block."""
    cmd = ["fio", "--name=b", f"--filename={dev}", "--ioengine=libaio", "--direct=1", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={qd}", f"--size={size}", f"--offset={offset}", "--numjobs=1",
           "--output-format=json", "--randrepeat=1"]
    if verify:  # fio needs its random map to know which blocks to check
        cmd += ["--verify=xxhash", "--verify_state_save=0",  # no state file left in the working directory
                "--do_verify=0" if verify == "write" else "--verify_only"]
    else:
        cmd += ["--norandommap"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]
    part = job["write"] if "write" in rw and verify != "read" else job["read"]
    pct = part["clat_ns"].get("percentile", {})
    return {"gbps": part["bw_bytes"] / 1e9, "iops": part["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3}


def make_target(kind: str, nbytes: int, workdir: Path) -> tuple[str, list[str]]:
    """Create the device for a target; returns (path, cleanup commands)."""
    if kind == "shm-loop":
        f = Path(tempfile.mkdtemp(prefix="kvbench-", dir="/dev/shm")) / "dev.img"
        with open(f, "wb") as fh:
            fh.truncate(nbytes)
        r = subprocess.run(["losetup", "--find", "--show", str(f)], capture_output=True, text=True, check=True)
        loop = r.stdout.strip()
        return loop, [f"losetup -d {loop}", f"rm -rf {f.parent}"]
    if kind == "disk-file":
        f = workdir / "dev.img"
        with open(f, "wb") as fh:
            fh.truncate(nbytes)
        # allocate blocks so fio and kvstore both write allocated extents
        subprocess.run(["fallocate", "-l", str(nbytes), str(f)], check=False)
        return str(f), [f"rm -f {f}"]
    return kind, []


def run_target(kind: str, page_size: int, size: int, lat_samples: int, repeat: int) -> dict[str, Any]:
    slot = 4096 + page_size
    n = size // page_size
    nbytes = (2 << 20) + (n + 64) * slot
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=os.environ.get("KVBENCH_DIR", "/var/tmp")))
    dev, cleanup = make_target(kind, nbytes, work)
    wcfg = WorkerConfig()
    res: dict[str, Any] = {"target": kind, "device": dev, "page_size": page_size, "pages": n}
    try:
        data_off = 1 << 20
        span = n * slot
        # precondition: write the whole span once, unmeasured, so neither fio nor kvstore pays
        # first-touch allocation (tmpfs pages behind a loop device, file extents) in its figures
        fio(dev, "write", 1 << 20, 8, nbytes - data_off, data_off)
        home = work / "mass"
        home.mkdir()
        make_store(home, "bench", [dev], page_size, service=ServiceConfig(client_buffers=64, max_clients=2),
                   worker=wcfg, force=True)
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("fio_write", "fio_randread", "fio_randread_qd1",
                                                       "fio_randread_verify", "kvstore_put", "kvstore_put_wait32",
                                                       "kvstore_get", "kvstore_get_sync32", "kvstore_get_qd1",
                                                       "fio_randwrite_qd1", "kvstore_put_qd1", "kvstore_put_async32")}
        wrong_total = 0
        with ServiceProcess(home, "bench") as svc:
            pages = [np.random.default_rng(i).integers(0, 256, page_size, dtype=np.uint8) for i in range(8)]
            seg = Segment.attach(svc.prefix + "stats")
            sb = StatsBlock.attach(seg.buf)
            with KVCacheClient.connect("bench", home=home) as c:
                mb = c.max_batch
                # fio and kvstore alternate within each repetition, so a noisy neighbour
                # slows both sides of a ratio alike; the medians are reported
                for rep in range(repeat):
                    keys = [b"bench/%d/%d" % (rep, i) for i in range(n)]
                    runs["fio_write"].append(fio(dev, "write", slot, wcfg.max_inflight_writes, span, data_off))
                    # fio checking every block it reads (xxhash, written with verification headers
                    # just before, unmeasured): the work a validated get does, for comparison
                    fio(dev, "randwrite", slot, wcfg.max_inflight_writes, span, data_off, verify="write")
                    runs["fio_randread_verify"].append(
                        fio(dev, "randwrite", slot, wcfg.read_queue_depth, span, data_off, verify="read"))
                    base = sb.snapshot().service
                    done0 = base.pages_written + base.put_dropped
                    t0 = time.perf_counter()
                    for s in range(0, n, mb):
                        c.put(keys[s:s + mb], [pages[(s + j) % 8] for j in range(min(mb, n - s))])
                    while (lambda v: v.pages_written + v.put_dropped)(sb.snapshot().service) - done0 < n:
                        time.sleep(0.0005)
                    t_put = time.perf_counter() - t0
                    written = sb.snapshot().service.pages_written - base.pages_written
                    runs["kvstore_put"].append({"gbps": written * page_size / t_put / 1e9, "pages": written})
                    runs["fio_randread"].append(fio(dev, "randread", slot, wcfg.read_queue_depth, span, data_off))
                    order = list(range(n))
                    random.Random(rep).shuffle(order)
                    shuffled = [keys[i] for i in order]
                    t0 = time.perf_counter()
                    hits = 0
                    for _s, b in c.get_many(shuffled, batch=min(32, mb)):
                        hits += b.hits
                    t_get = time.perf_counter() - t0
                    runs["kvstore_get"].append({"gbps": hits * page_size / t_get / 1e9, "hits": hits})
                    t0 = time.perf_counter()
                    hits = 0
                    for s in range(0, n, 32):
                        with c.get(shuffled[s:s + 32]) as b:
                            hits += b.hits
                    t_get = time.perf_counter() - t0
                    runs["kvstore_get_sync32"].append({"gbps": hits * page_size / t_get / 1e9, "hits": hits})
                    # correctness after the timed part: every page byte for byte
                    for s in range(0, n, mb):
                        idx = order[s:s + mb]
                        with c.get([keys[i] for i in idx]) as b:
                            for i, v in zip(idx, b):
                                if v is not None and not np.array_equal(np.frombuffer(v, np.uint8), pages[i % 8]):
                                    wrong_total += 1
                    runs["fio_randread_qd1"].append(fio(dev, "randread", slot, 1, span, data_off, runtime=2))
                    lat = []
                    for j in range(lat_samples):
                        t1 = time.perf_counter()
                        with c.get([keys[order[j % n]]]):
                            pass
                        lat.append(time.perf_counter() - t1)
                    lat.sort()
                    runs["kvstore_get_qd1"].append({"p50_us": statistics.median(lat) * 1e6,
                                                    "p99_us": lat[int(len(lat) * 0.99) - 1] * 1e6})
                    # a save that waits for its pages, in batches of 32 (new keys, last: the store evicts
                    # the ones read above as it fills)
                    wkeys = [b"benchw/%d/%d" % (rep, i) for i in range(n)]
                    t0 = time.perf_counter()
                    stored = 0
                    for s in range(0, n, 32):
                        stored += c.put(wkeys[s:s + 32], [pages[(s + j) % 8] for j in range(min(32, n - s))],
                                        wait=True).stored
                    t_put = time.perf_counter() - t0
                    runs["kvstore_put_wait32"].append({"gbps": stored * page_size / t_put / 1e9, "pages": stored})
                    # the same saves with put_async, two in flight: the next batch is copied in while
                    # the last one's pages are written (each still waited for, oldest first)
                    akeys = [b"bencha/%d/%d" % (rep, i) for i in range(n)]
                    t0 = time.perf_counter()
                    stored = 0
                    inflight: list[Any] = []
                    for s in range(0, n, 32):
                        inflight.append(c.put_async(akeys[s:s + 32], [pages[(s + j) % 8] for j in range(min(32, n - s))]))
                        if len(inflight) == 2:
                            stored += inflight.pop(0).result().stored
                    stored += sum(p.result().stored for p in inflight)
                    t_put = time.perf_counter() - t0
                    runs["kvstore_put_async32"].append({"gbps": stored * page_size / t_put / 1e9, "pages": stored})
                    # one page saved and waited for, one after another (an engine saving a request's
                    # last page; LMCache's queue-depth-1 store), against fio writing one block at a time
                    lat = []
                    for j in range(lat_samples):
                        t1 = time.perf_counter()
                        c.put([b"bench1/%d/%d" % (rep, j)], [pages[j % 8]], wait=True)
                        lat.append(time.perf_counter() - t1)
                    lat.sort()
                    runs["kvstore_put_qd1"].append({"p50_us": statistics.median(lat) * 1e6,
                                                    "p99_us": lat[int(len(lat) * 0.99) - 1] * 1e6})
                    runs["fio_randwrite_qd1"].append(fio(dev, "randwrite", slot, 1, span, data_off, runtime=2))
            snap = sb.snapshot()
            res["service_get_p50_us_bucket"] = snap.get_latency.percentile(50) * 1e6
            res["worker_read_p50_us_bucket"] = snap.read_latency[0].percentile(50) * 1e6
            res["worker_write_p50_us_bucket"] = snap.write_latency[0].percentile(50) * 1e6
            del sb, snap
            seg.close()
        res["runs"] = runs
        med = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if isinstance(v[0][f], float)}
               for k, v in runs.items()}
        res.update(med)
        res["kvstore_get"]["wrong"] = wrong_total
        res["ratio_put_vs_fio_write"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_put"], runs["fio_write"]))
        res["ratio_get_vs_fio_randread"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_get"], runs["fio_randread"]))
        res["ratio_get_sync32_vs_fio_randread"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_get_sync32"], runs["fio_randread"]))
        res["ratio_put_wait32_vs_fio_write"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_put_wait32"], runs["fio_write"]))
        res["ratio_put_async32_vs_fio_write"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_put_async32"], runs["fio_write"]))
        res["ratio_get_vs_fio_randread_verify"] = statistics.median(
            k["gbps"] / f["gbps"] for k, f in zip(runs["kvstore_get"], runs["fio_randread_verify"]))
        res["get_p50_budget_us"] = 2 * res["fio_randread_qd1"]["p50_us"] + 100
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    return res


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", action="append", help="shm-loop, disk-file or a device PATH (repeatable)")
    ap.add_argument("--page-size", default="1MiB")
    ap.add_argument("--size", default="1GiB", help="payload bytes written and read per target")
    ap.add_argument("--latency-samples", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3, help="repetitions; medians are reported")
    a = ap.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed (scripts/setup installs it)", file=sys.stderr)
        return 2
    targets = a.target or ["shm-loop", "disk-file"]
    results = []
    for t in targets:
        if t == "shm-loop" and os.geteuid() != 0:
            print("skipping shm-loop: loop devices need root", file=sys.stderr)
            continue
        r = run_target(t, parse_size(a.page_size), parse_size(a.size), a.latency_samples, a.repeat)
        results.append(r)
        print(f"\n== {t}: {r['pages']} pages of {r['page_size'] >> 10} KiB")
        print(f"  fio write   qd{WorkerConfig().max_inflight_writes:<3}      {r['fio_write']['gbps']:6.2f} GB/s")
        print(f"  kvstore put              {r['kvstore_put']['gbps']:6.2f} GB/s   ratio {r['ratio_put_vs_fio_write']:.2f}")
        print(f"  fio randread qd{WorkerConfig().read_queue_depth:<3}     {r['fio_randread']['gbps']:6.2f} GB/s")
        print(f"  kvstore put(wait) of 32  {r['kvstore_put_wait32']['gbps']:6.2f} GB/s   ratio {r['ratio_put_wait32_vs_fio_write']:.2f}")
        print(f"  kvstore put_async of 32, 2 in flight {r['kvstore_put_async32']['gbps']:6.2f} GB/s   ratio "
              f"{r['ratio_put_async32_vs_fio_write']:.2f}")
        print(f"  kvstore get, 32 in flight {r['kvstore_get']['gbps']:5.2f} GB/s   ratio {r['ratio_get_vs_fio_randread']:.2f}"
              f"   (wrong pages: {r['kvstore_get']['wrong']})")
        print(f"  kvstore get, sync of 32  {r['kvstore_get_sync32']['gbps']:6.2f} GB/s   ratio {r['ratio_get_sync32_vs_fio_randread']:.2f}")
        print(f"  fio randread qd{WorkerConfig().read_queue_depth:<3} checking every block (--verify=xxhash) "
              f"{r['fio_randread_verify']['gbps']:6.2f} GB/s   kvstore get / this {r['ratio_get_vs_fio_randread_verify']:.2f}")
        print(f"  fio randread qd1   p50 {r['fio_randread_qd1']['p50_us']:8.1f} us  p99 {r['fio_randread_qd1']['p99_us']:8.1f} us")
        print(f"  kvstore get 1 page p50 {r['kvstore_get_qd1']['p50_us']:8.1f} us  p99 {r['kvstore_get_qd1']['p99_us']:8.1f} us"
              f"   (target p50 <= {r['get_p50_budget_us']:.1f} us)")
        print(f"  fio randwrite qd1  p50 {r['fio_randwrite_qd1']['p50_us']:8.1f} us  p99 {r['fio_randwrite_qd1']['p99_us']:8.1f} us")
        print(f"  kvstore put(wait) 1 page p50 {r['kvstore_put_qd1']['p50_us']:6.1f} us  p99 "
              f"{r['kvstore_put_qd1']['p99_us']:8.1f} us")
        print(f"  inside: worker read p50 <= {r['worker_read_p50_us_bucket']:.0f} us, supervisor get p50 <= "
              f"{r['service_get_p50_us_bucket']:.0f} us (log2 buckets, all gets)")
    write_record(a.json, results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
