"""Faults injected into real services: every page returned is exactly the saved one, or a miss."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvstore import KVCacheClient
from kvstore.quickstart import page_bytes
from kvstore.storage.device import read_superblock
from kvstore.storage.header import SlotHeader
from kvstore.storage.superblock import FORMAT_VERSION
from kvstore.testing import free_port_pair, make_store, wait_for
from tests.integration.test_multiserver import read_all, stats

pytestmark = pytest.mark.integration
PS = 16 << 10


def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}/{i}".encode() for i in range(n)]


def verify(home: Path, keys: list[bytes], server: str | None = None) -> tuple[int, int, int]:
    """(hits, misses, wrong) over ``keys`` of store "f"."""
    return read_all(home, server, keys, store="f")


def slot_offsets(dev: str) -> list[int]:
    sb = read_superblock(dev)
    return [a.offset + s * sb.slot_size for a in sb.areas for s in range(a.slot_count)]


def stored_pages(home: Path, file_devices: Any, services: Any, prefix: str, n: int) -> tuple[str, Any, list[bytes]]:
    """A one-device store "f" of 64 slots, its service, and ``n`` pages saved: (device, service, keys)."""
    (dev,) = file_devices.make(1, (1 << 20) + 64 * (4096 + PS))
    make_store(home, "f", [dev], PS)
    svc = services(home, "f")
    keys = keys_of(prefix, n)
    with KVCacheClient.connect("f", home=home) as c:
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == n
    return dev, svc, keys


def test_bit_flips_and_zeroed_blocks_are_misses(home: Path, file_devices: Any, services: Any) -> None:
    dev, svc, keys = stored_pages(home, file_devices, services, "c", 60)
    offs = slot_offsets(dev)[:60]
    rng = random.Random(5)
    flipped = rng.sample(range(60), 10)
    with open(dev, "r+b") as f:
        for i in flipped[:5]:  # one bit in the payload
            pos = offs[i] + 4096 + rng.randrange(PS)
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        for i in flipped[5:8]:  # the header block zeroed
            f.seek(offs[i])
            f.write(bytes(4096))
        for i in flipped[8:]:  # a payload block zeroed
            f.seek(offs[i] + 4096 + 4096)
            f.write(bytes(4096))
    h, m, w = verify(home, keys)
    assert (h, m, w) == (50, 10, 0)
    # the workers report each failed read; the supervisor counts it and drops the location
    assert wait_for(lambda: stats(svc).validation_failures == 10)
    # the corrupt locations were dropped: asking again is a plain miss, not another failed read
    assert verify(home, keys) == (50, 10, 0)
    assert stats(svc).validation_failures == 10


def test_well_formed_headers_of_another_page_are_misses(home: Path, file_devices: Any, services: Any) -> None:
    """A header that is intact (its checksum holds) but not the one the page table expects:
    another generation, key, length, slot, store, device or format version, or a payload
    checksum the payload does not have. Each is a miss, never the bytes."""
    dev, svc, keys = stored_pages(home, file_devices, services, "h", 9)
    offs = slot_offsets(dev)
    with open(dev, "r+b") as f:
        headers = []
        for off in offs:
            f.seek(off)
            h = SlotHeader.decode(f.read(4096))
            if h is not None:
                headers.append((off, h))
        assert len(headers) == 9
        changes = [dict(generation=headers[0][1].generation + 1), dict(key_digest=bytes(32)),
                   dict(payload_length=PS - 4096), dict(slot_index=headers[3][1].slot_index ^ 1),
                   dict(store_uuid=bytes(16)), dict(device_index=1), dict(payload_checksum=12345),
                   dict(area_index=1)]
        for (off, h), change in zip(headers, changes):
            f.seek(off)
            f.write(dataclasses.replace(h, **change).encode())
        off, h = headers[8]  # another format version, the header checksum made to hold
        raw = bytearray(dataclasses.replace(h).encode())
        struct.pack_into("<I", raw, 8, FORMAT_VERSION + 1)
        struct.pack_into("<Q", raw, 120, xxhash.xxh3_64_intdigest(bytes(raw[:120])))
        f.seek(off)
        f.write(raw)
    assert verify(home, keys) == (0, 9, 0)
    assert wait_for(lambda: stats(svc).validation_failures == 9)


def test_reads_that_fail_are_reported_and_missed(home: Path, file_devices: Any, services: Any) -> None:
    """A device whose reads fail past some offset (the file is cut short under the service:
    reads there come back short, which the worker reports as an I/O error)."""
    dev, svc, keys = stored_pages(home, file_devices, services, "e", 40)
    offs = slot_offsets(dev)
    os.truncate(dev, offs[30])  # slots 30.. are gone
    h, m, w = verify(home, keys)
    assert (h, m, w) == (30, 10, 0)
    assert wait_for(lambda: stats(svc).io_errors == 10)
    assert stats(svc).validation_failures == 0
    # the service keeps serving and writing
    more = keys_of("e2", 8)
    with KVCacheClient.connect("f", home=home) as c:
        c.put(more, [page_bytes(k, PS) for k in more], wait=True)
    assert verify(home, more)[2] == 0


LOADER = """
import sys, numpy as np
from kvstore import KVCacheClient
from kvstore.quickstart import page_bytes
home, prefix = sys.argv[1], sys.argv[2]
with KVCacheClient.connect("f", home=home, timeout=10) as c:
    i = 0
    while True:
        keys = [f"{prefix}/{i}/{j}".encode() for j in range(16)]
        c.put(keys, [page_bytes(k, 16384) for k in keys], wait=(i % 2 == 0))
        print(i, flush=True)
        i += 1
"""


def test_service_killed_mid_writes_never_serves_a_torn_page(home: Path, file_devices: Any, services: Any) -> None:
    devs = file_devices.make(2, (1 << 20) + 200 * (4096 + PS))
    make_store(home, "f", devs, PS)
    svc = services(home, "f")
    p = subprocess.Popen([sys.executable, "-c", LOADER, str(home), "k"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        for _ in range(20):  # let writes flow
            p.stdout.readline()
        svc.kill()  # SIGKILL the supervisor mid-writes; its workers see it and exit
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0  # the loader saw its service die (ServiceLost), and did not hang
    services(home, "f")  # restart: rebuild from headers
    written = [f"k/{i}/{j}".encode() for i in range(40) for j in range(16)]
    h, m, w = verify(home, written)
    assert w == 0 and h >= 20 * 16 // 2  # at least the waited-for batches before the kill


def test_client_killed_mid_get_releases_pins_and_lease(home: Path, file_devices: Any, services: Any) -> None:
    from kvstore.config import ServiceConfig

    (dev,) = file_devices.make(1, (1 << 20) + 200 * (4096 + PS))
    make_store(home, "f", [dev], PS, service=ServiceConfig(client_buffers=32, max_clients=2))
    svc = services(home, "f")
    keys = keys_of("p", 32)
    with KVCacheClient.connect("f", home=home) as c:
        c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
    getter = (f"import sys\nfrom kvstore import KVCacheClient\nc = KVCacheClient.connect('f', home={str(home)!r})\n"
              f"keys = [f'p/{{i}}'.encode() for i in range(32)]\nprint('ready', flush=True)\n"
              "while True:\n    b = c.get(keys)\n")  # never releases: holds buffers, keeps reads in flight
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", getter], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert wait_for(lambda: stats(svc).pins == 0 and stats(svc).clients_connected == 0)
    # both client places are free again, and every page is intact
    with KVCacheClient.connect("f", home=home) as a, KVCacheClient.connect("f", home=home) as b:
        assert a.free_buffers() == 32 and b.free_buffers() == 32
    assert verify(home, keys) == (32, 0, 0)


def test_peer_that_stops_answering(home: Path, file_devices: Any, services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 2 * 200 * (4096 + PS))
    make_store(home, "f", devs, PS, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
    sa = services(home, "f", "a")
    sb = services(home, "f", "b")
    early = keys_of("early", 30)
    with KVCacheClient.connect("f", home=home, server="b") as c:
        c.put(early, [page_bytes(k, PS) for k in early], wait=True)
    assert wait_for(lambda: verify(home, early, "a") == (30, 0, 0))
    # b freezes (SIGSTOP on its whole service: supervisor, agent, workers)
    frozen = [sb.pid, *sb.children()]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        # a keeps serving b's pages (reads go to the shared device, not to b) and its own writes
        assert verify(home, early, "a") == (30, 0, 0)
        mine = keys_of("a-during", 30)
        with KVCacheClient.connect("f", home=home, server="a") as c:
            assert c.put(mine, [page_bytes(k, PS) for k in mine], wait=True).stored == 30
        assert verify(home, mine, "a") == (30, 0, 0)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    # b thaws and catches up with what a wrote meanwhile
    assert wait_for(lambda: verify(home, mine, "b") == (30, 0, 0), 20)
    assert stats(sa).sync_messages_rejected == 0
