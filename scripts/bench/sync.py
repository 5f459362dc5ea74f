#!/usr/bin/env python3
"""Replication costs: merge rate, bytes per update, catch-up time, visibility latency.

    .venv/bin/python scripts/bench/sync.py --json docs/bench/sync.json

1. **merge**: the supervisor's join of peer registers into a slot table of
   ``--slots`` slots (``crdt.merge.apply`` + indexing what became VALID), in
   batches of 65,536 random registers: records per second.
2. **wire**: bytes per update of a delta message of ``flush_records`` updates
   (msgpack envelope + 56-byte registers).
3. **catch-up**: a peer that missed ``--catchup`` updates: the owner reads them
   from its delta log and encodes answer chunks, the peer decodes, validates,
   merges and indexes them; in one process, no sockets (the loopback transfer
   of ~56 MB is measured by the visibility run's transport instead).
4. **visibility**: ``--servers`` real sync agent processes (the production
   code: CurveZMQ PUB/SUB on 127.0.0.1, validation, rings) with this script as
   every server's supervisor: it feeds each agent's out ring at a total of
   ``--rate`` updates/s, stamping each with its send time, and reads the
   other agents' in rings; latency = arrival - send, over every (update,
   receiver) pair. The script's own polling adds up to ~1 ms.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import numpy as np


import zmq

from kvstore.config import SyncConfig
from kvstore.crdt.agent import AgentParams, Peer, agent_main
from kvstore.crdt.delta import decode, encode
from kvstore.crdt.log import K_DELTA, DeltaLog, SyncRings, to_sync
from kvstore.crdt.merge import apply, gids_of
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.shm.index import ENTRY_DTYPE, KeyIndex, index_capacity
from kvstore.shm.segment import Segment
from kvstore.shm.slots import RETIRED, SLOT_DTYPE, VALID, SlotMap
from kvstore.shm.stats import StatsBlock, stats_nbytes
from kvstore.shm.wake import WakeReader, unlink_wake
from kvstore.testing import free_port_pair, script_args, write_record

PAGE = 1 << 20


def random_regs(rng: np.random.Generator, smap: SlotMap, n: int, area: int | None = None) -> np.ndarray:
    r = np.zeros(n, REGISTER_DTYPE)
    r["device"] = rng.integers(0, smap.n_devices, n)
    r["area"] = rng.integers(0, smap.n_areas, n) if area is None else area
    r["slot"] = rng.integers(0, smap.counts[0][0], n)
    r["gen"] = rng.integers(1, 1 << 40, n)
    for f in ("d0", "d1", "d2", "d3"):
        r[f] = rng.integers(0, 1 << 64, n, dtype=np.uint64, endpoint=False)  # uniform, as BLAKE2b is
    r["length"] = PAGE
    r["state"] = np.where(rng.random(n) < 0.8, VALID, RETIRED)
    return r


def merge_into(slots: np.ndarray, index: KeyIndex, smap: SlotMap, regs: np.ndarray) -> None:
    """What SyncLink.drain does with peer registers."""
    changed = apply(slots, gids_of(smap, regs), regs)
    index.index_slots(changed[slots["state"][changed] == VALID])


def bench_merge(total_slots: int) -> dict[str, float]:
    areas = 4
    smap = SlotMap([[total_slots // areas] * areas])
    slots = np.zeros(smap.total, SLOT_DTYPE)
    index = KeyIndex(np.zeros(index_capacity(smap.total), ENTRY_DTYPE), slots, init=True)
    rng = np.random.default_rng(1)
    batches = [random_regs(rng, smap, 1 << 16) for _ in range(16)]
    slots.view(np.uint8)[:] = 0  # touch every page first, as the service's rebuild has
    t0 = time.perf_counter()
    for b in batches:
        apply(slots, gids_of(smap, b), b)
    t_apply = time.perf_counter() - t0
    slots = np.zeros(smap.total, SLOT_DTYPE)
    slots.view(np.uint8)[:] = 0
    index = KeyIndex(np.zeros(index_capacity(smap.total), ENTRY_DTYPE), slots, init=True)
    t0 = time.perf_counter()
    for b in batches:
        merge_into(slots, index, smap, b)
    t_all = time.perf_counter() - t0
    n = sum(len(b) for b in batches)
    return {"records": n, "slots": smap.total, "apply_records_per_s": n / t_apply,
            "apply_and_index_records_per_s": n / t_all}


def bench_wire(flush_records: int) -> dict[str, float]:
    smap = SlotMap([[100_000] * 4])
    regs = random_regs(np.random.default_rng(2), smap, flush_records, area=1)
    msg = encode("d", 1, time.time_ns(), 123456789, regs)
    return {"records_per_message": flush_records, "message_bytes": len(msg),
            "bytes_per_update": len(msg) / flush_records}


def bench_catchup(n: int, total_slots: int) -> dict[str, float]:
    areas = 4
    smap = SlotMap([[total_slots // areas] * areas])
    rng = np.random.default_rng(3)
    log = DeltaLog(1 << (n - 1).bit_length())
    for s in range(0, n, 1 << 16):
        log.append(random_regs(rng, smap, min(1 << 16, n - s), area=1))
    slots = np.zeros(smap.total, SLOT_DTYPE)
    slots.view(np.uint8)[:] = 0
    index = KeyIndex(np.zeros(index_capacity(smap.total), ENTRY_DTYPE), slots, init=True)
    t0 = time.perf_counter()
    tail = log.since(0)
    assert tail is not None
    nbytes = 0
    for s in range(0, len(tail), 1 << 14):
        frame = encode("a", 1, 7, s, tail[s:s + (1 << 14)], next_seq=log.next, snapshot=False,
                       last=s + (1 << 14) >= len(tail))
        nbytes += len(frame)
        m = decode(frame, smap, PAGE, 1)
        merge_into(slots, index, smap, m.records)
    dt = time.perf_counter() - t0
    return {"updates": n, "seconds": dt, "bytes": nbytes}




def bench_visibility(servers: int, rate: float, seconds: float) -> dict[str, Any]:
    import multiprocess

    sync = SyncConfig()
    smap = SlotMap([[1 << 16] * servers])
    keys = [zmq.curve_keypair() for _ in range(servers)]
    ports = [free_port_pair() for _ in range(servers)]
    tag = f"kvs.bench{os.getpid()}."
    segs, sems, procs = [], [], []
    bells: list[WakeReader] = []  # the supervisor's end of each doorbell (its agent posts it)
    rings, stat_blocks = [], []
    ctx = multiprocess.get_context("spawn")
    try:
        for i in range(servers):
            seg = Segment.create(f"{tag}{i}.sync", SyncRings.nbytes())
            st = Segment.create(f"{tag}{i}.stats", stats_nbytes(1))
            stat_blocks.append(StatsBlock(st.buf, 1, init=True))
            sems.append(f"{tag}{i}.wake.bell")
            bells.append(WakeReader.create(sems[-1]))
            segs += [seg, st]
            rings.append(SyncRings(seg.buf))
        for i in range(servers):
            peers = tuple(Peer(f"s{j}", j, f"tcp://127.0.0.1:{ports[j]}", f"tcp://127.0.0.1:{ports[j] + 1}",
                               keys[j][0]) for j in range(servers) if j != i)
            p = AgentParams(store="bench", server=f"s{i}", area=i, epoch=1 + i, pub=f"tcp://127.0.0.1:{ports[i]}",
                            router=f"tcp://127.0.0.1:{ports[i] + 1}", public_key=keys[i][0], secret_key=keys[i][1],
                            peers=peers, counts=tuple(tuple(c) for c in smap.counts), page_size=PAGE,
                            sync_segment=f"{tag}{i}.sync", stats_name=f"{tag}{i}.stats", doorbell=sems[i],
                            flush_interval_s=sync.flush_interval_s, flush_records=sync.flush_records,
                            heartbeat_s=sync.heartbeat_s, request_timeout_s=sync.request_timeout_s)
            pr = ctx.Process(target=agent_main, args=(p,), daemon=True)
            pr.start()
            procs.append(pr)
        time.sleep(2.0)  # let every SUB connect (slow joiners)
        for r in rings:  # drop what warm-up produced
            r.inn.get_batch(1 << 16)
        seq = [0] * servers
        lat: list[float] = []
        sent = 0
        t_start = time.monotonic()
        next_t = t_start
        period = 0.001
        per_tick = rate * period / servers
        carry = 0.0
        while time.monotonic() - t_start < seconds:
            now = time.monotonic()
            if now >= next_t:
                next_t += period
                carry += per_tick
                k = int(carry)
                carry -= k
                if k:
                    stamp = time.monotonic_ns()
                    for i in range(servers):
                        regs = np.zeros(k, REGISTER_DTYPE)
                        regs["area"] = i
                        regs["slot"] = (np.arange(seq[i], seq[i] + k)) % (1 << 16)
                        regs["gen"] = stamp
                        regs["state"] = VALID
                        regs["length"] = PAGE
                        rings[i].out.put_many(to_sync(regs, K_DELTA, 0, seq[i]))
                        seq[i] += k
                        sent += k
            for i in range(servers):
                got = rings[i].inn.get_batch(1 << 16)
                if len(got):
                    arrived = time.monotonic_ns()
                    lat.extend(((arrived - got["gen"].astype(np.int64)) / 1e6).tolist())
            time.sleep(0.0002)
        deadline = time.monotonic() + 3
        while len(lat) < sent * (servers - 1) and time.monotonic() < deadline:
            for i in range(servers):
                got = rings[i].inn.get_batch(1 << 16)
                if len(got):
                    lat.extend(((time.monotonic_ns() - got["gen"].astype(np.int64)) / 1e6).tolist())
            time.sleep(0.0005)
        lat.sort()
        out = {"servers": servers, "rate_updates_per_s": rate, "seconds": seconds, "sent": sent,
               "deliveries_expected": sent * (servers - 1), "deliveries": len(lat),
               "p50_ms": statistics.median(lat) if lat else None,
               "p99_ms": lat[int(len(lat) * 0.99) - 1] if lat else None}
        return out
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.join(5)
        del rings, stat_blocks
        for s in segs:
            s.close()
            s.unlink()
        for b in bells:
            b.close()
        for n in sems:
            unlink_wake(n)


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--slots", type=int, default=1_000_000, help="slot table size for merge and catch-up")
    ap.add_argument("--catchup", type=int, default=1_000_000, help="updates a peer missed")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=20_000, help="total updates/s in the visibility run")
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    res: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
    res["merge"] = bench_merge(a.slots)
    print(f"merge: {res['merge']['apply_records_per_s'] / 1e6:.2f} M records/s (join only), "
          f"{res['merge']['apply_and_index_records_per_s'] / 1e6:.2f} M records/s (join + index), "
          f"{a.slots:,} slots")
    res["wire"] = bench_wire(SyncConfig().flush_records)
    print(f"wire: {res['wire']['bytes_per_update']:.1f} bytes per update "
          f"({res['wire']['records_per_message']} updates per message)")
    res["catchup"] = bench_catchup(a.catchup, a.slots)
    print(f"catch-up: {a.catchup:,} updates in {res['catchup']['seconds']:.2f} s "
          f"(log -> encode -> decode+validate -> merge+index, one process)")
    res["visibility"] = bench_visibility(a.servers, a.rate, a.seconds)
    v = res["visibility"]
    print(f"visibility: {a.servers} agents, {a.rate:,.0f} updates/s total for {a.seconds:.0f} s: "
          f"{v['deliveries']:,}/{v['deliveries_expected']:,} deliveries, p50 {v['p50_ms']:.2f} ms, "
          f"p99 {v['p99_ms']:.2f} ms")
    write_record(a.json, res, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
