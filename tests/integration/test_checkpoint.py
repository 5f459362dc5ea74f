"""Restart from a slot-table checkpoint instead of reading every slot header, and what a stale,
corrupt or missing checkpoint does: misses at worst, never a wrong page."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.quickstart import page_bytes
from kvstore.service.checkpoint import checkpoint_path
from kvstore.testing import make_store, wait_for

from .test_service import PS, check_batch, dev_size, keys_of, own_slots, stats

pytestmark = pytest.mark.integration


def read_all(home: Path, store: str, keys: list[bytes]) -> tuple[int, int, int]:
    h = m = w = 0
    with KVCacheClient.connect(store, home=home) as c:
        for s in range(0, len(keys), c.max_batch):
            with c.get(keys[s:s + c.max_batch]) as b:
                x = check_batch(keys[s:s + c.max_batch], b)
            h, m, w = h + x[0], m + x[1], w + x[2]
    return h, m, w


def put_all(home: Path, store: str, keys: list[bytes]) -> int:
    with KVCacheClient.connect(store, home=home) as c:
        return sum(c.put(keys[s:s + 32], [page_bytes(k, PS) for k in keys[s:s + 32]], wait=True).stored
                   for s in range(0, len(keys), 32))


def test_clean_restart_loads_the_checkpoint(file_devices: Any, home: Path, services: Any) -> None:
    make_store(home, "ck", file_devices.make(2, dev_size(200)), PS)
    svc = services(home, "ck")
    keys = keys_of("ck", 300)
    assert put_all(home, "ck", keys) == 300
    assert svc.stop() == 0  # a clean stop writes the checkpoint
    assert checkpoint_path(home, "ck", "local").exists()
    seen = len(svc.log.read_text())  # one log file for every run of the service
    svc2 = services(home, "ck")
    log = svc2.log.read_text()[seen:]
    assert "slot table loaded from checkpoint" in log and "rebuilt location table from slot headers" not in log
    assert read_all(home, "ck", keys) == (300, 0, 0)
    more = keys_of("ck2", 40)  # new writes after it get slots and generations of their own
    assert put_all(home, "ck", more) == 40
    assert read_all(home, "ck", keys + more) == (340, 0, 0)


def test_stale_checkpoint_gives_misses_never_wrong_pages(file_devices: Any, home: Path, services: Any) -> None:
    """The checkpoint of an earlier state, loaded after the slots were rewritten with other keys:
    the old keys point at slots that now hold other pages (reads fail validation, misses) and
    the new keys are unknown (misses). Not one wrong page."""
    make_store(home, "st", file_devices.make(1, dev_size(64)), PS)
    svc = services(home, "st")
    n = own_slots(svc)
    old = keys_of("old", n)
    assert put_all(home, "st", old) == n
    assert svc.stop() == 0
    ckpt = checkpoint_path(home, "st", "local")
    shutil.copy(ckpt, home / "old.slots")
    svc = services(home, "st")
    new = keys_of("new", n // 2)  # evicts about half of the old pages, in their slots
    assert put_all(home, "st", new) == n // 2
    assert svc.stop() == 0
    shutil.copy(home / "old.slots", ckpt)  # as if the last checkpoint were that old
    seen = len(svc.log.read_text())
    svc = services(home, "st")
    assert "slot table loaded from checkpoint" in svc.log.read_text()[seen:]
    h, m, w = read_all(home, "st", old + new)
    assert w == 0
    assert h >= n - n // 2 - 2 and m >= n // 2, (h, m)  # the untouched old pages are still served
    assert wait_for(lambda: stats(svc).service.validation_failures >= n // 2 - 2)
    # and the locations that failed are gone: reading again is plain misses, no new failures
    failures = stats(svc).service.validation_failures
    assert read_all(home, "st", old)[2] == 0
    assert wait_for(lambda: stats(svc).service.validation_failures == failures)


def test_corrupt_or_foreign_checkpoint_falls_back_to_the_scan(file_devices: Any, home: Path,
                                                              services: Any) -> None:
    make_store(home, "cf", file_devices.make(1, dev_size(100)), PS)
    svc = services(home, "cf")
    keys = keys_of("cf", 60)
    assert put_all(home, "cf", keys) == 60
    assert svc.stop() == 0
    ckpt = checkpoint_path(home, "cf", "local")
    raw = bytearray(ckpt.read_bytes())
    raw[128 + 48 * 3 + 10] ^= 0xFF  # one byte of one entry
    ckpt.write_bytes(bytes(raw))
    seen = len(svc.log.read_text())
    svc = services(home, "cf")
    log = svc.log.read_text()[seen:]
    assert "checkpoint body truncated or corrupt" in log and "rebuilt location table from slot headers" in log
    assert read_all(home, "cf", keys) == (60, 0, 0)
    assert svc.stop() == 0
    ckpt.write_bytes(b"KVSCKPT1" + bytes(200))  # not one of ours at all
    seen = len(svc.log.read_text())
    svc = services(home, "cf")
    assert "rebuilt location table from slot headers" in svc.log.read_text()[seen:]
    assert read_all(home, "cf", keys) == (60, 0, 0)


def test_periodic_checkpoint_serves_a_restart_after_kill_9(file_devices: Any, home: Path, services: Any) -> None:
    make_store(home, "pk", file_devices.make(1, dev_size(100)), PS,
               service=ServiceConfig(checkpoint_interval_s=0.2))
    svc = services(home, "pk")
    keys = keys_of("pk", 80)
    assert put_all(home, "pk", keys) == 80
    ckpt = checkpoint_path(home, "pk", "local")
    t = time.time()
    assert wait_for(lambda: ckpt.exists() and ckpt.stat().st_mtime > t + 0.1, timeout=60)
    os.kill(svc.pid, signal.SIGKILL)
    svc.stop()
    seen = len(svc.log.read_text())
    svc2 = services(home, "pk")
    assert "slot table loaded from checkpoint" in svc2.log.read_text()[seen:]
    assert read_all(home, "pk", keys) == (80, 0, 0)
