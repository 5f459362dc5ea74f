#!/usr/bin/env python3
"""Fuzz kvstore's decoders: the IPC request path of a live service, the peer wire decoder,
and the superblock and slot header parsers.

    .venv/bin/python scripts/fuzz.py --seconds 120 --json fuzz.json          # every target
    .venv/bin/python scripts/fuzz.py --target ipc --seconds 300

* ``ipc``: a hostile client of a real service writes random requests (random
  op, count, flags, keys, buffer indices, lengths, buffer states) into its
  shared-memory channel and rings the doorbell; after every request the
  service must still answer a well-behaved client, and at the end it must
  still serve correct pages and stop cleanly.
* ``peer``: ``crdt.delta.decode`` on random bytes and on mutations (bit
  flips, truncations, splices, field swaps) of valid messages.
* ``superblock`` / ``header``: the on-device parsers on random and mutated blocks.

Every decoder must either accept the input or reject it with its own error;
anything else (a crash, a hang, another exception) fails the run (exit 1).
Memory stays bounded: inputs are generated, tried and dropped one at a time.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np


from kvstore.crdt.delta import BadMessage, decode, encode
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.errors import CorruptPage
from kvstore.shm.slots import VALID, SlotMap
from kvstore.storage.header import SlotHeader
from kvstore.storage.superblock import Superblock, plan_areas
from kvstore.testing import script_args, write_record


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(b) > 8:
            i, j = sorted(rng.sample(range(len(b)), 2))
            b[i:j] = b[i:j][::-1]
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i + 8] = rng.choice([b"\xff" * 8, b"\x00" * 8, (2**63).to_bytes(8, "little")])
    if bytes(b) == data and b:  # a mutation that changed nothing (zeros over zeros): flip a bit
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def run_parser(name: str, seconds: float, seeds: list[bytes], parse: Callable[[bytes], Any],
               ok_errors: tuple[type[BaseException], ...]) -> dict[str, Any]:
    rng = random.Random(name)
    n = rejected = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        data = rng.randbytes(rng.randint(0, 5000)) if rng.random() < 0.2 else mutate(rng, rng.choice(seeds))
        try:
            parse(data)
        except ok_errors:
            rejected += 1
        n += 1
    return {"target": name, "inputs": n, "rejected": rejected, "seconds": seconds}


def fuzz_peer(seconds: float) -> dict[str, Any]:
    smap = SlotMap([[100] * 4, [100] * 4])
    r = np.zeros(20, REGISTER_DTYPE)
    r["area"], r["slot"], r["gen"], r["state"], r["length"] = 1, np.arange(20), np.arange(1, 21), VALID, 4096
    seeds = [encode("d", 1, 7, 0, r), encode("hb", 1, 7, 3), encode("q", 1, 7, 0),
             encode("a", 1, 7, 0, r, next_seq=20, snapshot=True, last=True)]
    return run_parser("peer", seconds, seeds, lambda d: decode(d, smap, 65536, 1), (BadMessage,))


def fuzz_superblock(seconds: float) -> dict[str, Any]:
    sb = Superblock(uuid.uuid4().bytes, "s", 1, 65536, 64 << 20, 0, 1, plan_areas(64 << 20, 65536, ["a", "b"]))
    return run_parser("superblock", seconds, [sb.encode()], Superblock.decode, (CorruptPage,))


def fuzz_header(seconds: float) -> dict[str, Any]:
    h = SlotHeader(uuid.uuid4().bytes, 0, 1, 2, 3, os.urandom(32), 4096, 99, 5)
    def parse(d: bytes) -> SlotHeader:
        got = SlotHeader.decode(d)
        if got is None:  # the parser's way of saying "not a valid header"
            raise LookupError
        return got

    return run_parser("header", seconds, [h.encode()], parse, (LookupError,))


def fuzz_ipc(seconds: float) -> dict[str, Any]:
    from kvstore import KVCacheClient
    from kvstore.config import ServiceConfig
    from kvstore.quickstart import page_bytes
    from kvstore.ipc import connection as P
    from kvstore.ipc import lease as A
    from kvstore.testing import ServiceProcess, make_store

    ps = 16384
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-"))
    rng = random.Random("ipc")
    res: dict[str, Any] = {"target": "ipc", "inputs": 0, "answered": 0, "unanswered": 0, "dropped": 0,
                           "unconsumed": 0}
    try:
        dev = tmp / "dev.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 256 * (4096 + ps))
        make_store(tmp, "fz", [str(dev)], ps, service=ServiceConfig(client_buffers=16, max_clients=4))
        with ServiceProcess(tmp, "fz") as svc:
            good_keys = [b"good/%d" % i for i in range(16)]
            with KVCacheClient.connect("fz", home=tmp) as good, KVCacheClient.connect("fz", home=tmp) as evil:
                good.put(good_keys, [page_bytes(k, ps) for k in good_keys], wait=True)
                ch = evil._chan  # the hostile client writes its channel by hand
                lease = evil._lease
                t_end = time.monotonic() + seconds
                seq = 1 << 40
                while time.monotonic() < t_end:
                    # a descriptor the service cannot hold (it holds only POSTED ones)
                    free = [x for x in ch.desc if x.state != P.D_POSTED]
                    if not free:
                        for x in ch.desc:  # take the old posts back (unnamed by any record)
                            x.set_state(P.D_FREE)
                        continue
                    d = rng.choice(free)
                    di = d.index
                    n = rng.randint(0, ch.max_batch + 4)
                    d.keys[:] = np.frombuffer(rng.randbytes(d.keys.size), np.uint8).reshape(d.keys.shape)
                    for i in range(ch.max_batch):
                        # out-of-range ids, other clients' ids, its own lease
                        d.bufs[i] = rng.choice([rng.randrange(-5, 5000), rng.randrange(ch.max_batch),
                                                lease.start + rng.randrange(len(lease))])
                        d.lengths[i] = rng.choice([0, ps, ps + 1, rng.randrange(1 << 32)])
                    for b in lease:  # random states, including ones the protocol forbids
                        evil._arena.set_state(b, rng.randrange(5))
                    seq += 1
                    h = d.head
                    h["seq"] = rng.choice([seq, seq, rng.randrange(1 << 60)])
                    h["op"] = rng.choice([0, 1, 2, 3, 4, 5, 6, 9, 2**32 - 1])
                    h["count"] = n
                    h["flags"] = rng.randrange(1 << 32)
                    d.set_cancel(rng.choice([0, 0, 1, rng.randrange(1 << 32)]))
                    state = rng.choice([P.D_POSTED, P.D_POSTED, P.D_POSTED, P.D_FREE, rng.randrange(1 << 32)])
                    d.set_state(state)
                    named = rng.choice([di, di, di, rng.randrange(P.NDESC + 3)])
                    try:  # a record naming this descriptor, another one, or none that exists
                        ch.requests.put_nowait((seq, named, 0))
                    except Exception:
                        pass
                    evil._doorbell.post()
                    res["inputs"] += 1
                    # a posted descriptor named by its record must be answered, whatever it holds;
                    # any other record must at least be consumed
                    must_answer = named == di and state == P.D_POSTED
                    deadline = time.monotonic() + 2.0
                    ok = False
                    while time.monotonic() < deadline:
                        if must_answer and d.state == P.D_ANSWERED:
                            ok = True
                            break
                        if not must_answer and len(ch.requests) == 0:
                            ok = True
                            break
                        time.sleep(0.0002)
                    for x in ch.desc:
                        if x.state == P.D_ANSWERED:
                            x.set_state(P.D_FREE)
                    if must_answer:
                        res["answered" if ok else "unanswered"] += 1
                    else:
                        res["dropped" if ok else "unconsumed"] += 1
                    if res["inputs"] % 50 == 0:  # the service still serves a good client, correctly
                        with good.get(good_keys) as b:
                            assert all(v is not None and bytes(v) == page_bytes(k, ps).tobytes()
                                       for k, v in zip(good_keys, b)), "good client got a wrong or missing page"
                    if svc.proc is not None and svc.proc.poll() is not None:
                        raise AssertionError(f"service died: {svc.log.read_text()[-2000:]}")
                for b in lease:
                    evil._arena.set_state(b, A.FREE)
                with good.get(good_keys) as b:
                    assert all(v is not None and bytes(v) == page_bytes(k, ps).tobytes() for k, v in zip(good_keys, b))
            rc = svc.stop()
            assert rc == 0, f"service did not stop cleanly ({rc})"
            assert not svc.leftovers()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["seconds"] = seconds
    return res


TARGETS = {"ipc": fuzz_ipc, "peer": fuzz_peer, "superblock": fuzz_superblock, "header": fuzz_header}


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--target", action="append", choices=sorted(TARGETS))
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    a = ap.parse_args()
    out = []
    for t in a.target or list(TARGETS):
        r = TARGETS[t](a.seconds)
        r["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out.append(r)
        print(json.dumps(r))
    write_record(a.json, out, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
