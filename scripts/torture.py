#!/usr/bin/env python3
"""Churn torture: several servers on a store far smaller than the working set, every area
wrapping constantly, writers and readers on every server, optional faults; every byte read
is checked against the bytes derived from its key.

    .venv/bin/python scripts/torture.py --minutes 10 --servers 3 --faults --json torture.json

Prints pages verified, misses and wrong pages; exits 1 if any page was wrong
(or a client failed), 0 otherwise. Everything runs on 127.0.0.1 in a temporary
MASS_HOME that is removed afterwards.
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


from kvstore.config import ServiceConfig, SyncConfig
from kvstore.testing import ServiceProcess, free_port_pair, make_store, script_args, write_record

CLIENT = r"""
import json, random, sys, time
import numpy as np
from kvstore import KVCacheClient
from kvstore.errors import KVStoreError
from kvstore.quickstart import page_bytes
home, server, servers, keys, seconds, ps, seed = sys.argv[1:8]
servers = servers.split(","); keys = int(keys); ps = int(ps)
rng = random.Random(int(seed))
out = {"server": server, "puts": 0, "verified": 0, "misses": 0, "wrong": 0, "errors": 0}
recent = []  # keys this client wrote lately: likely still stored, so reads of them verify bytes
deadline = time.monotonic() + float(seconds)
c = None
while time.monotonic() < deadline:
    try:
        if c is None:
            c = KVCacheClient.connect("t", home=home, server=server, timeout=15)
        if rng.random() < 0.5:
            ks = [f"{server}/{rng.randrange(keys)}".encode() for _ in range(8)]
            c.put(ks, [page_bytes(k, ps) for k in ks], wait=rng.random() < 0.3)
            out["puts"] += len(ks)
            recent = (recent + ks)[-48:]
        else:
            if recent and rng.random() < 0.5:
                ks = rng.sample(recent, min(8, len(recent)))
            else:
                ks = [f"{rng.choice(servers)}/{rng.randrange(keys)}".encode() for _ in range(8)]
            ks = list(dict.fromkeys(ks))
            with c.get(ks) as b:
                for k, v in zip(ks, b):
                    if v is None:
                        out["misses"] += 1
                    elif np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, ps)):
                        out["verified"] += 1
                    else:
                        out["wrong"] += 1
    except KVStoreError:
        out["errors"] += 1  # a call failed (e.g. its worker was killed): retry, never a wrong page
        time.sleep(0.05)
print(json.dumps(out), flush=True)
"""




def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--slots-per-area", type=int, default=48, help="slots of each server on each of 2 devices")
    ap.add_argument("--keys", type=int, default=1000, help="distinct keys each server writes (working set)")
    ap.add_argument("--page-size", type=int, default=16384)
    ap.add_argument("--faults", action="store_true", help="SIGKILL a random I/O worker every few seconds")
    a = ap.parse_args()
    names = [f"s{i}" for i in range(a.servers)]
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-torture-"))
    svcs: list[ServiceProcess] = []
    report: dict = {"servers": a.servers, "minutes": a.minutes, "faults": a.faults, "kills": 0}
    try:
        devs = []
        for d in range(2):
            p = tmp / f"dev{d}.img"
            with open(p, "wb") as f:
                f.truncate((1 << 20) + a.servers * a.slots_per_area * (4096 + a.page_size))
            devs.append(str(p))
        specs = [f"{n}=127.0.0.1:{free_port_pair()}" for n in names] if a.servers > 1 else names
        make_store(tmp, "t", devs, a.page_size, specs, service=ServiceConfig(client_buffers=16, max_clients=4),
                   sync=SyncConfig(heartbeat_s=0.2))
        svcs = [ServiceProcess(tmp, "t", n).start() for n in names]
        seconds = a.minutes * 60
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(tmp), n, ",".join(names), str(a.keys),
                                   str(seconds), str(a.page_size), str(i)], stdout=subprocess.PIPE, text=True)
                 for i, n in enumerate(names)]
        t_end = time.monotonic() + seconds
        rng = random.Random(0)
        while time.monotonic() < t_end:
            time.sleep(min(3.0, max(0.0, t_end - time.monotonic())))
            if a.faults and time.monotonic() < t_end - 1:
                victim = rng.choice(svcs)
                try:
                    os.kill(rng.choice(victim.worker_pids()), signal.SIGKILL)
                    report["kills"] += 1
                except (ProcessLookupError, OSError):
                    pass
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            results.append(json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 and out.strip() else
                           {"failed": p.returncode})
        report["clients"] = results
        for k in ("puts", "verified", "misses", "wrong", "errors"):
            report[k] = sum(r.get(k, 0) for r in results)
        report["client_failures"] = sum(1 for r in results if "failed" in r)
        from kvstore.shm.segment import Segment
        from kvstore.shm.stats import StatsBlock

        ev = 0
        for s in svcs:
            seg = Segment.attach(s.prefix + "stats")
            st = StatsBlock.attach(seg.buf).snapshot().service
            ev += st.evictions
            report.setdefault("validation_failures", 0)
            report["validation_failures"] += st.validation_failures
            report.setdefault("worker_restarts", 0)
            report["worker_restarts"] += st.worker_restarts
            del st
            seg.close()
        report["evictions"] = ev
    finally:
        for s in svcs:
            s.stop()
        report["leftovers"] = sum(len(s.leftovers()) for s in svcs)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"torture: {a.servers} servers, {a.minutes} min, faults={'on' if a.faults else 'off'} "
          f"({report.get('kills', 0)} workers killed)")
    print(f"  pages written {report.get('puts', 0)}, evictions {report.get('evictions', 0)}")
    print(f"  pages verified {report.get('verified', 0)}, misses {report.get('misses', 0)}, "
          f"wrong pages {report.get('wrong', 0)}; failed calls retried {report.get('errors', 0)}; "
          f"validation failures caught {report.get('validation_failures', 0)}")
    write_record(a.json, report, a)
    bad = report.get("wrong", 1) or report.get("client_failures", 1) or report.get("leftovers", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
