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
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import make_target  # noqa: E402

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


def run(target: str, page_size: int, seconds: float, batch: int, fill_pages: int) -> dict:
    slot = 4096 + page_size
    nbytes = (2 << 20) + (fill_pages + 64) * slot
    work = Path(tempfile.mkdtemp(prefix="kvbench-", dir=os.environ.get("KVBENCH_DIR", "/var/tmp")))
    dev, cleanup = make_target(target, nbytes, work)
    try:
        home = work / "mass"
        home.mkdir()
        make_store(home, "bench", [dev], page_size, service=ServiceConfig(client_buffers=64, max_clients=2),
                   worker=WorkerConfig(), force=True)
        pages = [np.random.default_rng(i).integers(0, 256, page_size, dtype=np.uint8) for i in range(8)]
        with ServiceProcess(home, "bench") as svc, KVCacheClient.connect("bench", home=home) as c:
            for s in range(0, fill_pages, batch):  # fill: from here on every write evicts
                c.put([b"fill/%d" % i for i in range(s, s + batch)], [pages[j % 8] for j in range(batch)], wait=True)
            procs = {"supervisor": svc.proc.pid}
            for k in children(svc.proc.pid):
                procs[label(k, dev)] = k
            before = {name: proc_cpu(pid) for name, pid in procs.items()}
            me0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            n = k = 0
            while time.perf_counter() - t0 < seconds:
                r = c.put([b"k/%d" % i for i in range(k, k + batch)], [pages[j % 8] for j in range(batch)], wait=True)
                n += r.stored
                k += batch
            dt = time.perf_counter() - t0
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
        return {"target": target, "page_size": page_size, "batch": batch, "seconds": dt, "pages": n,
                "pages_per_s": n / dt, "gbps": n * page_size / dt / 1e9, "per_page": per}
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", default="shm-loop", help="shm-loop, disk-file or a device PATH")
    ap.add_argument("--page-size", default="256KiB")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the measured stream")
    ap.add_argument("--batch", type=int, default=32, help="pages per put(wait=True)")
    ap.add_argument("--fill-pages", type=int, default=2048, help="the store's size in pages (filled first)")
    a = ap.parse_args()
    if a.target == "shm-loop" and os.geteuid() != 0:
        print("shm-loop needs root (loop devices); use --target disk-file", file=sys.stderr)
        return 2
    if not 1 <= a.batch <= 64 or a.fill_pages < a.batch:
        print("--batch must be 1..64 (the client's lease) and --fill-pages at least --batch", file=sys.stderr)
        return 2
    r = run(a.target, parse_size(a.page_size), a.seconds, a.batch, a.fill_pages)
    print(f"{r['target']}, {r['page_size'] >> 10} KiB pages, put(wait) of {r['batch']}: "
          f"{r['pages_per_s']:,.0f} pages/s = {r['gbps']:.2f} GB/s")
    for name, v in r["per_page"].items():
        print(f"  {name[:40]:40s} user {v['user_us']:6.1f} us  sys {v['sys_us']:6.1f} us per page   "
              f"context switches per page: {v['vol_ctx']:.2f} voluntary, {v['invol_ctx']:.2f} involuntary")
    write_record(a.json, [r], a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
