from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.ipc.iorings import WorkerRings
from kvstore.service import allocator
from kvstore.service.clients import Clients
from kvstore.service.allocator import Allocator, Generations
from kvstore.shm.slots import RETIRED, SLOT_DTYPE, VALID, WRITING


def make(n: int = 4, grace: float = 0.0, clock: list[float] | None = None) -> tuple[Allocator, list[int]]:
    slots = np.zeros(n, SLOT_DTYPE)
    retired: list[int] = []
    t = clock if clock is not None else [0.0]
    a = Allocator(slots, [range(0, n)], [Generations(0, clock=lambda: 0)], grace, clock=lambda: t[0],
                  on_retire=lambda gids: retired.extend(int(g) for g in gids))
    return a, retired


def commit(a: Allocator, gid: int, d0: int, length: int) -> None:
    """The write of ``gid`` completed, under a key whose first digest word is ``d0``."""
    a.commit(np.array([gid]), np.array([[d0, 0, 0, 0]], dtype=np.uint64), np.array([length]))


def fill(a: Allocator) -> list[int]:
    got = []
    while True:
        g = a.allocate(0)
        if g < 0 or g in got:
            break
        commit(a, g, g, 10)
        got.append(g)
        if len(got) == len(a.slots):
            break
    return got


def test_generations_strictly_increase() -> None:
    a, _ = make()
    gens = []
    for _ in range(12):  # wraps the 4 slots three times
        g = a.allocate(0)
        gens.append(int(a.slots["gen"][g]))
        commit(a, g, g, 1)
        a.ref[:] = 0
    assert gens == sorted(gens) and len(set(gens)) == len(gens)


def test_generations_follow_clock_after_restart() -> None:
    g = Generations(floor=5, clock=lambda: 10_000_000)
    assert g.next() == 10_000 and g.next() == 10_001
    g2 = Generations(floor=50_000, clock=lambda: 0)
    assert g2.next() == 50_001


def test_clock_retires_before_reuse_and_skips_pinned() -> None:
    a, unindexed = make()
    fill(a)
    a.ref[:] = 0
    a.pin(0)  # a read in flight on slot 0
    a.ref[0] = 0
    g = a.allocate(0)
    assert g == 1  # slot 0 is pinned: CLOCK passes it
    assert unindexed == [1]  # retired (tombstone, out of the index) before it was handed out
    assert a.slots["state"][g] == WRITING
    assert a.slots["state"][0] == VALID


def test_all_pinned_means_no_slot() -> None:
    a, _ = make()
    fill(a)
    for i in range(4):
        a.pin(i)
    assert a.allocate(0) == -1
    a.unpin(2)
    assert a.allocate(0) == 2


def test_grace_period_delays_reuse() -> None:
    t = [0.0]
    a, _ = make(grace=5.0, clock=t)
    fill(a)
    a.ref[:] = 0
    assert a.allocate(0) == -1  # retired, but the grace period has not passed
    assert (a.slots["state"] == RETIRED).sum() >= 1
    t[0] = 10.0
    assert a.allocate(0) >= 0


def test_abandoned_write_returns_to_free() -> None:
    a, _ = make(n=1)
    g = a.allocate(0)
    a.abandon(g, 0)
    assert a.allocate(0) == g


def test_grace_on_a_full_area_retires_only_what_writes_need() -> None:
    """Regression: with a grace of 1 s, one allocation on a full area of 100 slots retired all 100."""
    t = [0.0]
    a, retired = make(n=100, grace=1.0, clock=t)
    fill(a)
    a.ref[:] = 0
    assert a.allocate(0) == -1            # nothing usable yet: the retired slot is in its grace
    assert len(retired) == 1              # one page evicted, not the whole cache
    assert (a.slots["state"] == VALID).sum() == 99


def test_grace_with_a_steady_write_rate_keeps_writing_and_keeps_the_cache() -> None:
    t = [0.0]
    a, retired = make(n=100, grace=1.0, clock=t)
    fill(a)
    dropped = written = 0
    for step in range(400):               # 20 writes per second for 20 s of the fake clock
        t[0] = step * 0.05
        a.ref[:] = 0
        g = a.allocate(0)
        if g < 0:
            dropped += 1
            continue
        commit(a, g, 1000 + step, 10)
        written += 1
        # never more retired than about a grace period of writes
        assert (a.slots["state"] == RETIRED).sum() <= 25
    assert dropped <= 25 and written >= 375  # drops only while the first reserve builds up
    assert (a.slots["state"] == VALID).sum() >= 70


def test_grace_zero_reuses_at_once() -> None:
    a, retired = make(n=10)
    fill(a)
    a.ref[:] = 0
    assert a.allocate(0) >= 0 and len(retired) == 1


def _pair(n: int, grace: float, t: list[float]) -> tuple[list[Allocator], list[list[int]], list[set[int]]]:
    """Two allocators over equal, separate slot tables (one allocates in batches, one page by page)."""
    out, retired, reading = [], [], []
    for _ in range(2):
        r: list[int] = []
        busy: set[int] = set()
        a = Allocator(np.zeros(n, SLOT_DTYPE), [range(0, n)], [Generations(0, clock=lambda: 0)], grace,
                      clock=lambda: t[0], on_retire=lambda gids, r=r: r.extend(int(g) for g in gids),
                      reading=lambda gids, busy=busy: np.array([int(g) in busy for g in gids], dtype=bool))
        out.append(a)
        retired.append(r)
        reading.append(busy)
    return out, retired, reading


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 24), grace=st.sampled_from([0.0, 0.0, 1.0]), ops=st.lists(st.tuples(
    st.sampled_from(["alloc"] * 4 + ["ref"] * 2 + ["commit", "pin", "unpin", "read", "unread", "sticky", "tick",
                                                  "abandon"]),
    st.integers(0, 39), st.integers(1, 12), st.sampled_from([-1, 0, 1]), st.sampled_from([None, 3, 8, 100])),
    max_size=80), batch_min=st.sampled_from([1, allocator.BATCH_MIN]))
def test_allocate_many_is_allocate_k_times(n: int, grace: float, ops: list[tuple[str, int, int, int, Any]],
                                           batch_min: int) -> None:
    """``allocate_many(k)`` hands out the slots ``k`` calls of ``allocate`` would, in the same
    order, retires the same slots, leaves the same slot states, reference bits, pins, owners,
    quarantine and counts; only the generations' values differ (both strictly increasing).
    (``batch_min`` 1: the batch path for every ``k``, not only the sizes it is used for.)"""
    saved = allocator.BATCH_MIN
    allocator.BATCH_MIN = batch_min
    try:
        _allocate_many_is_allocate_k_times(n, grace, ops)
    finally:
        allocator.BATCH_MIN = saved


def _allocate_many_is_allocate_k_times(n: int, grace: float, ops: list[tuple[str, int, int, int, Any]]) -> None:
    t = [0.0]
    (bat, one), (rb, ro), (busy_b, busy_o) = _pair(n, grace, t)
    written: list[int] = []
    last_gen = [0, 0]
    for kind, x, k, tenant, quota in ops:
        g = x % n
        if kind == "alloc":
            got_b = bat.allocate_many(0, k, tenant, quota).tolist()
            got_o = []
            for _ in range(k):
                s = one.allocate(0, tenant, quota)
                if s < 0:
                    break
                got_o.append(s)
            assert got_b == got_o
            for j, a in enumerate((bat, one)):
                gens = [int(a.slots["gen"][s]) for s in got_b]
                assert gens == sorted(set(gens)) and (not gens or gens[0] > last_gen[j])
                last_gen[j] = max([last_gen[j]] + [int(v) for v in a.slots["gen"]])
            if x % 4:  # most writes complete at once; the others stay in flight for a while
                for s in got_b:
                    for a in (bat, one):
                        commit(a, s, 1000 + s, 10)
            else:
                written.extend(got_b)
        elif kind == "commit" and written:
            s = written.pop(x % len(written))
            for a in (bat, one):
                if a.slots["state"][s] == WRITING:
                    commit(a, s, 1000 + s, 10)
        elif kind == "abandon" and written:
            s = written.pop(x % len(written))
            for a in (bat, one):
                if a.slots["state"][s] == WRITING:
                    a.abandon(s, 0)
        elif kind == "pin":
            for a in (bat, one):
                a.pin(g)
        elif kind == "unpin":
            for a in (bat, one):
                if a.pins[g]:
                    a.unpin(g)
        elif kind == "ref":
            for a in (bat, one):
                a.ref[g] ^= 1
        elif kind == "read":
            busy_b.add(g)
            busy_o.add(g)
        elif kind == "unread":
            busy_b.discard(g)
            busy_o.discard(g)
        elif kind == "sticky":
            for a in (bat, one):
                if a.slots["state"][g] == VALID:
                    a.pin_client(g, max(tenant, 0), 100)
        else:
            t[0] += 0.6
        for f in ("state", "length", "d0"):
            assert np.array_equal(bat.slots[f], one.slots[f]), f
        assert np.array_equal(bat.ref, one.ref) and np.array_equal(bat.pins, one.pins)
        assert np.array_equal(bat.owner, one.owner) and np.array_equal(bat.sticky, one.sticky)
        assert rb == ro and bat.evictions == one.evictions and bat.hand == one.hand
        assert {k: v for k, v in bat.used_by.items() if v} == {k: v for k, v in one.used_by.items() if v}
        assert [sorted(g for g, _ in q) for q in bat.quarantine] == [sorted(g for g, _ in q) for q in one.quarantine]
        assert len(bat.free[0]) == len(one.free[0])


@settings(max_examples=100, deadline=None)
@given(pins=st.lists(st.lists(st.integers(-1, 50), max_size=8), min_size=1, max_size=3),
       gids=st.lists(st.integers(0, 50), max_size=12))
def test_reading_finds_exactly_the_slots_a_workers_direct_read_pins(pins: list[list[int]], gids: list[int]) -> None:
    """``Clients.reading`` (what the allocator asks before reusing retired slots), on real worker
    control segments: both its paths (a few slots, and numpy's for more) answer as a plain search."""
    workers = []
    for p in pins:
        rings = WorkerRings(bytearray(WorkerRings.nbytes()))
        rings.pins[:] = -1
        rings.pins[:len(p)] = p
        workers.append(SimpleNamespace(rings=rings))
    got = Clients.reading(SimpleNamespace(workers=workers), np.array(gids, dtype=np.int64))  # type: ignore[arg-type]
    assert got.tolist() == [any(g in p for p in pins) for g in gids]


def test_a_tenant_at_its_quota_with_nothing_of_its_own_to_evict_gets_no_slot() -> None:
    """Regression (found in review): at its quota, with all its pages still being written, a
    tenant's write took a slot ready in the quarantine and went over its quota."""
    a = Allocator(np.zeros(10, SLOT_DTYPE), [range(0, 10)], [Generations(0, clock=lambda: 0)], 0.0,
                  clock=lambda: 0.0)
    assert all(a.allocate(0, 0, 3) >= 0 for _ in range(3))  # tenant 0 at quota 3, writes in flight
    g = a.allocate(0, 1, None)
    commit(a, g, 7, 10)
    a.pin(g)
    a.retire(g, 0)  # retired while a read pins it: quarantined
    a.unpin(g)
    assert a.allocate(0, 0, 3) == -1 and a.used_by[0] == 3
    assert len(a.allocate_many(0, 8, 0, 3)) == 0 and a.used_by[0] == 3
    assert a.allocate(0, 1, None) >= 0  # anyone else still gets a slot
