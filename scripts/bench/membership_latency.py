#!/usr/bin/env python3
"""How long a membership change takes to reach a service on another machine, through the devices alone.

    .venv/bin/python scripts/bench/membership_latency.py --rounds 10 --json docs/bench/membership_latency.json

Two MASS_HOMEs stand for two machines sharing one file-backed device: the
administrator's (server a) and a GPU server's (b, joined with ``connect --device``
and its own key; nothing copied). Each round changes a's sync address on the
administrator's machine (``allow a=... --update``: a new, signed membership
generation) and measures, on b's machine, the time until b's service reports that
generation in its stats (``config_generation``: applied, sync agent replaced).
The service on the administrator's machine is told at once by SIGHUP; b is not, so
b's figure is the superblock poll (1 s) plus the apply. Reported: min/median/max.

Then ``--catch-up`` rounds: b is stopped, a saves 20 pages, a's address is updated (a's
sync agent is replaced), b starts again; timed from b's service answering until b's
index holds all 20 pages (what a returning server misses when it cannot catch up).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.testing import ServiceProcess, free_port_pair, make_store, script_args, wait_for, write_record


def ctl(home: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", *args], env=dict(os.environ, MASS_HOME=str(home)),
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise SystemExit(f"mass-ctl {' '.join(args)}: {r.stderr}")
    return r.stdout


def generation(svc: ServiceProcess) -> int:
    seg = Segment.attach(svc.prefix + "stats")
    try:
        return StatsBlock.attach(seg.buf).snapshot().service.config_generation
    finally:
        seg.close()


def main() -> None:
    ap = script_args(__doc__, raw=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--catch-up", type=int, default=5, help="catch-up rounds after a change (default 5)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-member-"))
    admin, host_b = tmp / "admin", tmp / "host-b"
    dev = tmp / "dev.img"
    with open(dev, "wb") as f:
        f.truncate((1 << 20) + 3 * 64 * (4096 + 16384))
    make_store(admin, "m", [str(dev)], 16384, [f"a=127.0.0.1:{free_port_pair()}"], spare=2)
    pub = next(ln.split(": ", 1)[1] for ln in ctl(host_b, "keygen", "m", "--server", "b").splitlines()
               if ln.startswith("public key: "))
    ctl(admin, "allow", "m", f"b=127.0.0.1:{free_port_pair()}", "--key", pub)
    from kvstore import KVCacheClient

    times = []
    catch = []
    with ServiceProcess(admin, "m", "a"):
        with ServiceProcess(host_b, "m", "b", args=["--device", str(dev)]) as sb:
            for _ in range(a.rounds):
                gen = generation(sb) + 1
                t0 = time.monotonic()
                ctl(admin, "allow", "m", f"a=127.0.0.1:{free_port_pair()}", "--update")
                if not wait_for(lambda: generation(sb) >= gen, 30, 0.005):
                    raise SystemExit("b never applied the change")
                times.append(time.monotonic() - t0)
        for r in range(a.catch_up):
            keys = [f"round{r}/{i}".encode() for i in range(20)]
            with KVCacheClient.connect("m", server="a", home=admin) as c:
                if c.put(keys, [bytes(c.page_size)] * len(keys), wait=True).stored != len(keys):
                    raise SystemExit("a did not store the pages")
            ctl(admin, "allow", "m", f"a=127.0.0.1:{free_port_pair()}", "--update")
            with ServiceProcess(host_b, "m", "b"):
                t0 = time.monotonic()
                with KVCacheClient.connect("m", server="b", home=host_b) as c:
                    if not wait_for(lambda: c.lookup(keys) == len(keys), 60, 0.005):
                        raise SystemExit("b never caught up")
                catch.append(time.monotonic() - t0)
    res = {"rounds": a.rounds, "seconds_min": min(times), "seconds_median": statistics.median(times),
           "seconds_max": max(times), "poll_interval_s": 1.0,
           "note": "from the start of 'mass-ctl kvcache allow --update' on the administrator's machine to the "
                   "other machine's service reporting the new generation (includes mass-ctl's own start, ~0.3 s)"}
    if catch:
        res.update({"catch_up_rounds": len(catch), "catch_up_seconds_min": min(catch),
                    "catch_up_seconds_median": statistics.median(catch), "catch_up_seconds_max": max(catch)})
    print(f"membership change reaches another machine's service: min {res['seconds_min']:.2f} s, median "
          f"{res['seconds_median']:.2f} s, max {res['seconds_max']:.2f} s over {a.rounds} rounds (poll 1 s)")
    if catch:
        print(f"a server returning after a change reads the 20 pages saved meanwhile: min {min(catch):.2f} s, "
              f"median {statistics.median(catch):.2f} s, max {max(catch):.2f} s over {len(catch)} rounds")
    write_record(a.json, res, a)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
