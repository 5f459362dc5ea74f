"""KV events for routers: a real ZMQ subscriber decodes the service's batches with msgspec
structs shaped like vLLM's (tagged union, omit_defaults), and replays from a sequence number."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig, load_store
from kvstore.service.events import END_SEQ, block_hash
from kvstore.testing import free_port_pair, make_store

pytestmark = pytest.mark.integration
PS = 16 << 10


class Event(msgspec.Struct, tag=True, omit_defaults=True):  # the schema of vLLM's KVCacheEvent
    pass


class BlockStored(Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def collect(sub: zmq.Socket[Any], until: Any, timeout: float = 10.0) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + timeout
    while not until(events) and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            events.extend(DECODER.decode(payload).events)
    return events


def test_stored_removed_and_replay(home: Path, file_devices: Any, services: Any) -> None:
    port = free_port_pair()
    devs = file_devices.make(1, (1 << 20) + 8 * (4096 + PS))  # 8 slots: the second put evicts
    make_store(home, "ev", devs, PS, events={"local": f"127.0.0.1:{port}"},
               service=ServiceConfig(client_buffers=8, max_clients=2))
    services(home, "ev")
    salt = load_store("ev", home).tenant_salt("").hex()  # the default tenant's
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # subscription propagation (slow joiner); replay covers what it misses
        first = [b"page-%d" % i for i in range(8)]
        with KVCacheClient.connect("ev", home=home) as c:
            c.put(first, [bytes(PS)] * 8, wait=True)
            want = {block_hash(salt, k) for k in first}
            got = collect(sub, lambda ev: want <= {h for e in ev if isinstance(e, BlockStored) for h in e.block_hashes})
            stored = {h for e in got if isinstance(e, BlockStored) for h in e.block_hashes}
            assert want <= stored
            assert all(e.medium == "kvstore:ev" for e in got if not isinstance(e, AllBlocksCleared))
            second = [b"more-%d" % i for i in range(8)]
            c.put(second, [bytes(PS)] * 8, wait=True)  # the store holds 8: the first pages are evicted
            gone = collect(sub, lambda ev: want <= {h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes})
            assert want <= {h for e in gone if isinstance(e, BlockRemoved) for h in e.block_hashes}
        # replay from seq 0: the start-up AllBlocksCleared comes first, then everything, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port + 1}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[Any] = []
        seqs = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            replayed.extend(DECODER.decode(payload).events)
        dealer.close(0)
        assert seqs == list(range(len(seqs))) and seqs
        assert isinstance(replayed[0], AllBlocksCleared)
        assert want <= {h for e in replayed if isinstance(e, BlockStored) for h in e.block_hashes}
    finally:
        sub.close(0)
        ctx.term()
