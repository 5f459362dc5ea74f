"""The service's request logic in one process: no supervisor loop, no worker processes.

The state (``StoreState``) is built over anonymous memory from a real store on a file device;
the test connects to the real ``Clients`` socket with a real hello, then plays both neighbours of
``Requests``: the client (it fills descriptors and posts them to the connection's ring) and the
device worker (it takes the I/O records from the worker's rings and writes completions). Each
step is one ``turn``, so every assertion is about one state, without waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.ipc import connection as P
from kvstore.ipc import lease as A
from kvstore.ipc.iorings import OP_READ, OP_WRITE, ST_BAD_CHECKSUM
from kvstore.service.changes import FORGOTTEN, RETIRED, STORED
from kvstore.shm.slots import RETIRED as S_RETIRED
from kvstore.shm.slots import VALID, SlotMap

from .harness import PAGE, Client, Service, digests


@pytest.fixture
def svc(home: Path, file_devices: Any) -> Iterator[Service]:
    s = Service(home, file_devices.make(1, 8 << 20))
    yield s
    s.close()


def put(svc: Service, c: Client, keys: list[bytes], desc: int = 0, skip: int = 0) -> list[int]:
    """A put through every step: post, dispatch, the worker's completions, the answer."""
    bufs = c.buffers(len(keys), skip)
    c.post(desc, P.OP_PUT, keys, bufs, [bytes([i + 1]) * PAGE for i in range(len(keys))])
    assert svc.turn() == 1  # taken, dispatched: nothing is answered before its pages are written
    assert c.answer(desc) is None
    recs = svc.worker_takes(OP_WRITE)
    assert len(recs) == len(keys) and not len(svc.worker_takes(OP_READ))
    svc.worker_completes(recs)
    svc.turn()
    got = c.answer(desc)
    assert got is not None and got[0] == P.S_OK
    assert [c.arena.state(b) for b in bufs] == [A.FREE] * len(bufs)  # the buffers came back
    return got[2]


def test_put_is_answered_only_after_its_pages_are_written_and_indexed(svc: Service) -> None:
    c = Client(svc)
    keys = [b"p0", b"p1", b"p2"]
    assert put(svc, c, keys) == [P.R_STORED] * 3
    gids = svc.st.index.lookup(digests(svc, keys), svc.st.local)
    assert (gids >= 0).all() and (svc.st.slots["state"][gids] == VALID).all()
    assert {ch.kind for ch in svc.changes} == {STORED}  # one change for the writes a drain completed
    assert sorted(int(g) for ch in svc.changes for g in ch.gids) == sorted(gids.tolist())
    # the same keys again: skipped without a write
    c.post(1, P.OP_PUT, keys, c.buffers(3), [b"x" * PAGE] * 3)
    svc.turn()
    assert not len(svc.worker_takes(OP_WRITE))
    assert c.answer(1) == (P.S_OK, 0, [P.R_SKIPPED] * 3)
    c.close()


def test_a_failed_write_is_dropped_and_never_indexed(svc: Service) -> None:
    c = Client(svc)
    c.post(0, P.OP_PUT, [b"k"], c.buffers(1), [b"z" * PAGE])
    svc.turn()
    svc.worker_completes(svc.worker_takes(OP_WRITE), status=ST_BAD_CHECKSUM)
    svc.turn()
    assert c.answer(0) == (P.S_OK, 0, [P.R_DROPPED])
    assert (svc.st.index.lookup(digests(svc, [b"k"]), svc.st.local) < 0).all()
    assert not svc.changes
    c.close()


def test_get_reads_what_the_index_names_and_a_bad_checksum_drops_the_location(svc: Service) -> None:
    c = Client(svc)
    put(svc, c, [b"a", b"b"])
    svc.changes.clear()
    c.post(1, P.OP_GET, [b"a", b"b", b"missing"], c.buffers(3))
    svc.turn()
    reads = svc.worker_takes(OP_READ)
    assert len(reads) == 2  # the miss costs no I/O
    gids = svc.st.index.lookup(digests(svc, [b"a", b"b"]), svc.st.local)
    # what a worker validates against: the slot's generation and the key's salted digest
    w = digests(svc, [b"a", b"b"])
    assert sorted(zip(reads["d0"].tolist(), reads["gen"].tolist())) == sorted(
        zip(w[:, 0].tolist(), svc.st.slots["gen"][gids].tolist()))
    by_key = {int(r["d0"]): r for r in reads}
    svc.worker_completes(np.array([by_key[int(w[0, 0])]]))                        # "a": valid
    svc.worker_completes(np.array([by_key[int(w[1, 0])]]), status=ST_BAD_CHECKSUM)  # "b": the device lies
    svc.turn()
    status, _, res = c.answer(1)  # type: ignore[misc]
    assert status == P.S_OK and res == [P.R_HIT, P.R_MISS, P.R_MISS]
    assert svc.st.index.lookup(w[:1], svc.st.local)[0] == gids[0]
    assert svc.st.index.lookup(w[1:], svc.st.local)[0] < 0        # never served again
    assert svc.st.slots["state"][gids[1]] == S_RETIRED
    assert [(ch.kind, ch.gids.tolist()) for ch in svc.changes] == [(RETIRED, [int(gids[1])])]
    assert svc.st.stats.snapshot().service.validation_failures == 1
    c.close()


def test_a_cancelled_get_is_answered_cancelled_and_its_buffers_come_back(svc: Service) -> None:
    c = Client(svc)
    put(svc, c, [b"a"])
    bufs = c.buffers(1)
    c.post(1, P.OP_GET, [b"a"], bufs)
    svc.turn()
    reads = svc.worker_takes(OP_READ)
    c.chan.desc[1].set_cancel(1)  # the client timed out while the read was on the device
    svc.worker_completes(reads)
    svc.turn()
    status, _, _ = c.answer(1)  # type: ignore[misc]
    assert status == P.S_CANCELLED
    assert c.arena.state(bufs[0]) == A.FREE  # nobody reads it: free, not the client's
    assert svc.st.alloc.pinned_slots == 0    # the read's pin is gone
    c.close()


def test_requests_naming_buffers_outside_the_lease_are_refused_before_any_io(svc: Service) -> None:
    a, b = Client(svc), Client(svc)
    theirs = b.buffers(1)
    a.post(0, P.OP_GET, [b"x"], [])  # a get must name its buffers: count 1, no buffer set
    a.chan.desc[0].bufs[0] = theirs[0]  # ... and this one names another connection's
    svc.turn()
    assert a.answer(0) == (P.S_BAD_REQUEST, 0, [0])
    assert not len(svc.worker_takes(OP_READ))
    a.close()
    b.close()


def test_a_lost_worker_fails_its_ios_and_quarantines_their_buffers(svc: Service) -> None:
    c = Client(svc)
    bufs = c.buffers(2)
    c.post(0, P.OP_PUT, [b"q0", b"q1"], bufs, [b"q" * PAGE] * 2)
    svc.turn()
    assert len(svc.worker_takes(OP_WRITE)) == 2
    held = svc.requests.fail_device(0, dead=False)  # hung: its kernel I/O may still land
    assert sorted(b for _, b in held) == bufs
    assert c.answer(0) == (P.S_OK, 0, [P.R_DROPPED] * 2)
    assert [c.arena.state(b) for b in bufs] == [A.QUARANTINE] * 2  # not the client's until it is gone
    assert not svc.requests.pending and not svc.requests.queued(0)
    c.close()


def test_forgetting_a_denied_area_announces_its_pages(home: Path, file_devices: Any) -> None:
    from kvstore.testing import free_port

    svc = Service(home, file_devices.make(1, 8 << 20), [f"a=127.0.0.1:{free_port(2)}", f"b=127.0.0.1:{free_port(2)}"])
    try:
        smap: SlotMap = svc.st.smap
        g = smap.area_gids(0, 1).start  # a slot of b's area, as if merged from b
        svc.st.slots[g]["state"] = VALID
        svc.st.slots[g]["gen"] = 5
        svc.st.index.index_slots(np.array([g]))
        assert svc.st.forget_area(1) == 1
        assert [(ch.kind, ch.gids.tolist()) for ch in svc.changes] == [(FORGOTTEN, [g])]
        assert svc.st.slots["state"][g] != VALID
    finally:
        svc.close()


def test_a_batch_put_hands_each_page_to_its_own_slot_under_its_own_key(svc: Service) -> None:
    """Above ``BATCH_MIN`` pages the write records are built together (numpy): each names its
    page's buffer, key, length and its slot's offset and generation, and every page is found."""
    c = Client(svc)
    keys = [b"batch%d" % i for i in range(12)]
    bufs = c.buffers(len(keys))
    c.post(0, P.OP_PUT, keys, bufs, [bytes([i + 1]) * PAGE for i in range(len(keys))])
    svc.turn()
    recs = svc.worker_takes(OP_WRITE)
    words = digests(svc, keys)
    assert recs["buf"].tolist() == bufs and len(set(recs["tag"].tolist())) == len(keys)
    for r, w in zip(recs, words):
        assert [int(r[f]) for f in ("d0", "d1", "d2", "d3")] == [int(x) for x in w]
        assert int(r["payload_len"]) == PAGE
        gid = SlotMap.gid(svc.st.smap, 0, int(r["area"]), int(r["slot"]))
        assert int(r["gen"]) == int(svc.st.slots["gen"][gid])
        assert int(r["offset"]) == svc.st.sbs[0].areas[int(r["area"])].offset + int(r["slot"]) * svc.st.sbs[0].slot_size
    svc.worker_completes(recs)
    svc.turn()
    assert c.answer(0) == (P.S_OK, 0, [P.R_STORED] * len(keys))
    gids = svc.st.index.lookup(words, svc.st.local)
    assert (gids >= 0).all() and len(set(gids.tolist())) == len(keys)
    c.close()


def test_pages_for_a_device_being_replaced_go_to_the_next_devices_in_turn(home: Path, file_devices: Any) -> None:
    s = Service(home, file_devices.make(3, 8 << 20))
    try:
        s.pool.slots[1].proc = None  # device 1's worker is being replaced
        c = Client(s)
        keys = [b"rr%d" % i for i in range(9)]
        c.post(0, P.OP_PUT, keys, c.buffers(len(keys)), [bytes([i + 1]) * PAGE for i in range(len(keys))])
        s.turn()
        per_dev = [len(w.rings.writes.get_batch(1024)) for w in s.pool.slots]
        # round-robin from device 0: three pages each; device 1's three go on to device 2 first
        assert per_dev == [3, 0, 6]
        c.close()
    finally:
        s.close()
