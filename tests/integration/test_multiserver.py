"""Several services of one store on one machine: replication, catch-up, authentication, hostile peers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvstore import KVCacheClient
from kvstore.config import load_store
from kvstore.crdt.delta import encode
from kvstore.crdt.serverkeys import load_keypair
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment
from kvstore.shm.slots import VALID
from kvstore.shm.stats import StatsBlock
from kvstore.testing import free_port_pair, make_store, wait_for

pytestmark = pytest.mark.integration

PS = 16 << 10




def stats(svc: Any) -> Any:
    seg = Segment.attach(svc.prefix + "stats")
    try:
        return StatsBlock.attach(seg.buf).snapshot().service
    finally:
        seg.close()




def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}/{i}".encode() for i in range(n)]


def make_cluster(home: Path, devices: Any, names: list[str], slots_per_area: int = 200) -> list[str]:
    devs = devices.make(2, (1 << 20) + len(names) * slots_per_area * (4096 + PS))
    specs = [f"{n}=127.0.0.1:{free_port_pair()}" for n in names]
    make_store(home, "m", devs, PS, specs)
    return devs


def put_pages(home: Path, server: str, keys: list[bytes]) -> Any:
    with KVCacheClient.connect("m", server=server, home=home) as c:
        return c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)


def read_all(home: Path, server: str | None, keys: list[bytes], store: str = "m") -> tuple[int, int, int]:
    """(hits, misses, wrong) reading ``keys`` on ``server``."""
    hits = misses = wrong = 0
    with KVCacheClient.connect(store, server=server, home=home) as c:
        for s in range(0, len(keys), c.max_batch):
            ks = keys[s:s + c.max_batch]
            with c.get(ks) as b:
                for k, v in zip(ks, b):
                    if v is None:
                        misses += 1
                    elif np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, PS)):
                        hits += 1
                    else:
                        wrong += 1
    return hits, misses, wrong


def visible(home: Path, server: str, keys: list[bytes]) -> int:
    with KVCacheClient.connect("m", server=server, home=home) as c:
        return c.lookup(keys)


def test_three_servers_share_pages(home: Path, file_devices: Any, services: Any) -> None:
    names = ["a", "b", "c"]
    make_cluster(home, file_devices, names)
    svcs = {n: services(home, "m", n) for n in names}
    for n in names:
        assert put_pages(home, n, keys_of(n, 60)).stored == 60
    for reader in names:
        for owner in names:
            keys = keys_of(owner, 60)
            # visibility is asynchronous: wait with a deadline, never a fixed sleep
            assert wait_for(lambda: visible(home, reader, keys) == 60), f"{reader} never saw {owner}'s pages"
            assert read_all(home, reader, keys) == (60, 0, 0)
    # a key another server already holds is skipped, not written again
    r = put_pages(home, "a", keys_of("b", 10) + keys_of("c", 10))
    assert (r.stored, r.skipped) == (0, 20)
    for n in names:
        st = stats(svcs[n])
        assert st.sync_records_received >= 120 and st.sync_messages_rejected == 0
        # a gauge the service refreshes every second: the puts may be younger than that
        assert wait_for(lambda: stats(svcs[n]).own_slots_valid == 60)


def test_restarted_server_catches_up(home: Path, file_devices: Any, services: Any) -> None:
    make_cluster(home, file_devices, ["a", "b"])
    sa = services(home, "m", "a")
    sb = services(home, "m", "b")
    assert put_pages(home, "a", keys_of("early", 40)).stored == 40
    assert wait_for(lambda: visible(home, "b", keys_of("early", 40)) == 40)
    assert sb.stop() == 0
    assert put_pages(home, "a", keys_of("while-down", 40)).stored == 40  # b misses these deltas
    sb2 = services(home, "m", "b")
    # b rebuilds from slot headers and asks a for what it missed
    both = keys_of("early", 40) + keys_of("while-down", 40)
    assert wait_for(lambda: visible(home, "b", both) == 80)
    assert read_all(home, "b", both) == (80, 0, 0)
    # and a learns b's new writes after b's restart (a new epoch of b)
    assert put_pages(home, "b", keys_of("b-after", 30)).stored == 30
    assert wait_for(lambda: visible(home, "a", keys_of("b-after", 30)) == 30)
    assert stats(sa).sync_messages_rejected == 0 and stats(sb2).sync_messages_rejected == 0


def test_killed_sync_agent_is_restarted(home: Path, file_devices: Any, services: Any) -> None:
    import os
    import signal

    make_cluster(home, file_devices, ["a", "b"])
    sa = services(home, "m", "a")
    services(home, "m", "b")
    kids = set(sa.children())
    agent = [k for k in kids if k not in sa.worker_pids() and "resource_tracker" not in
             Path(f"/proc/{k}/cmdline").read_text()]
    assert len(agent) == 1
    os.kill(agent[0], signal.SIGKILL)
    assert wait_for(lambda: stats(sa).sync_restarts == 1)
    assert put_pages(home, "a", keys_of("after-kill", 20)).stored == 20
    assert wait_for(lambda: visible(home, "b", keys_of("after-kill", 20)) == 20)


def test_sync_address_held_by_another_socket_is_reported_and_taken_once_free(home: Path, file_devices: Any,
                                                                           services: Any) -> None:
    """What an outgoing connection whose local port is the sync port does (the agent cannot bind):
    the service says so in words, serves its own pages on, and syncs once the port is free."""
    import socket

    from kvstore.tui.source import LiveSource

    make_cluster(home, file_devices, ["a", "b"])
    port = int(load_store("m", home).servers[1].sync.rsplit(":", 1)[1])
    holder = socket.socket()
    holder.bind(("127.0.0.1", port + 1))  # b's anti-entropy ROUTER port
    holder.listen()
    try:
        services(home, "m", "a")
        sb = services(home, "m", "b")
        src = LiveSource("m", home)
        assert wait_for(lambda: any(w["event"] == "sync agent could not bind the sync address (in use); restarting"
                                    for w in src.snapshot()["b"]["warnings"]))
        assert "Traceback" not in sb.log.read_text()
        assert put_pages(home, "b", keys_of("b-alone", 10)).stored == 10
        assert read_all(home, "b", keys_of("b-alone", 10)) == (10, 0, 0)
        assert put_pages(home, "a", keys_of("held", 20)).stored == 20
        assert visible(home, "b", keys_of("held", 20)) == 0
    finally:
        holder.close()
    assert wait_for(lambda: visible(home, "b", keys_of("held", 20)) == 20)
    assert wait_for(lambda: visible(home, "a", keys_of("b-alone", 10)) == 10)
    assert read_all(home, "b", keys_of("held", 20)) == (20, 0, 0)


def _rogue_sub(endpoint: str, server_key: bytes, public: bytes, secret: bytes) -> tuple[zmq.Context[Any], Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server_key
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.linger = 0
    s.connect(endpoint)
    return ctx, s


def test_unauthorized_key_is_refused(home: Path, file_devices: Any, services: Any) -> None:
    make_cluster(home, file_devices, ["a", "b"])
    sa = services(home, "m", "a")
    services(home, "m", "b")
    cfg = load_store("m", home)
    a_pub = cfg.servers[0].public_key.encode()
    endpoint = cfg.servers[0].endpoints[0]
    rogue_pub, rogue_sec = zmq.curve_keypair()
    b_pub, b_sec = load_keypair("m", "b", home)
    rctx, rogue = _rogue_sub(endpoint, a_pub, rogue_pub, rogue_sec)
    gctx, good = _rogue_sub(endpoint, a_pub, b_pub, b_sec)  # positive control: an allowed key
    try:
        time.sleep(0.5)
        put_pages(home, "a", keys_of("secret", 10))
        got_good = good.poll(3000)  # heartbeats and deltas flow to an allowed key
        got_rogue = rogue.poll(500)
        assert got_good, "control subscriber with an allowed key received nothing"
        assert not got_rogue, "a subscriber with an unknown key received peer traffic"
    finally:
        rogue.close(0)
        good.close(0)
        rctx.term()
        gctx.term()
    assert stats(sa).sync_messages_rejected == 0


def test_malformed_truncated_and_forged_messages_are_dropped(home: Path, file_devices: Any,
                                                            services: Any) -> None:
    make_cluster(home, file_devices, ["a", "b", "c"])
    sa = services(home, "m", "a")
    cfg = load_store("m", home)
    # impersonate b at its sync address with b's real keys (what a compromised peer could send)
    b_pub, b_sec = load_keypair("m", "b", home)
    ctx: zmq.Context[Any] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.curve_server, pub.curve_publickey, pub.curve_secretkey = True, b_pub, b_sec
    pub.zap_domain = b"kvstore"
    pub.linger = 0
    pub.bind(cfg.servers[1].endpoints[0])
    try:
        def regs(area: int, slot: int, n: int = 2) -> np.ndarray:
            r = np.zeros(n, REGISTER_DTYPE)
            r["area"], r["slot"], r["gen"], r["length"], r["state"] = area, slot, 5, PS, VALID
            r["d0"] = 42
            return r

        # a register whose digest is a real key's (as the service salts it), at a slot b never wrote
        import hashlib

        from kvstore.digests import key_id

        digest = hashlib.blake2b(key_id(b"lure"), digest_size=32, key=cfg.tenant_salt("")).digest()
        lure = regs(1, 3, 1)
        lure["d0"], lure["d1"], lure["d2"], lure["d3"] = np.frombuffer(digest, "<u8")
        good = encode("d", 1, 1, 0, lure)
        bad = [
            b"\x00garbage",                                         # not msgpack
            msgpack.packb({"v": 1, "t": "d", "o": 1}),              # fields missing
            good[:-7],                                              # truncated
            encode("d", 2, 1, 0, regs(2, 1)),                       # about owner c: forged
            encode("d", 1, 1, 0, regs(0, 1)),                       # b claiming a's area
            encode("d", 1, 1, 0, regs(1, 10_000)),                  # slot out of range
            msgpack.packb({"v": 9, "t": "d", "o": 1, "e": 1, "s": 0, "r": b""}),  # unknown version
        ]

        def sent_all() -> bool:
            for m in bad:
                pub.send(m)
            return stats(sa).sync_messages_rejected >= len(bad)

        assert wait_for(sent_all, 20), f"rejected: {stats(sa).sync_messages_rejected}"
        # the agent survived all of it and still accepts a well-formed update from b ...
        before = stats(sa).sync_records_received
        assert wait_for(lambda: (pub.send(good), stats(sa).sync_records_received > before)[1])
        # ... which points at a slot b never wrote: a lookup believes it, reading it is a miss
        # (header validation), never wrong bytes, and the location is dropped (by the supervisor,
        # once it has the device worker's report of the failed direct read)
        with KVCacheClient.connect("m", server="a", home=home) as c:
            assert c.lookup([b"lure"]) == 1
            with c.get([b"lure"]) as v:
                assert v[0] is None
            assert wait_for(lambda: c.lookup([b"lure"]) == 0, timeout=60)
            # the service as a whole keeps serving
            assert c.put(keys_of("ok", 4), [page_bytes(k, PS) for k in keys_of("ok", 4)], wait=True).stored == 4
        assert stats(sa).validation_failures == 1
    finally:
        pub.close(0)
        ctx.term()


def test_hit_hints_keep_pages_peers_read(home: Path, file_devices: Any, services: Any) -> None:
    """a's CLOCK spares the pages b keeps reading: b's hit hints set their reference bits."""
    (dev,) = file_devices.make(1, (1 << 20) + 2 * 20 * (4096 + PS))  # 20 slots per server
    make_store(home, "m", [dev], PS, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
    sa = services(home, "m", "a")
    services(home, "m", "b")
    first = keys_of("p", 20)
    assert put_pages(home, "a", first).stored == 20
    assert put_pages(home, "a", keys_of("extra", 1)).stored == 1  # one sweep: every reference bit cleared, p/0 out
    hot = first[5:10]
    assert wait_for(lambda: visible(home, "b", hot) == 5)
    for _ in range(3):
        assert read_all(home, "b", hot) == (5, 0, 0)
    assert wait_for(lambda: stats(sa).hints_received >= 5)
    assert put_pages(home, "a", keys_of("new", 10)).stored == 10  # evicts 10 unreferenced pages
    with KVCacheClient.connect("m", server="a", home=home) as c:
        held = c.contains(first)
    assert all(held[5:10]), held          # the pages b read survived
    assert sum(held) == 9, held           # 19 - 10 evicted; the hot five among the survivors


def test_router_identity_is_the_authenticated_key_not_the_routing_id(home: Path, file_devices: Any,
                                                                    services: Any) -> None:
    """c (an allowed key) connects to b's ROUTER calling itself "a": its hint is dropped; under its
    own name it is accepted. Before, the self-chosen routing id named the sender."""
    make_cluster(home, file_devices, ["a", "b", "c"])
    sb = services(home, "m", "b")
    cfg = load_store("m", home)
    c_pub, c_sec = load_keypair("m", "c", home)
    ctx: zmq.Context[Any] = zmq.Context()

    def dealer(routing_id: bytes) -> Any:
        d = ctx.socket(zmq.DEALER)
        d.curve_publickey, d.curve_secretkey = c_pub, c_sec
        d.curve_serverkey = cfg.servers[1].public_key.encode()
        d.routing_id = routing_id
        d.linger = 0
        d.connect(cfg.servers[1].endpoints[1])
        return d

    hint = np.zeros(1, REGISTER_DTYPE)
    hint["area"], hint["slot"], hint["gen"], hint["length"], hint["state"] = 1, 3, 5, PS, VALID
    msg = encode("h", 1, 0, 0, hint)
    try:
        spoof = dealer(b"a")
        before = stats(sb).sync_messages_rejected
        assert wait_for(lambda: (spoof.send(msg), stats(sb).sync_messages_rejected > before)[1], 20)
        assert stats(sb).hints_received == 0
        honest = dealer(b"c")
        assert wait_for(lambda: (honest.send(msg), stats(sb).hints_received > 0)[1], 20)
    finally:
        ctx.destroy(0)
