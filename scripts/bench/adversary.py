#!/usr/bin/env python3
"""What a hostile local client gets, and what a healthy one sees meanwhile, attack by attack.

    .venv/bin/python scripts/bench/adversary.py --json docs/bench/adversary.json

One service on a plain file device, ``service.access_group = "nogroup"``, tenant alpha (this
user) and beta (``nobody``). Alpha saves 64 pages, then, for each attack, a healthy alpha
client reads those 64 pages in batches of 8 for ``--seconds`` while ``tests/integration/
adversary.py`` (stdlib only: it speaks the hello and maps and writes the shared memory itself)
attacks as beta, run as ``nobody``; one baseline round has no attacker. (``KVS_HELLO_V=3`` in
the environment lets the attacker speak to a service of the previous version.) Reports, per attack,
what the attacker got and the healthy client's gets: count, wrong or missing pages, p50/p99
latency. A flood round holds 300 silent connections and times 20 healthy connects. Needs root
(to run the attacker as another user) and a system python3.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

from kvstore import KVCacheClient
from kvstore.config import run_dir, save_store
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment, name_prefix
from kvstore.shm.stats import StatsBlock
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

PS = 16 << 10
ADVERSARY = ROOT / "tests" / "integration" / "adversary.py"
FLOOD = ("import socket, sys, time; socks = []\n"
         "for _ in range(300):\n"
         "    s = socket.socket(socket.AF_UNIX); s.setblocking(False)\n"
         "    try: s.connect(sys.argv[1]); socks.append(s)\n"
         "    except OSError: pass\n"
         "print(len(socks), flush=True); time.sleep(float(sys.argv[2]))\n")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(len(s) * q / 100.0)) - 1))] if s else 0.0


def counters(home: Path) -> Any:
    seg = Segment.attach(name_prefix(home, "adv", "local") + "stats")
    try:
        return StatsBlock.attach(seg.buf).snapshot().service
    finally:
        seg.close()


def as_nobody(gid: int, args: list[str]) -> list[str]:
    return ["setpriv", "--reuid=65534", f"--regid={gid}", "--clear-groups", "/usr/bin/python3", *args]


def healthy_reads(home: Path, keys: list[bytes], stop: threading.Event, out: dict[str, Any]) -> None:
    lat: list[float] = []
    wrong = missing = 0
    with KVCacheClient.connect("adv", home=home, tenant="alpha", timeout=20) as c:
        while not stop.is_set():
            for i in range(0, len(keys), 8):
                part = keys[i:i + 8]
                t0 = time.perf_counter()
                with c.get(part) as got:
                    lat.append(time.perf_counter() - t0)
                    for k, v in zip(part, got):
                        if v is None:
                            missing += 1
                        elif bytes(v) != bytes(page_bytes(k, PS)):
                            wrong += 1
    out.update(gets=len(lat), wrong=wrong, missing=missing, p50_ms=round(pct(lat, 50) * 1e3, 3),
               p99_ms=round(pct(lat, 99) * 1e3, 3))


def main() -> None:
    ap = script_args(__doc__)
    ap.add_argument("--seconds", type=float, default=3.0, help="each round's length")
    a = ap.parse_args()
    gid = grp.getgrnam("nogroup").gr_gid
    tmp = Path(tempfile.mkdtemp(prefix="kvs-adv-"))
    os.chmod(tmp, 0o755)
    home = tmp / "mass"
    home.mkdir()
    dev = tmp / "d0.img"
    with open(dev, "wb") as f:
        f.truncate((1 << 20) + 400 * (4096 + PS))
    cfg = make_store(home, "adv", [str(dev)], PS)
    cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, access_group="nogroup"),
                              tenants={"alpha": [f"uid:{os.getuid()}"], "beta": ["uid:65534"]})
    save_store(cfg, home)
    sock = run_dir("adv", home) / "local.sock"
    opened = [(d, stat.S_IMODE(os.stat(d).st_mode)) for d in {tmp, home, *ADVERSARY.parents} if d != Path("/")]
    for d, m in opened:
        os.chmod(d, m | 0o005)
    svc = ServiceProcess(home, "adv").start()
    rounds: list[dict[str, Any]] = []
    try:
        keys = [b"alpha/%d" % i for i in range(64)]
        with KVCacheClient.connect("adv", home=home, tenant="alpha") as c:
            for i in range(0, 64, 32):
                c.put(keys[i:i + 32], [page_bytes(k, PS) for k in keys[i:i + 32]], wait=True)
        for attack in ("none", "steal", "lie", "tails", "hold", "wakes"):
            stop = threading.Event()
            seen: dict[str, Any] = {}
            t = threading.Thread(target=healthy_reads, args=(home, keys, stop, seen))
            t.start()
            got: dict[str, Any] = {}
            t0 = time.monotonic()
            if attack != "none":
                r = subprocess.run(as_nobody(gid, [str(ADVERSARY), str(sock), "beta", attack, str(a.seconds)]),
                                   capture_output=True, text=True, cwd="/", timeout=120)
                got = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}
                got.pop("salt", None)
            time.sleep(max(0.0, a.seconds - (time.monotonic() - t0)))
            stop.set()
            t.join(60)
            rounds.append({"attack": attack, "attacker": got, "healthy": seen})
            print(json.dumps(rounds[-1]))
        flood = subprocess.Popen(as_nobody(gid, ["-c", FLOOD, str(sock), "8"]), stdout=subprocess.PIPE, text=True,
                                 cwd="/")
        assert flood.stdout is not None
        held = int(flood.stdout.readline())
        lat = []
        ok = 0
        for _ in range(20):
            t0 = time.perf_counter()
            try:
                with KVCacheClient.connect("adv", home=home, tenant="alpha", timeout=5):
                    ok += 1
            except Exception:
                pass
            lat.append(time.perf_counter() - t0)
        flood.kill()
        flood.wait()
        rounds.append({"attack": "flood", "attacker": {"silent_connections": held},
                       "healthy": {"connects": 20, "connected": ok, "p50_ms": round(pct(lat, 50) * 1e3, 2),
                                   "max_ms": round(max(lat) * 1e3, 2)}})
        print(json.dumps(rounds[-1]))
        st = counters(home)
        totals = {"clients_refused": st.clients_refused, "direct_refused": st.direct_refused,
                  "validation_failures": st.validation_failures, "evictions": st.evictions,
                  "handshakes_dropped": st.handshakes_dropped}
        print(json.dumps(totals))
    finally:
        svc.stop()
        for d, m in opened:
            if d.exists():
                os.chmod(d, m)
        shutil.rmtree(tmp, ignore_errors=True)
    write_record(a.json, {"rounds": rounds, "service": totals, "seconds": a.seconds}, a)


if __name__ == "__main__":
    main()
