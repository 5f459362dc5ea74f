"""The CRDT laws of the register join, and convergence under any delivery order."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, precondition

from kvstore.crdt.merge import apply, gids_of, registers_of
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.shm.slots import RETIRED, SLOT_DTYPE, VALID, SlotMap

SMAP = SlotMap([[4, 4], [4, 4]])  # 2 devices x 2 areas x 4 slots


def rec(device: int, area: int, slot: int, gen: int, key: int, state: int) -> tuple[Any, ...]:
    # the owner writes one digest per (slot, gen): derive it from them
    d = (gen * 1_000_003 + slot * 7 + device * 13 + area) & ((1 << 64) - 1)
    return (device, area, slot, gen, d, key, 0, 0, 100, state, b"\0\0\0")


records = st.builds(
    rec, st.integers(0, 1), st.integers(0, 1), st.integers(0, 3), st.integers(1, 6), st.just(0),
    st.sampled_from([VALID, RETIRED]))


def conflicting_rec(device: int, area: int, slot: int, gen: int, d0: int, length: int, state: int) -> tuple[Any, ...]:
    # content drawn independently of (slot, gen): two registers can tie on (gen, state) and differ
    return (device, area, slot, gen, d0, 0, 0, d0 ^ 5, length, state, b"\0\0\0")


conflicting = st.builds(
    conflicting_rec, st.integers(0, 1), st.integers(0, 1), st.integers(0, 1), st.integers(1, 3),
    st.integers(0, 3), st.sampled_from([100, 4096]), st.sampled_from([VALID, RETIRED]))


def batch(rs: list[tuple[Any, ...]]) -> np.ndarray[Any, Any]:
    return np.array(rs, dtype=REGISTER_DTYPE)


def state_after(*batches: list[tuple[Any, ...]]) -> bytes:
    slots = np.zeros(SMAP.total, SLOT_DTYPE)
    for b in batches:
        r = batch(b)
        apply(slots, gids_of(SMAP, r), r)
    return slots.tobytes()


@settings(max_examples=200)
@given(st.lists(records), st.lists(records))
def test_commutative(a: list[Any], b: list[Any]) -> None:
    assert state_after(a, b) == state_after(b, a)


@settings(max_examples=200)
@given(st.lists(records), st.lists(records), st.lists(records))
def test_associative(a: list[Any], b: list[Any], c: list[Any]) -> None:
    assert state_after(a, b, c) == state_after(a + b, c) == state_after(a, b + c)


@settings(max_examples=200)
@given(st.lists(records))
def test_idempotent(a: list[Any]) -> None:
    assert state_after(a) == state_after(a, a) == state_after(a + a)


def redelivered(log: list[Any], rnd: Any) -> list[list[Any]]:
    """The log with some records duplicated, shuffled, and cut into batches of 1-5."""
    shuffled = list(log) + [r for r in log if rnd.random() < 0.3]
    rnd.shuffle(shuffled)
    chunks = []
    while shuffled:
        k = rnd.randint(1, 5)
        chunks.append(shuffled[:k])
        shuffled = shuffled[k:]
    return chunks


@settings(max_examples=200)
@given(st.lists(records, max_size=40), st.randoms(use_true_random=False))
def test_any_permutation_or_duplication_converges(log: list[Any], rnd: Any) -> None:
    assert state_after(*redelivered(log, rnd)) == state_after(log)


def test_tie_on_generation_and_state_is_decided_by_content_not_arrival() -> None:
    """Regression: (gen, state) equal, digests differ; the first to arrive used to win."""
    a = [conflicting_rec(0, 0, 0, 7, 1, 100, VALID)]
    b = [conflicting_rec(0, 0, 0, 7, 2, 100, VALID)]
    assert state_after(a, b) == state_after(b, a) == state_after(a + b) == state_after(b + a)


@settings(max_examples=300)
@given(st.lists(conflicting), st.lists(conflicting), st.lists(conflicting))
def test_laws_hold_for_conflicting_registers(a: list[Any], b: list[Any], c: list[Any]) -> None:
    assert state_after(a, b) == state_after(b, a)
    assert state_after(a, b, c) == state_after(a + b, c) == state_after(a, b + c)
    assert state_after(a) == state_after(a, a) == state_after(a + a)


@settings(max_examples=200)
@given(st.lists(conflicting, max_size=40), st.randoms(use_true_random=False))
def test_conflicting_log_converges_in_any_order(log: list[Any], rnd: Any) -> None:
    assert state_after(*redelivered(log, rnd)) == state_after(log)


def test_snapshot_is_a_big_delta() -> None:
    slots = np.zeros(SMAP.total, SLOT_DTYPE)
    r = batch([rec(0, 1, s, 5, 0, VALID) for s in range(4)] + [rec(1, 1, 2, 9, 0, RETIRED)])
    apply(slots, gids_of(SMAP, r), r)
    other = np.zeros(SMAP.total, SLOT_DTYPE)
    for d in range(2):
        snap = registers_of(slots, SMAP, d, 1)
        apply(other, gids_of(SMAP, snap), snap)
    assert other.tobytes() == slots.tobytes()


class Replicas(RuleBasedStateMachine):
    """N replicas; each owner writes its area; deltas are dropped, duplicated, reordered and
    partitioned; anti-entropy (owner snapshots) after heal makes every replica equal."""

    N = 3

    def __init__(self) -> None:
        super().__init__()
        self.smap = SlotMap([[3] * self.N])
        self.tables = [np.zeros(self.smap.total, SLOT_DTYPE) for _ in range(self.N)]
        self.gen = [0] * self.N
        self.inflight: list[tuple[int, np.ndarray[Any, Any]]] = []  # (destination, records)
        self.cut: set[int] = set()

    def _deliver(self, dst: int, r: np.ndarray[Any, Any]) -> None:
        apply(self.tables[dst], gids_of(self.smap, r), r)

    @rule(owner=st.integers(0, N - 1), slot=st.integers(0, 2), retire=st.booleans())
    def write(self, owner: int, slot: int, retire: bool) -> None:
        self.gen[owner] += 1
        r = batch([(0, owner, slot, self.gen[owner], self.gen[owner] * 31 + slot, 1, 2, 3, 64,
                    RETIRED if retire else VALID, b"\0\0\0")])
        self._deliver(owner, r)
        for dst in range(self.N):
            if dst != owner:
                self.inflight.append((dst, r))

    @precondition(lambda self: self.inflight)
    @rule(i=st.integers(0, 1000), dup=st.booleans())
    def deliver(self, i: int, dup: bool) -> None:
        dst, r = self.inflight[i % len(self.inflight)]
        if dst in self.cut or r["area"][0] in self.cut:
            return
        self._deliver(dst, r)
        if not dup:
            self.inflight.pop(i % len(self.inflight))

    @precondition(lambda self: self.inflight)
    @rule(i=st.integers(0, 1000))
    def drop(self, i: int) -> None:
        self.inflight.pop(i % len(self.inflight))

    @rule(who=st.integers(0, N - 1))
    def partition(self, who: int) -> None:
        self.cut.add(who)

    @rule()
    def heal_and_anti_entropy(self) -> None:
        self.cut.clear()
        for owner in range(self.N):
            snap = registers_of(self.tables[owner], self.smap, 0, owner)
            for dst in range(self.N):
                self._deliver(dst, snap)
        first = self.tables[0].tobytes()
        assert all(t.tobytes() == first for t in self.tables)

    @invariant()
    def owners_are_authoritative(self) -> None:
        # every replica's view of an area is never newer than its owner's
        for t in self.tables:
            for owner in range(self.N):
                r = self.smap.area_gids(0, owner)
                assert (t["gen"][r.start:r.stop] <= self.tables[owner]["gen"][r.start:r.stop]).all()


TestReplicas = Replicas.TestCase
