from __future__ import annotations

import numpy as np

from kvstore.service.allocator import Allocator, Generations
from kvstore.shm.slots import RETIRED, SLOT_DTYPE, VALID, WRITING


def make(n: int = 4, grace: float = 0.0, clock: list[float] | None = None) -> tuple[Allocator, list[int]]:
    slots = np.zeros(n, SLOT_DTYPE)
    retired: list[int] = []
    t = clock if clock is not None else [0.0]
    a = Allocator(slots, [range(0, n)], [Generations(0, clock=lambda: 0)], grace, clock=lambda: t[0],
                  on_retire=retired.append)
    return a, retired


def fill(a: Allocator) -> list[int]:
    got = []
    while True:
        g = a.allocate(0)
        if g < 0 or g in got:
            break
        a.commit(g, np.array([g, 0, 0, 0], dtype=np.uint64), 10)
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
        a.commit(g, np.array([g, 0, 0, 0], dtype=np.uint64), 1)
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
