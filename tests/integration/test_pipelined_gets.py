"""Gets with their reads in flight while the caller does other work (``get_async``) and long
key lists read in pipelined batches (``get_many``). With their adversaries: a stopped device
worker (one pending get must not wait for another's reads, a timed-out one gives its buffers
back), callers that drop, cancel or abandon pending gets, and pages retired under them."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.errors import ClosedError, Timeout
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store, wait_for

from .test_service import PS, check_batch, dev_size, keys_of

pytestmark = pytest.mark.integration


def _device_of(c: KVCacheClient, key: bytes) -> int:
    """The device holding ``key`` (from the shared index, as a get finds it)."""
    from kvstore.digests import key_digests
    _ids, words = key_digests([key], c._tenant_salt())
    gids = c._index.lookup(words)
    assert gids is not None and gids[0] >= 0
    return int(c._smap.locate_many(gids)[0][0])


def test_get_many_reads_every_key_in_order(file_devices: Any, home: Path, services: Any) -> None:
    make_store(home, "gm", file_devices.make(2, dev_size(200)), PS, service=ServiceConfig(client_buffers=16))
    services(home, "gm")
    stored = keys_of("S", 120)
    absent = keys_of("A", 13)
    keys = [k for pair in zip(stored, absent + [None] * len(stored)) for k in pair if k is not None]
    with KVCacheClient.connect("gm", home=home, timeout=30) as c:
        for i in range(0, len(stored), 16):
            assert c.put(stored[i:i + 16], [page_bytes(k, PS) for k in stored[i:i + 16]], wait=True).stored \
                == len(stored[i:i + 16])
        for batch in (None, 1, 5, 16):
            seen, hits, misses = [], 0, 0
            for start, got in c.get_many(keys, batch=batch):
                n = len(got)
                seen.append((start, n))
                h, m, wrong = check_batch(keys[start:start + n], got)
                assert wrong == 0
                hits, misses = hits + h, misses + m
            step = batch or 4  # a quarter of the 16 buffers
            assert seen == [(s, min(step, len(keys) - s)) for s in range(0, len(keys), step)]
            assert (hits, misses) == (120, 13)
            assert c.free_buffers() == 16
        with pytest.raises(ValueError, match="between 1 and max_batch"):
            c.get_many(keys, batch=17)
        with pytest.raises(TypeError):
            c.get_many(["not bytes"])  # type: ignore[list-item]
        # a caller that stops early: the batches still in flight come back
        for start, got in c.get_many(keys, batch=4):
            if start == 8:
                break
        assert wait_for(lambda: c.free_buffers() == 16)
        # a caller that keeps views past their batch: no deadlock, the rest goes one batch at a time
        import numpy as np
        kept = []
        for start, got in c.get_many(stored[:40], batch=4):
            if start < 16:
                kept.append((start, np.frombuffer(got[0], np.uint8)))  # alive past its batch
        assert len(kept) == 4 and c.free_buffers() == 12
        assert all((v == page_bytes(stored[s], PS)).all() for s, v in kept)  # never reused under it
        kept.clear()
        assert c.free_buffers() == 16


def test_a_pending_get_waits_only_for_its_own_reads(file_devices: Any, home: Path, services: Any) -> None:
    """Two gets in flight, on two devices; the second device's worker is stopped. The first get's
    result comes (every page right) while the second's reads wait; once the worker runs again
    the second's come too; with the worker stopped past its timeout, a pending get times out and
    its buffers come back."""
    make_store(home, "pg", file_devices.make(2, dev_size(100)), PS, service=ServiceConfig(client_buffers=32))
    svc = services(home, "pg")
    keys = keys_of("P", 64)
    with KVCacheClient.connect("pg", home=home, timeout=30, poll_s=0) as c:
        for i in range(0, 64, 32):
            assert c.put(keys[i:i + 32], [page_bytes(k, PS) for k in keys[i:i + 32]], wait=True).stored == 32
        on = {0: [], 1: []}  # type: dict[int, list[bytes]]
        for k in keys:
            on[_device_of(c, k)].append(k)
        assert on[0] and on[1], "the store spread no pages over both devices"
        a_keys, b_keys = on[0][:8], on[1][:8]
        stopped = svc.worker_pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            b = c.get_async(b_keys)  # posted first: its reads wait in the stopped worker's ring
            a = c.get_async(a_keys)
            with a.result() as got:
                assert check_batch(a_keys, got) == (len(a_keys), 0, 0)
            assert c.free_buffers() == 32 - len(b_keys)
        finally:
            os.kill(stopped, signal.SIGCONT)
        with b.result() as got:
            assert check_batch(b_keys, got) == (len(b_keys), 0, 0)
        assert b.result() is b.result()
        assert c.free_buffers() == 32
        os.kill(stopped, signal.SIGSTOP)
        try:
            late = c.get_async(b_keys, timeout=0.5)
            fine = c.get_async(a_keys)
            with pytest.raises(Timeout):
                late.result()
            with fine.result() as got:
                assert check_batch(a_keys, got) == (len(a_keys), 0, 0)
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert wait_for(lambda: c.free_buffers() == 32)
        with c.get(keys[:32]) as got:
            assert check_batch(keys[:32], got) == (32, 0, 0)


def test_pending_gets_dropped_or_cancelled_give_their_buffers_back(file_devices: Any, home: Path,
                                                                   services: Any) -> None:
    make_store(home, "dropped", file_devices.make(1, dev_size(60)), PS, service=ServiceConfig(client_buffers=16))
    svc = services(home, "dropped")
    keys = keys_of("D", 16)
    with KVCacheClient.connect("dropped", home=home, timeout=30) as c:
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 16
        p = c.get_async(keys[:8])
        q = c.get_async(keys[8:])
        assert c.free_buffers() == 0
        with pytest.raises(Timeout):  # no buffer free while both are pending
            c.get(keys[:1], timeout=0.2)
        del p  # never waited for
        gc.collect()
        q.cancel()
        with pytest.raises(ClosedError, match="cancelled"):
            q.result()
        q.cancel()  # idempotent
        assert wait_for(lambda: c.free_buffers() == 16)
        # cancelled while its worker holds the reads: they come back when it answers
        worker = svc.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            r = c.get_async(keys)
            r.cancel()
        finally:
            os.kill(worker, signal.SIGCONT)
        assert wait_for(lambda: c.free_buffers() == 16)
        with c.get(keys) as got:
            assert check_batch(keys, got) == (16, 0, 0)
        # a finished get, cancelled: its batch is released
        done = c.get_async(keys[:4])
        batch = done.result()
        done.cancel()
        with pytest.raises(ClosedError):
            batch[0]
        assert c.free_buffers() == 16
        pending = c.get_async(keys[:4])
    with pytest.raises(ClosedError):  # the client closed under it
        pending.result()


def test_reads_given_up_leave_room_for_the_next_get(file_devices: Any, home: Path, services: Any) -> None:
    """A cancelled get whose reads its (stopped) worker had not taken leaves their records in the
    ring; the buffers come back at once. The next get, the worker running again, finds every
    page (the ring holds twice the lease; stale records are skipped without an I/O slot). Found
    by the outside review: with a ring of one lease, all 16 were misses."""
    make_store(home, "rf", file_devices.make(1, dev_size(60)), PS, service=ServiceConfig(client_buffers=16))
    svc = services(home, "rf")
    keys = keys_of("R", 16)
    with KVCacheClient.connect("rf", home=home, timeout=30) as c:
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 16
        worker = svc.worker_pids()[0]
        for _ in range(2):
            os.kill(worker, signal.SIGSTOP)
            try:
                c.get_async(keys).cancel()
                assert c.free_buffers() == 16
            finally:
                os.kill(worker, signal.SIGCONT)
            with c.get(keys) as got:
                assert check_batch(keys, got) == (16, 0, 0)


def test_pipelined_gets_given_up_at_random_under_churn(file_devices: Any, home: Path, services: Any) -> None:
    """get_many and get_async with random cancels, drops, tiny timeouts and early breaks, on two
    devices, while another client overwrites and evicts the pages being read: never a wrong
    page, and every buffer comes back (after the outside review's stress run)."""
    import random
    import threading
    import time

    make_store(home, "st", file_devices.make(2, dev_size(120)), PS, service=ServiceConfig(client_buffers=16))
    services(home, "st")
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            with KVCacheClient.connect("st", home=home, timeout=30) as w:
                n = 0
                while not stop.is_set():
                    ks = keys_of(f"C{n % 40}", 16)
                    w.put(ks, [page_bytes(k, PS) for k in ks], wait=False)
                    n += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    rng = random.Random(7)
    wrong = hits = rounds = 0
    try:
        with KVCacheClient.connect("st", home=home, timeout=30) as c:
            t_end = time.monotonic() + 10
            while time.monotonic() < t_end or (hits == 0 and time.monotonic() < t_end + 60):
                rounds += 1
                keys = [k for i in rng.sample(range(40), 3) for k in keys_of(f"C{i}", 16)]
                mode = rng.randrange(3)
                try:
                    if mode == 0:
                        for s, got in c.get_many(keys, batch=rng.choice([1, 3, 4, 8, 16]),
                                                 timeout=rng.choice([0.0005, 5])):
                            h, _m, w = check_batch(keys[s:s + len(got)], got)
                            wrong, hits = wrong + w, hits + h
                            if rng.random() < 0.1:
                                break
                    elif mode == 1:
                        pend = [c.get_async(keys[i:i + 4], timeout=rng.choice([0.0005, 5])) for i in range(0, 16, 4)]
                        for i, p in enumerate(pend):
                            r = rng.random()
                            if r < 0.3:
                                p.cancel()
                            elif r > 0.5:  # (else: dropped, never waited for)
                                try:
                                    with p.result() as got:
                                        h, _m, w = check_batch(keys[4 * i:4 * i + 4], got)
                                        wrong, hits = wrong + w, hits + h
                                except Timeout:
                                    pass
                        del pend, p
                    else:
                        with c.get(keys[:16], timeout=rng.choice([0.0005, 5])) as got:
                            h, _m, w = check_batch(keys[:16], got)
                            wrong, hits = wrong + w, hits + h
                except Timeout:
                    pass
                assert wrong == 0
            gc.collect()
            assert wait_for(lambda: c.free_buffers() == 16)
            # and nothing of all that is left in the way: a get of pages just written finds them
            ks = keys_of("final", 16)
            assert c.put(ks, [page_bytes(k, PS) for k in ks], wait=True).stored == 16
            t0 = time.monotonic()
            with c.get(ks, timeout=30) as got:
                assert check_batch(ks, got)[2] == 0
            assert time.monotonic() - t0 < 20  # not left to its timeout
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert hits > 0 and wrong == 0
