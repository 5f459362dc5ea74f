#!/usr/bin/env python3
"""CPU per saved page of each process of a put stream: client, supervisor, I/O worker.

    .venv/bin/python scripts/bench/put_cpu.py --page-size 256KiB --seconds 5 --json docs/bench/put-cpu.json

One client saves with ``put(wait=True)`` in batches of ``--batch`` (32: an engine's save that
waits) for ``--seconds`` into a store that is full (it is filled once first, unmeasured), so
every write also evicts, as in a cache that has warmed up. Reports the pages saved per second
and GB/s, and for each process the user and system CPU microseconds per page and the context
switches per page (``/proc/PID/stat`` and ``status`` before and after; the client's own from
``getrusage``). The shares of the two cores are what decide a put stream here: issue 26 asks
for this per-page software cost, measured. ``--target`` as in throughput.py (``shm-loop``: a
loop device over /dev/shm, needs root; ``disk-file``; or a device PATH, destroyed).

The whole machine's busy CPU (``/proc/stat``) is taken around the stream too: what is left
after the three processes is the kernel's work for them that no process is charged with (a
loop device's copies run in kernel threads) and anything else running. Then fio writes the
same device (libaio, O_DIRECT, block = one slot, queue depth 4: throughput.py's reference)
for as long, measured the same way; runs alternate with ``--repeat``. From these, the
``bound_without_supervisor``: the pages per second the machine's CPUs would allow if the
supervisor's CPU per page were zero and everything else stayed (an arithmetic bound, what a
design that takes the supervisor out of the write path could reach at best, here).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import fio, make_target  # noqa: E402

from kvstore import KVCacheClient  # noqa: E402
from kvstore._units import parse_size  # noqa: E402
from kvstore.config import ServiceConfig, WorkerConfig  # noqa: E402
from kvstore.testing import ServiceProcess, make_store, script_args, write_record  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> tuple[float, float, int, int]:
    """(user s, system s, voluntary, involuntary context switches) of process ``pid``."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ctx = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
           if "ctxt_switches" in ln}
    return int(f[11]) / TICK, int(f[12]) / TICK, ctx["voluntary_ctxt_switches"], ctx["nonvoluntary_ctxt_switches"]


def machine_busy() -> float:
    """Seconds of busy CPU of the whole machine so far (every CPU: all but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK  # user nice system idle iowait irq softirq steal


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def label(pid: int, dev: str) -> str:
    """What a child of the supervisor is: the I/O worker holds the device open."""
    real = os.path.realpath(dev)
    try:
        if any(os.path.realpath(f"/proc/{pid}/fd/{fd}") == real for fd in os.listdir(f"/proc/{pid}/fd")):
            return f"I/O worker (pid {pid})"
    except OSError:
        pass
    return f"other child (pid {pid})"


def run(target: str, page_size: int, seconds: float, batch: int, fill_pages: int, wait: bool = True,
        inflight_writes: int = 4, depth: int = 0) -> dict:
    slot = 4096 + page_size
    nbytes = (2 << 20) + (fill_pages + 64) * slot
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=os.environ.get("KVBENCH_DIR", "/var/tmp")))
    dev, cleanup = make_target(target, nbytes, work)
    try:
        home = work / "mass"
        home.mkdir()
        make_store(home, "bench", [dev], page_size, service=ServiceConfig(client_buffers=64, max_clients=2),
                   worker=WorkerConfig(max_inflight_writes=inflight_writes), force=True)
        pages = [np.random.default_rng(i).integers(0, 256, page_size, dtype=np.uint8) for i in range(8)]
        with ServiceProcess(home, "bench") as svc, KVCacheClient.connect("bench", home=home) as c:
            for s in range(0, fill_pages, batch):  # fill: from here on every write evicts
                c.put([b"fill/%d" % i for i in range(s, s + batch)], [pages[j % 8] for j in range(batch)], wait=True)
            procs = {"supervisor": svc.proc.pid}
            for k in children(svc.proc.pid):
                procs[label(k, dev)] = k
            before = {name: proc_cpu(pid) for name, pid in procs.items()}
            me0 = resource.getrusage(resource.RUSAGE_SELF)
            m0 = machine_busy()
            t0 = time.perf_counter()
            n = k = 0
            inflight: deque[Any] = deque()
            while time.perf_counter() - t0 < seconds:
                ks, ps = [b"k/%d" % i for i in range(k, k + batch)], [pages[j % 8] for j in range(batch)]
                k += batch
                if depth:  # put_async, ``depth`` calls in flight: wait for the oldest
                    inflight.append(c.put_async(ks, ps))
                    if len(inflight) >= depth:
                        n += inflight.popleft().result().stored
                    continue
                r = c.put(ks, ps, wait=wait)
                n += r.stored if wait else r.queued
            while inflight:
                n += inflight.popleft().result().stored
            if not wait:  # the last writes, and a put that waits for them (it queues behind them)
                r = c.put([b"k/%d" % i for i in range(k, k + batch)], [pages[j % 8] for j in range(batch)], wait=True)
                n += r.stored
            dt = time.perf_counter() - t0
            m1 = machine_busy()
            me1 = resource.getrusage(resource.RUSAGE_SELF)
            after = {name: proc_cpu(pid) for name, pid in procs.items()}
        per = {"client": {"user_us": (me1.ru_utime - me0.ru_utime) / n * 1e6,
                          "sys_us": (me1.ru_stime - me0.ru_stime) / n * 1e6,
                          "vol_ctx": (me1.ru_nvcsw - me0.ru_nvcsw) / n, "invol_ctx": (me1.ru_nivcsw - me0.ru_nivcsw) / n}}
        for name in procs:
            b, a = before[name], after[name]
            if a == b and name != "supervisor":
                continue  # an idle helper process
            per[name] = {"user_us": (a[0] - b[0]) / n * 1e6, "sys_us": (a[1] - b[1]) / n * 1e6,
                         "vol_ctx": (a[2] - b[2]) / n, "invol_ctx": (a[3] - b[3]) / n}
        mine = sum(v["user_us"] + v["sys_us"] for v in per.values())
        machine = (m1 - m0) / n * 1e6
        per["rest of the machine"] = {"user_us": 0.0, "sys_us": machine - mine, "vol_ctx": 0.0, "invol_ctx": 0.0}
        ref = fio_reference(dev, slot, nbytes - (1 << 20), seconds)
        sup = per["supervisor"]["user_us"] + per["supervisor"]["sys_us"]
        cpus = os.cpu_count() or 1
        bound = cpus / ((machine - sup) * 1e-6) if machine > sup else float("inf")
        return {"target": target, "page_size": page_size, "batch": batch, "wait": wait, "async_depth": depth,
                "inflight_writes": inflight_writes, "seconds": dt, "pages": n,
                "pages_per_s": n / dt, "gbps": n * page_size / dt / 1e9, "per_page": per,
                "machine_us_per_page": machine, "machine_busy": machine * 1e-6 * n / dt / cpus, "fio": ref,
                "put_vs_fio": (n / dt) / ref["pages_per_s"],
                "bound_without_supervisor": bound, "bound_vs_fio": bound / ref["pages_per_s"]}
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def fio_reference(dev: str, slot: int, span: int, seconds: float) -> dict:
    """throughput.py's write reference (fio, queue depth 4, one slot per block) on the ``span``
    bytes of ``dev`` after its first MiB, for ``seconds``, with the machine's busy CPU per
    block around it."""
    m0 = machine_busy()
    f = fio(dev, "write", slot, 4, span, 1 << 20, runtime=seconds)
    m1 = machine_busy()
    return {"pages_per_s": f["iops"], "machine_us_per_page": (m1 - m0) / max(1.0, f["iops"] * seconds) * 1e6}


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", default="shm-loop", help="shm-loop, disk-file or a device PATH")
    ap.add_argument("--page-size", default="256KiB")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the measured stream")
    ap.add_argument("--batch", type=int, default=32, help="pages per put(wait=True)")
    ap.add_argument("--fill-pages", type=int, default=2048, help="the store's size in pages (filled first)")
    ap.add_argument("--repeat", type=int, default=1, help="runs (each: kvstore, then fio)")
    ap.add_argument("--no-wait", action="store_true", help="put without waiting (a last put waits for all)")
    ap.add_argument("--inflight-writes", type=int, default=4, help="the store's max_inflight_writes")
    ap.add_argument("--async", dest="depth", type=int, default=0, metavar="N",
                    help="put_async with N calls in flight (each waited for, oldest first)")
    a = ap.parse_args()
    if a.target == "shm-loop" and os.geteuid() != 0:
        print("shm-loop needs root (loop devices); use --target disk-file", file=sys.stderr)
        return 2
    if not 1 <= a.batch <= 64 or a.fill_pages < a.batch:
        print("--batch must be 1..64 (the client's lease) and --fill-pages at least --batch", file=sys.stderr)
        return 2
    results = []
    for _ in range(a.repeat):
        r = run(a.target, parse_size(a.page_size), a.seconds, a.batch, a.fill_pages, not a.no_wait, a.inflight_writes, a.depth)
        results.append(r)
        how = f"put_async of {r['batch']}, {r['async_depth']} in flight" if r["async_depth"] else (
            f"put(wait) of {r['batch']}" if r["wait"] else f"put of {r['batch']} without waiting")
        print(f"{r['target']}, {r['page_size'] >> 10} KiB pages, {how}: "
              f"{r['pages_per_s']:,.0f} pages/s = {r['gbps']:.2f} GB/s; fio write qd4 "
              f"{r['fio']['pages_per_s']:,.0f} blocks/s: put/fio {r['put_vs_fio']:.2f}")
        for name, v in r["per_page"].items():
            if name == "rest of the machine":
                print(f"  {name:40s} {v['sys_us']:6.1f} us per page (kernel threads, interrupts, other work)")
                continue
            print(f"  {name[:40]:40s} user {v['user_us']:6.1f} us  sys {v['sys_us']:6.1f} us per page   "
                  f"context switches per page: {v['vol_ctx']:.2f} voluntary, {v['invol_ctx']:.2f} involuntary")
        print(f"  machine busy CPU per page: kvstore {r['machine_us_per_page']:.1f} us "
              f"({r['machine_busy']:.0%} of the CPUs busy), fio {r['fio']['machine_us_per_page']:.1f} us")
        print(f"  bound if the supervisor cost nothing: {r['bound_without_supervisor']:,.0f} pages/s = "
              f"{r['bound_vs_fio']:.2f}x fio (CPU-bound arithmetic, not a measurement)")
    write_record(a.json, results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
