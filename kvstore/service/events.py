"""KV events in vLLM's format, so cache-aware routers can route by what the shared tier holds.

The cache service publishes, on a ZMQ PUB socket, batches shaped like vLLM's
``KVEventBatch`` (``vllm/distributed/kv_events.py``): msgpack maps encoded as
msgspec does for those structs (tagged with ``"type"``)::

    {"ts": <unix seconds>, "events": [
        {"type": "BlockStored", "block_hashes": [<32 bytes>, ...], "parent_block_hash": null,
         "token_ids": [], "block_size": <page tokens or 0>, "lora_id": null,
         "medium": "kvstore:<store>", "lora_name": null},
        {"type": "BlockRemoved", "block_hashes": [...], "medium": "kvstore:<store>"},
        {"type": "AllBlocksCleared"}]}

Frames are ``(topic, seq as 8 bytes big-endian, payload)``. The replay socket
(a ROUTER at PORT+1) answers a request ``(b"", start_seq as 8 bytes
big-endian)`` with every buffered batch from that seq, ``(b"", seq, payload)``
each, and ends with ``(b"", -1 as 8 bytes, b"")``, as vLLM's publisher does.

What the store cannot tell a router: the token ids (it stores only salted
key digests). ``block_hashes`` are those digests; a router computes them for
its prompts with ``block_hash(salt, page_key)`` (``kvstore.keys`` gives the
page keys; the salt is the tenant's, ``StoreConfig.tenant_salt(tenant).hex()``,
which the administrator hands the router: the store salt itself is never a
digest key), so it needs no token ids.

``ChangeEvents`` subscribes a publisher to the service's slot-change feed
(``changes.py``): stored and merged pages become BlockStored, retired, replaced
and forgotten ones BlockRemoved.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import Any

import msgpack
import numpy as np
import zmq

from ..digests import key_id
from ..shm.slots import VALID
from .changes import FORGOTTEN, RETIRED, STORED, Change

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_hash(salt_hex: str, page_key: bytes) -> bytes:
    """The ``block_hashes`` entry the store publishes for a page key of the tenant whose salt
    (``StoreConfig.tenant_salt(tenant)``, as hex) is ``salt_hex``."""
    return hashlib.blake2b(key_id(page_key), digest_size=32, key=bytes.fromhex(salt_hex)).digest()


def stored(hashes: list[bytes], medium: str, block_size: int = 0) -> dict[str, Any]:
    """A BlockStored event."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


def removed(hashes: list[bytes], medium: str) -> dict[str, Any]:
    """A BlockRemoved event."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared() -> dict[str, Any]:
    """An AllBlocksCleared event."""
    return {"type": "AllBlocksCleared"}


class EventPublisher:
    """Batches events and publishes them with sequence numbers; keeps the last
    ``buffer_batches`` for replay. Driven by the supervisor's loop (no thread)."""

    def __init__(self, endpoint: str, replay_endpoint: str, medium: str, *, topic: str = "",
                 buffer_batches: int = 10_000, flush_interval_s: float = 0.01, max_events: int = 1024) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.sndhwm = 100_000
        self.pub.bind(endpoint)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.linger = 0
        self.replay.bind(replay_endpoint)
        self.medium = medium
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.seq = 0
        self.pending: list[dict[str, Any]] = []
        self.pending_hashes = 0
        self.last_flush = time.monotonic()
        self.flush_interval_s = flush_interval_s
        self.max_events = max_events

    def add(self, event: dict[str, Any]) -> None:
        """Queue one event (published at the next flush)."""
        self.pending.append(event)
        self.pending_hashes += len(event.get("block_hashes", ())) or 1
        if self.pending_hashes >= self.max_events:
            self.flush()

    def stored(self, hashes: list[bytes]) -> None:
        """Queue a BlockStored for ``hashes``."""
        if hashes:
            self.add(stored(hashes, self.medium))

    def removed(self, hashes: list[bytes]) -> None:
        """Queue a BlockRemoved for ``hashes``."""
        if hashes:
            self.add(removed(hashes, self.medium))

    def flush(self) -> None:
        """Publish the queued events as one batch."""
        if not self.pending:
            return
        payload = msgpack.packb({"ts": time.time(), "events": self.pending}, use_bin_type=True)
        seq = self.seq
        self.seq += 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        self.pending = []
        self.pending_hashes = 0
        self.last_flush = time.monotonic()

    def tick(self) -> None:
        """Flush when the interval is up; answer replay requests."""
        if self.pending and time.monotonic() - self.last_flush >= self.flush_interval_s:
            self.flush()
        for _ in range(16):
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # malformed request: ignored
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Flush and close the sockets."""
        self.flush()
        self.pub.close(0)
        self.replay.close(0)
        self.ctx.term()


class ChangeEvents:
    """The slot-change feed as KV events: ``digests(gids)`` reads the slots' digests."""

    BATCH = 1024

    def __init__(self, pub: EventPublisher, digests: Any) -> None:
        self.pub = pub
        self.digests = digests

    @classmethod
    def subscribe(cls, pub: EventPublisher, st: Any) -> ChangeEvents:
        """Announce every page ``st`` (a ``StoreState``) holds now, then every change."""
        sink = cls(pub, st.digests)
        sink(Change(STORED, np.nonzero(st.slots["state"] == VALID)[0].astype(np.int64)))
        st.changes.subscribe(sink)
        return sink

    def __call__(self, ch: Change) -> None:
        if ch.removed:
            self.pub.removed(list(ch.removed))
        gone = ch.kind in (RETIRED, FORGOTTEN)
        for s in range(0, len(ch.gids), self.BATCH):
            d = self.digests(ch.gids[s:s + self.BATCH])
            (self.pub.removed if gone else self.pub.stored)(d)
