#!/usr/bin/env python3
"""Stall torture: the service is stopped and resumed at random (SIGSTOP/SIGCONT) while client
processes put and get with short per-call timeouts, and ask for keys that are never put. Every
page read is checked byte for byte against the bytes derived from its key; a hit on a key that
was never put is a phantom.

    .venv/bin/python scripts/stall_torture.py --seconds 40 --clients 2 --json stall.json

At the end (service running again) every key is read once more (a final sweep), and every
client must have all of its buffers back. Prints stalls, calls, timeouts, hits, wrong and
phantom pages; exits 1 if any page was wrong or phantom, a buffer leaked, or a client failed.
Runs on 127.0.0.1-free Unix sockets in a temporary MASS_HOME that is removed afterwards.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from kvstore.config import ServiceConfig
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

CLIENT = r"""
import json, random, sys, time
import numpy as np
from kvstore import KVCacheClient
from kvstore.errors import KVStoreError, Timeout
from kvstore.quickstart import page_bytes
home, cid, keys, seconds, ps, seed = sys.argv[1:7]
keys = int(keys); ps = int(ps)
rng = random.Random(int(seed))
out = {"client": cid, "calls": 0, "timeouts": 0, "errors": 0, "puts": 0, "hits": 0, "misses": 0,
       "wrong": 0, "phantom": 0, "sweep_hits": 0, "sweep_wrong": 0, "sweep_phantom": 0, "leaked": 0}
def mine(i): return f"{cid}/{i}".encode()
def never(i): return f"{cid}/never/{i}".encode()   # never put by anyone
def check(ks, batch, sweep=False):
    p = "sweep_" if sweep else ""
    for k, v in zip(ks, batch):
        if v is None:
            if not sweep: out["misses"] += 1
        elif b"/never/" in k:
            out[p + "phantom"] += 1
        elif np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, ps)):
            out[p + "hits"] += 1
        else:
            out[p + "wrong"] += 1
c = KVCacheClient.connect("st", home=home, timeout=5)
deadline = time.monotonic() + float(seconds)
while time.monotonic() < deadline:
    t = rng.choice([0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
    out["calls"] += 1
    try:
        if rng.random() < 0.45:
            ks = [mine(rng.randrange(keys)) for _ in range(rng.randint(1, 12))]
            ks = list(dict.fromkeys(ks))
            c.put(ks, [page_bytes(k, ps) for k in ks], wait=rng.random() < 0.5, timeout=t)
            out["puts"] += len(ks)
        elif rng.random() < 0.2:
            ks = [never(rng.randrange(keys)) for _ in range(8)] + [mine(rng.randrange(keys)) for _ in range(4)]
            n = c.lookup(ks, timeout=t)
            if any(c.contains(ks[:8], timeout=t)):
                out["phantom"] += 1
        else:
            ks = [rng.choice([mine, never])(rng.randrange(keys)) for _ in range(rng.randint(1, 16))]
            ks = list(dict.fromkeys(ks))
            with c.get(ks, timeout=t) as b:
                check(ks, b)
    except Timeout:
        out["timeouts"] += 1
    except KVStoreError:
        out["errors"] += 1
# the controller resumed the service for good; the final sweep, with a generous timeout
for s in range(0, keys, c.max_batch // 2):
    ks = [mine(i) for i in range(s, min(keys, s + c.max_batch // 2))]
    ks += [never(i) for i in range(s, min(keys, s + c.max_batch // 2))]
    with c.get(ks, timeout=30) as b:
        check(ks, b, sweep=True)
end = time.monotonic() + 15
while c.free_buffers() != c.max_batch and time.monotonic() < end:
    time.sleep(0.05)
out["leaked"] = c.max_batch - c.free_buffers()
c.close()
print(json.dumps(out), flush=True)
"""

SUMS = ("calls", "timeouts", "errors", "puts", "hits", "misses", "wrong", "phantom", "sweep_hits", "sweep_wrong",
        "sweep_phantom", "leaked")


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--seconds", type=float, default=40.0, help="how long clients run while the service stalls")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--keys", type=int, default=300, help="distinct keys each client puts")
    ap.add_argument("--page-size", type=int, default=16384)
    ap.add_argument("--stall-min", type=float, default=0.05, help="shortest stall, seconds")
    ap.add_argument("--stall-max", type=float, default=0.6, help="longest stall, seconds")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-stall-"))
    svc: ServiceProcess | None = None
    report: dict = {"seconds": a.seconds, "clients": a.clients, "stalls": 0, "stalled_s": 0.0}
    procs: list[subprocess.Popen[str]] = []
    try:
        dev = tmp / "dev0.img"
        with open(dev, "wb") as f:  # room for every key: misses here are only timeouts, never eviction
            f.truncate((1 << 20) + (a.clients * a.keys + 64) * (4096 + a.page_size))
        make_store(tmp, "st", [str(dev)], a.page_size, service=ServiceConfig(client_buffers=32, max_clients=8))
        svc = ServiceProcess(tmp, "st").start()
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(tmp), f"c{i}", str(a.keys), str(a.seconds),
                                   str(a.page_size), str(i)], stdout=subprocess.PIPE, text=True)
                 for i in range(a.clients)]
        rng = random.Random(11)
        t_end = time.monotonic() + a.seconds
        time.sleep(0.3)
        while time.monotonic() < t_end - 0.2:
            stall = rng.uniform(a.stall_min, a.stall_max)
            os.kill(svc.pid, signal.SIGSTOP)
            try:
                time.sleep(stall)
            finally:
                os.kill(svc.pid, signal.SIGCONT)
            report["stalls"] += 1
            report["stalled_s"] += stall
            time.sleep(rng.uniform(0.05, 0.5))
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            results.append(json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 and out.strip() else
                           {"failed": p.returncode})
        report["per_client"] = results
        for k in SUMS:
            report[k] = sum(r.get(k, 0) for r in results)
        report["client_failures"] = sum(1 for r in results if "failed" in r)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if svc is not None:
            try:
                os.kill(svc.pid, signal.SIGCONT)
            except OSError:
                pass
            report["service_exit"] = svc.stop()
            report["leftovers"] = len(svc.leftovers())
        shutil.rmtree(tmp, ignore_errors=True)
    report["stalled_s"] = round(report["stalled_s"], 2)
    print(f"stall torture: {report['stalls']} stalls ({report['stalled_s']} s stopped) over {a.seconds} s, "
          f"{a.clients} clients")
    print(f"  calls {report.get('calls', 0)}, timeouts {report.get('timeouts', 0)}, hits {report.get('hits', 0)}, "
          f"misses {report.get('misses', 0)}, wrong {report.get('wrong', 0)}, phantom {report.get('phantom', 0)}")
    print(f"  final sweep: hits {report.get('sweep_hits', 0)}, wrong {report.get('sweep_wrong', 0)}, "
          f"phantom {report.get('sweep_phantom', 0)}; buffers leaked {report.get('leaked', 0)}")
    write_record(a.json, report, a)
    bad = (report.get("wrong", 1) or report.get("phantom", 1) or report.get("sweep_wrong", 1)
           or report.get("sweep_phantom", 1) or report.get("leaked", 1) or report.get("client_failures", 1)
           or report.get("leftovers", 0) or report.get("service_exit", 1) not in (0,))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
