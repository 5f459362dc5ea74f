#!/usr/bin/env python3
"""Ping latency of a healthy client beside clients that trickle or garble their hellos, against
the same client's pings with nobody else connecting (a hostile local client must not stall others).

    .venv/bin/python scripts/bench/handshake_stall.py --tricklers 8 --json docs/bench/handshake_stall.json

One service on a plain file device. Phase 1: the healthy client pings ``--pings`` times alone.
Phase 2: the same while ``--tricklers`` threads each start a valid hello and send it one byte
every ``--interval`` seconds (reconnecting when the service drops them), and one thread
connects and sends garbage in a loop. Reports p50/p99 of both phases, their p99 ratio, and how
many handshakes the service dropped. Before the non-blocking handshake, one trickler held a
healthy client's ping up by 4-6 s.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.ipc import connection as P
from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.testing import ServiceProcess, make_store, script_args, write_record


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(len(s) * q / 100.0)) - 1))]


def pings(c: KVCacheClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(c.ping())
        time.sleep(0.002)
    return out


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--tricklers", type=int, default=8)
    ap.add_argument("--interval", type=float, default=0.3, help="seconds between a trickler's bytes")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-hs-"))
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        dev = tmp / "dev.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 16 * (4096 + 16384))
        make_store(tmp, "hs", [str(dev)], 16384, service=ServiceConfig(client_buffers=8, max_clients=4))
        with ServiceProcess(tmp, "hs") as svc:
            frame = P.encode_frame({"v": P.VERSION, "op": "hello", "tenant": "", "pad": "x" * 100})

            def trickle() -> None:
                while not stop.is_set():
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(svc.sock))
                        for b in frame:
                            if stop.wait(a.interval):
                                return
                            try:
                                s.send(bytes([b]))
                            except OSError:
                                break

            def garble() -> None:
                while not stop.is_set():
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(svc.sock))
                        try:
                            s.sendall(b"\xff\xff\xff\x7f" + b"junk" * 64)
                            s.recv(100)
                        except OSError:
                            pass
                    stop.wait(0.01)

            with KVCacheClient.connect("hs", home=tmp) as c:
                pings(c, 200)  # warm up
                alone = pings(c, a.pings)
                threads = [threading.Thread(target=trickle) for _ in range(a.tricklers)]
                threads.append(threading.Thread(target=garble))
                for t in threads:
                    t.start()
                time.sleep(1.0)
                beside = pings(c, a.pings)
            stop.set()
            for t in threads:
                t.join(10)
            seg = Segment.attach(svc.prefix + "stats")
            dropped = StatsBlock.attach(seg.buf).snapshot().service.handshakes_dropped
            seg.close()
    finally:
        stop.set()
        shutil.rmtree(tmp, ignore_errors=True)
    rep = {"pings": a.pings, "tricklers": a.tricklers, "interval_s": a.interval,
           "alone_p50_us": round(pct(alone, 50) * 1e6, 1), "alone_p99_us": round(pct(alone, 99) * 1e6, 1),
           "beside_p50_us": round(pct(beside, 50) * 1e6, 1), "beside_p99_us": round(pct(beside, 99) * 1e6, 1),
           "beside_max_us": round(max(beside) * 1e6, 1), "handshakes_dropped": dropped}
    rep["p99_ratio"] = round(rep["beside_p99_us"] / rep["alone_p99_us"], 2)
    print(json.dumps(rep))
    write_record(a.json, rep, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
