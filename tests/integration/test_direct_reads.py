"""Gets that bypass the supervisor: the client pins the slots it found and posts the reads straight to
the device workers, which validate each page and answer the client themselves. With their
adversaries: a stopped supervisor, slots retired and rewritten under several reading processes,
and a client killed with reads posted."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment
from kvstore.testing import make_store, wait_for

from .test_service import PS, check_batch, dev_size, keys_of, own_slots, stats

pytestmark = pytest.mark.integration


def test_get_needs_no_supervisor(file_devices: Any, home: Path, services: Any) -> None:
    make_store(home, "dr", file_devices.make(2, dev_size(100)), PS, service=ServiceConfig(client_buffers=32))
    svc = services(home, "dr")
    keys, absent = keys_of("K", 64), keys_of("A", 8)
    with pytest.raises(ValueError, match="poll_s must be between 0 and 1"):
        KVCacheClient.connect("dr", home=home, poll_s=2)
    with KVCacheClient.connect("dr", home=home, timeout=10, poll_s=0) as c:  # single gets sleep: still served
        c.put([b"one"], [page_bytes(b"one", PS)], wait=True)
        with c.get([b"one"], timeout=2) as got:
            assert check_batch([b"one"], got) == (1, 0, 0)
    with KVCacheClient.connect("dr", home=home, timeout=10) as c:
        for i in range(0, 64, 32):
            assert c.put(keys[i:i + 32], [page_bytes(k, PS) for k in keys[i:i + 32]], wait=True).stored == 32
        before = stats(svc).service
        os.kill(svc.pid, signal.SIGSTOP)  # the supervisor answers nothing now; its workers still run
        try:
            for i in range(0, 64, 24):
                batch = keys[i:i + 24] + absent[:4]
                with c.get(batch, timeout=2) as got:  # both devices' workers, and misses
                    assert check_batch(batch, got) == (len(batch) - 4, 4, 0)
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        # the workers' reports and the client's counters reach the stats once the supervisor runs
        assert wait_for(lambda: stats(svc).service.hits == before.hits + 64
                        and stats(svc).service.gets == before.gets + 3, timeout=60)
        after = stats(svc).service
        assert after.gets == before.gets + 3 and after.misses == before.misses + 12
        assert after.pages_read == before.pages_read + 64 and after.validation_failures == 0
        assert c.free_buffers() == 32


def test_direct_ring_full_of_stale_reads_gives_misses_then_recovers(file_devices: Any, home: Path,
                                                                      services: Any) -> None:
    """A stopped worker leaves the reads of timed-out gets in its ring; once the ring is full, a
    get posts nothing there and answers misses at once (never a wait, never wrong bytes); when
    the worker runs again every page reads back and every buffer comes back."""
    from kvstore.errors import Timeout

    make_store(home, "full", file_devices.make(1, dev_size(48)), PS, service=ServiceConfig(client_buffers=16))
    svc = services(home, "full")
    keys = keys_of("F", 16)
    with KVCacheClient.connect("full", home=home, timeout=10) as c:
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 16
        worker = svc.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            for _ in range(4):  # 4 x 8 reads left in the ring of 32 (twice the lease)
                with pytest.raises(Timeout):
                    c.get(keys[:8], timeout=0.3)
            for _ in range(3):
                t0 = time.monotonic()
                with c.get(keys[:8], timeout=5) as got:
                    assert check_batch(keys[:8], got) == (0, 8, 0)
                assert time.monotonic() - t0 < 2  # not left to its timeout
        finally:
            os.kill(worker, signal.SIGCONT)
        # once the worker has taken the stale reads the ring has room again: every page reads back

        def all_read() -> bool:
            with c.get(keys) as got:
                hits, _, wrong = check_batch(keys, got)
            assert wrong == 0
            return hits == 16

        assert wait_for(all_read)
        assert wait_for(lambda: c.free_buffers() == 16)


def _reader(home: str, stop: Any, newest: Any, out: Any, seed: int) -> None:
    """Reads recently written keys (the ones being evicted and rewritten) and checks every byte:
    batches of 1, 2 (gets that poll for their answer) or 16 keys (gets that sleep), by seed."""
    rng = np.random.default_rng(seed)
    size = (1, 2, 16)[seed % 3]
    hits = misses = wrong = calls = 0
    with KVCacheClient.connect("race", home=home, timeout=20) as c:
        while not stop.is_set():
            top = newest.value
            if top < 16:
                time.sleep(0.01)
                continue
            idx = sorted(set(rng.integers(max(0, top - 120), top, size).tolist()))
            batch = [b"race/%d" % i for i in idx]
            with c.get(batch) as got:
                h, m, w = check_batch(batch, got)
            hits, misses, wrong, calls = hits + h, misses + m, wrong + w, calls + 1
    out.put((hits, misses, wrong, calls))


def test_retirement_races_direct_reads_from_several_processes(file_devices: Any, home: Path,
                                                              services: Any) -> None:
    """A store of ~64 slots, rewritten over and over by a writer while three processes read the
    pages being evicted. Every page served must be exactly the bytes put under its key, and no
    read may meet a rewrite of its slot: a pinned slot is not reused, so validation never fails
    (it would, were the pin ignored: reads of slots being rewritten fail their header check)."""
    make_store(home, "race", file_devices.make(1, dev_size(64)), PS,
               service=ServiceConfig(client_buffers=32, max_clients=8))
    svc = services(home, "race")
    ctx = multiprocessing.get_context("spawn")
    stop, newest, out = ctx.Event(), ctx.Value("q", 0), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(str(home), stop, newest, out, s)) for s in range(3)]
    for r in readers:
        r.start()
    written = 0
    try:
        with KVCacheClient.connect("race", home=home, timeout=20) as c:
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                batch = [b"race/%d" % i for i in range(written, written + 8)]
                c.put(batch, [page_bytes(k, PS) for k in batch], wait=True)
                written += 8
                newest.value = written
    finally:
        stop.set()
        results = [out.get(timeout=60) for _ in readers]
        for r in readers:
            r.join(30)
    hits = sum(r[0] for r in results)
    wrong = sum(r[2] for r in results)
    calls = sum(r[3] for r in results)
    st = stats(svc).service
    assert wrong == 0
    assert st.evictions > 200 and written > 300, (st.evictions, written)  # the churn really happened
    assert hits > 100 and calls > 50, results
    assert st.validation_failures == 0, [ln for ln in svc.log.read_text().splitlines() if "validation" in ln or "header" in ln]


def _get_and_wait(home: str) -> None:
    c = KVCacheClient.connect("kill", home=home, timeout=60)
    c.get([b"kill/%d" % i for i in range(8)])  # its worker is stopped: this waits until we die


def test_killed_client_with_reads_posted_does_not_hold_slots(file_devices: Any, home: Path,
                                                               services: Any) -> None:
    """kill -9 a client whose direct reads are posted (its worker stopped, so they stay posted):
    the service takes its buffers back, drops the connection, and the slots it pinned are
    reused like any other."""
    make_store(home, "kill", file_devices.make(1, dev_size(48)), PS, service=ServiceConfig(client_buffers=16))
    svc = services(home, "kill")
    n = own_slots(svc)
    first = [b"kill/%d" % i for i in range(n)]
    with KVCacheClient.connect("kill", home=home, timeout=10) as c:
        for i in range(0, n, 16):
            c.put(first[i:i + 16], [page_bytes(k, PS) for k in first[i:i + 16]], wait=True)
    worker = svc.worker_pids()[0]
    os.kill(worker, signal.SIGSTOP)
    child = multiprocessing.get_context("spawn").Process(target=_get_and_wait, args=(str(home),))
    try:
        child.start()
        seg_name = svc.prefix + "c0"
        pins = lambda: _pins(seg_name)  # noqa: E731
        # a spawned child imports kvstore and connects first: on a busy machine that takes a while
        assert wait_for(lambda: (pins() >= 0).sum() == 8 or not child.is_alive(), timeout=120)
        assert child.is_alive(), f"the client died before pinning its slots (exit code {child.exitcode})"
        assert (pins() >= 0).sum() == 8, "the client never pinned its slots"
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        # the connection goes once nothing of it is with a worker: its posted reads are taken back
        assert wait_for(lambda: stats(svc).service.clients_connected == 0, timeout=60)
        assert wait_for(lambda: not Path("/dev/shm/" + seg_name).exists(), timeout=60)
    finally:
        os.kill(worker, signal.SIGCONT)
    # every slot, the ones the dead client pinned included, takes a new page: n new keys fit in n slots
    fresh = [b"fresh/%d" % i for i in range(n)]
    with KVCacheClient.connect("kill", home=home, timeout=10) as c:
        for i in range(0, n, 16):
            c.put(fresh[i:i + 16], [page_bytes(k, PS) for k in fresh[i:i + 16]], wait=True)
        assert c.contains(fresh) == [True] * n
        with c.get(fresh[:8]) as got:
            assert check_batch(fresh[:8], got) == (8, 0, 0)


def _pins(seg_name: str) -> np.ndarray:
    """The pin words of a connection segment (read from outside, as a test may)."""
    from kvstore.ipc import connection as P

    try:
        seg = Segment.attach(seg_name)
    except Exception:  # not there (yet, or any more)
        return np.full(1, -1)
    try:
        ch = P.ClientChannel(seg.buf, 16, 1)
        out = ch.pins.copy()
        del ch
        return out
    finally:
        seg.close()
