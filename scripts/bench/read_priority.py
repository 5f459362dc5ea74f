#!/usr/bin/env python3
"""Read latency while writes saturate the device, against reads alone (reads must keep priority).

    .venv/bin/python scripts/bench/read_priority.py --target shm-loop --json docs/bench/read_priority.json

One service, one device. A reader process measures single-page ``get`` latency
over a prefilled read set, first alone, then while a writer process floods
``put`` (unique keys, ``wait=False``, as fast as the service takes them) so that
the device always has ``max_inflight_writes`` writes outstanding and a backlog
behind them. Reports p50/p99 of both phases and the p99 ratio (target <= 3).
Every page read is checked byte for byte. Targets: ``shm-loop`` (a loop device
over /dev/shm, root), ``disk-file`` (a file under /var/tmp), or a device path.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from kvstore._units import parse_size
from kvstore.config import ServiceConfig
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

READER = r"""
import json, sys, time, random, numpy as np
from kvstore import KVCacheClient
from kvstore.quickstart import page_bytes
home, n, samples, ps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
keys = [b"read/%d" % i for i in range(n)]
rng = random.Random(1)
lat, wrong, miss = [], 0, 0
with KVCacheClient.connect("rp", home=home) as c:
    for _ in range(samples):
        k = rng.choice(keys)
        t = time.perf_counter()
        with c.get([k]) as b:
            dt = time.perf_counter() - t
            if b[0] is None:
                miss += 1
            elif not np.array_equal(np.frombuffer(b[0], np.uint8), page_bytes(k, ps)):
                wrong += 1
        lat.append(dt)
print(json.dumps({"lat": lat, "wrong": wrong, "miss": miss}))
"""

WRITER = r"""
import sys, time, numpy as np
from kvstore import KVCacheClient
home, ps, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
page = np.random.default_rng(0).integers(0, 256, ps, dtype=np.uint8)
end = time.monotonic() + seconds
i = n = 0
with KVCacheClient.connect("rp", home=home) as c:
    while time.monotonic() < end:
        keys = [b"flood/%d" % (i + j) for j in range(16)]
        i += 16
        n += c.put(keys, [page] * 16).queued
print(n)
"""


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, int(len(s) * q) - 1)]


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", default="disk-file")
    ap.add_argument("--page-size", default="1MiB")
    ap.add_argument("--read-set", type=int, default=256)
    ap.add_argument("--samples", type=int, default=400)
    a = ap.parse_args()
    ps = parse_size(a.page_size)
    slots = 4096
    nbytes = (2 << 20) + slots * (4096 + ps)
    work = Path(tempfile.mkdtemp(prefix="kvbench-rp-", dir="/var/tmp"))
    cleanup: list[str] = []
    try:
        if a.target == "shm-loop":
            f = Path(tempfile.mkdtemp(prefix="kvbench-rp-", dir="/dev/shm")) / "dev.img"
            with open(f, "wb") as fh:
                fh.truncate(nbytes)
            dev = subprocess.run(["losetup", "--find", "--show", str(f)], capture_output=True, text=True,
                                 check=True).stdout.strip()
            cleanup += [f"losetup -d {dev}", f"rm -rf {f.parent}"]
        elif a.target == "disk-file":
            dev = str(work / "dev.img")
            with open(dev, "wb") as fh:
                fh.truncate(nbytes)
            subprocess.run(["fallocate", "-l", str(nbytes), dev], check=False)
        else:
            dev = a.target
        home = work / "mass"
        home.mkdir()
        make_store(home, "rp", [dev], ps, service=ServiceConfig(client_buffers=32, max_clients=4), force=True)
        with ServiceProcess(home, "rp"):
            from kvstore import KVCacheClient
            from kvstore.quickstart import page_bytes

            keys = [b"read/%d" % i for i in range(a.read_set)]
            with KVCacheClient.connect("rp", home=home) as c:
                for s in range(0, len(keys), 16):
                    c.put(keys[s:s + 16], [page_bytes(k, ps) for k in keys[s:s + 16]], wait=True)

            def read_phase() -> dict:
                r = subprocess.run([sys.executable, "-c", READER, str(home), str(a.read_set), str(a.samples),
                                    str(ps)], capture_output=True, text=True, check=True)
                return json.loads(r.stdout)

            idle = read_phase()
            w = subprocess.Popen([sys.executable, "-c", WRITER, str(home), str(ps), "600"],
                                 stdout=subprocess.PIPE, text=True)
            time.sleep(2.0)  # let the write backlog build
            busy = read_phase()
            w.terminate()
            w.wait(30)
        res = {"target": a.target, "page_size": ps,
               "idle": {"p50_us": statistics.median(idle["lat"]) * 1e6, "p99_us": percentile(idle["lat"], 0.99) * 1e6,
                        "misses": idle["miss"], "wrong": idle["wrong"]},
               "writes_saturating": {"p50_us": statistics.median(busy["lat"]) * 1e6,
                                     "p99_us": percentile(busy["lat"], 0.99) * 1e6,
                                     "misses": busy["miss"], "wrong": busy["wrong"]}}
        res["p99_ratio"] = res["writes_saturating"]["p99_us"] / res["idle"]["p99_us"]
        print(f"{a.target}, {ps >> 10} KiB pages: reads alone p50 {res['idle']['p50_us']:.0f} us p99 "
              f"{res['idle']['p99_us']:.0f} us; under saturating writes p50 {res['writes_saturating']['p50_us']:.0f} us "
              f"p99 {res['writes_saturating']['p99_us']:.0f} us; p99 ratio {res['p99_ratio']:.2f} (target <= 3); "
              f"wrong pages {idle['wrong'] + busy['wrong']}")
        write_record(a.json, res, a)
    finally:
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
