#!/usr/bin/env python3
"""How kvstore's costs grow with the store: lookup latency, shared memory per slot,
start-up rebuild time and resident memory, for stores of 10^4 .. 10^7 slots.

    .venv/bin/python scripts/bench/scale.py --json docs/bench/scale.json

Each store is one sparse device file (4 KiB pages, so 8 KiB per slot) under
``--dir`` (default /dev/shm: a memory-backed device). Up to ``--fill`` slots
get a valid slot header written directly (as if pages had been saved), so the
rebuild parses real headers; the rest are holes. Per size it measures:

* rebuild: the service's own report of its start-up header scan and indexing;
* lookup: a 1,000-key batch through the client library (``contains``, 500 repetitions,
  half hits), and a 1,000-key prefix ``lookup`` whose first 100 keys are stored;
* shared memory: bytes of the control segment (slot table, key index, reference bits) per slot;
* resident memory (VmRSS) of the supervisor and of each I/O worker;
* restart from a checkpoint in which every slot is valid (synthetic entries, as a fully
  written device gives; the restart reads no header): time until the service answers, and
  the time it took to read and check the checkpoint.

Expected complexity: lookup O(batch), independent of the store size (a hash
index read in the client); shared memory O(slots) at 48 bytes per slot-table
entry, 8 bytes per index entry (7/4 entries per slot: 14 bytes) and a reference
byte, 63 in all; rebuild O(slots) (one 4 KiB read per slot).
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from kvstore import KVCacheClient
from kvstore.digests import key_id
from kvstore.config import ServiceConfig, load_store
from kvstore.service.checkpoint import checkpoint_path, layout_fingerprint, write_checkpoint
from kvstore.shm.control import ControlLayout
from kvstore.shm.slots import SLOT_DTYPE, VALID
from kvstore.storage.device import read_superblock
from kvstore.storage.header import SlotHeader
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

PS = 4096


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fill_headers(dev: str, home: Path, count: int) -> list[bytes]:
    """Write valid headers for the first ``count`` slots; return their keys."""
    import hashlib

    cfg = load_store("s", home)
    sb = read_superblock(dev)
    area = sb.areas[0]
    salt = cfg.tenant_salt("")  # the default tenant's
    keys = [b"scale/%d" % i for i in range(count)]
    fd = os.open(dev, os.O_WRONLY)
    block = bytearray(4096)
    try:
        for s, k in enumerate(keys):
            digest = hashlib.blake2b(key_id(k), digest_size=32, key=salt).digest()
            block[:128] = SlotHeader(cfg.uuid_bytes, 0, 0, s, 1000 + s, digest, PS, 0, 0).encode()
            os.pwrite(fd, block, area.offset + s * sb.slot_size)
    finally:
        os.close(fd)
    return keys


def restart_from_full_checkpoint(home: Path, dev: str, slots: int) -> dict:
    """Restart with a checkpoint in which every slot is VALID, as a fully written device gives (its
    entries are synthetic: the restart reads no header, so what the device holds does not matter
    until a read)."""
    cfg = load_store("s", home)
    sb = read_superblock(dev)
    table = np.zeros(slots, dtype=SLOT_DTYPE)
    rng = np.random.default_rng(1)
    for f in ("d0", "d1", "d2", "d3"):
        table[f] = rng.integers(0, 2**64, slots, dtype=np.uint64, endpoint=False)  # uniform, as BLAKE2b is
    table["gen"] = np.arange(1, slots + 1, dtype=np.uint64)
    table["length"] = PS
    table["state"] = VALID
    path = checkpoint_path(home, "s", "local")
    write_checkpoint(path, table, cfg.uuid_bytes, layout_fingerprint([sb]))
    del table
    logf = home / "service-s-local.log"
    seen = len(logf.read_text()) if logf.exists() else 0
    t0 = time.perf_counter()
    svc = ServiceProcess(home, "s", start_timeout=600).start()
    t_up = time.perf_counter() - t0
    try:
        log = svc.log.read_text()[seen:]
        m = re.search(r'"valid": (\d+), "age_s": [0-9.]+, "seconds": ([0-9.]+), "event": "slot table loaded', log)
        assert m, "the service did not load the checkpoint"
        with KVCacheClient.connect("s", home=home) as c:
            assert c.ping() < 10
        rss = rss_kib(svc.pid) / 1024
    finally:
        svc.stop()
    return {"valid": int(m.group(1)), "load_seconds": float(m.group(2)), "service_up_seconds": t_up,
            "supervisor_mib": rss}


def run(slots: int, fill: int, base: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvbench-scale-", dir=base))
    try:
        dev = work / "dev.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + slots * (4096 + PS))
        home = work / "mass"
        home.mkdir()
        make_store(home, "s", [str(dev)], PS, service=ServiceConfig(client_buffers=1000, max_clients=1))
        n_fill = min(fill, slots)
        t0 = time.perf_counter()
        keys = fill_headers(str(dev), home, n_fill)
        t_fill = time.perf_counter() - t0
        t0 = time.perf_counter()
        svc = ServiceProcess(home, "s", start_timeout=600).start()
        t_start = time.perf_counter() - t0
        try:
            m = re.search(r'"scanned": (\d+), "valid": (\d+), "seconds": ([0-9.]+)', svc.log.read_text())
            scanned, valid, scan_s = (int(m.group(1)), int(m.group(2)), float(m.group(3))) if m else (0, 0, 0.0)
            rng = np.random.default_rng(0)
            lat = []
            prefix = []
            with KVCacheClient.connect("s", home=home) as c:
                for r in range(500):
                    batch = [keys[i] for i in rng.integers(0, len(keys), 500)] + \
                            [b"absent/%d/%d" % (r, i) for i in range(500)]
                    t = time.perf_counter()
                    found = c.contains(batch)
                    lat.append(time.perf_counter() - t)
                    assert sum(found) == 500, "a filled key was not found"
                    # a prompt whose first 100 pages are stored: lookup counts the leading hits
                    chain = [keys[i] for i in rng.integers(0, len(keys), 100)] + \
                            [b"absent/%d/p%d" % (r, i) for i in range(900)]
                    t = time.perf_counter()
                    lead = c.lookup(chain)
                    prefix.append(time.perf_counter() - t)
                    assert lead == 100, lead
            lay = ControlLayout.of(slots)
            shm = lay.ref_offset + slots  # slot table, index, reference bits (the arena states excluded)
            rss = {"supervisor_mib": rss_kib(svc.pid) / 1024,
                   "workers_mib": [rss_kib(p) / 1024 for p in svc.worker_pids()]}
        finally:
            svc.stop()
        restart = restart_from_full_checkpoint(home, str(dev), slots)
        lat.sort()
        return {"slots": slots, "filled": n_fill, "fill_seconds": t_fill, "start_seconds": t_start,
                "scan": {"scanned": scanned, "valid": valid, "seconds": scan_s},
                "lookup_1000_p50_us": statistics.median(lat) * 1e6,
                "lookup_1000_p99_us": lat[int(len(lat) * 0.99) - 1] * 1e6,
                "prefix_lookup_1000_first_miss_at_100_p50_us": statistics.median(prefix) * 1e6,
                "shm_bytes_per_slot": shm / slots, "rss": rss, "restart_full_checkpoint": restart}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--slots", type=int, nargs="+", default=[10**4, 10**5, 10**6, 10**7])
    ap.add_argument("--fill", type=int, default=10**6, help="slots given a valid header (the rest are holes)")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    out = []
    for s in a.slots:
        r = run(s, a.fill, Path(a.dir))
        out.append(r)
        print(f"{s:>10,} slots ({r['filled']:,} with headers): rebuild {r['scan']['seconds']:.2f} s "
              f"(service up in {r['start_seconds']:.2f} s); lookup of 1,000 keys p50 {r['lookup_1000_p50_us']:.0f} us "
              f"p99 {r['lookup_1000_p99_us']:.0f} us (a 1,000-key prefix lookup whose first miss is key 100: "
              f"{r['prefix_lookup_1000_first_miss_at_100_p50_us']:.0f} us); {r['shm_bytes_per_slot']:.0f} shm bytes/slot; "
              f"RSS supervisor {r['rss']['supervisor_mib']:.0f} MiB, worker {r['rss']['workers_mib'][0]:.0f} MiB; "
              f"restart with every slot valid (checkpoint): up in {r['restart_full_checkpoint']['service_up_seconds']:.2f} s "
              f"(checkpoint read {r['restart_full_checkpoint']['load_seconds']:.2f} s)")
    write_record(a.json, out, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
