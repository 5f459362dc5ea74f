from __future__ import annotations

import collections
import mmap
from typing import Any

import multiprocess
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import WouldBlock
from kvstore.shm.ring import Ring
from kvstore.shm.segment import Segment

DT = np.dtype([("seq", "<u8"), ("val", "<i8")])


class RingVsDeque(RuleBasedStateMachine):
    """The ring behaves like a bounded deque, wrap-around included."""

    def __init__(self) -> None:
        super().__init__()
        self.cap = 8
        self.mem = mmap.mmap(-1, Ring.nbytes(self.cap, DT))
        self.ring = Ring(self.mem, 0, self.cap, DT)
        self.model: collections.deque[tuple[int, int]] = collections.deque()
        self.n = 0

    @rule(v=st.integers(-(2**63), 2**63 - 1))
    def put(self, v: int) -> None:
        if len(self.model) == self.cap:
            with pytest.raises(WouldBlock):
                self.ring.put_nowait((self.n, v))
        else:
            self.ring.put_nowait((self.n, v))
            self.model.append((self.n, v))
        self.n += 1

    @rule()
    def get(self) -> None:
        if not self.model:
            with pytest.raises(WouldBlock):
                self.ring.get_nowait()
        else:
            r = self.ring.get_nowait()
            assert (int(r["seq"]), int(r["val"])) == self.model.popleft()

    @precondition(lambda self: True)
    @rule(k=st.integers(1, 10))
    def get_batch(self, k: int) -> None:
        got = self.ring.get_batch(k)
        want = [self.model.popleft() for _ in range(min(k, len(self.model)))]
        assert [(int(r["seq"]), int(r["val"])) for r in got] == want

    @invariant()
    def sizes(self) -> None:
        assert len(self.ring) == len(self.model)
        assert self.ring.free() == self.cap - len(self.model)


TestRingModel = RingVsDeque.TestCase


def test_capacity_must_be_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        Ring(mmap.mmap(-1, 4096), 0, 6, DT)


def _producer(name: str, n: int) -> None:
    seg = Segment.attach(name)
    ring = Ring(seg.buf, 0, 64, DT)
    for i in range(n):
        ring.put((i, i * 7), timeout_s=30)


def test_cross_process_order_and_content() -> None:
    """A real second process produces 50,000 records through a 64-slot ring: none lost, none reordered."""
    name = f"kvs.test.ring.{id(object())}"
    seg = Segment.create(name, Ring.nbytes(64, DT))
    try:
        ring = Ring(seg.buf, 0, 64, DT)
        n = 50_000
        p = multiprocess.get_context("spawn").Process(target=_producer, args=(name, n))
        p.start()
        got: list[Any] = []
        import time
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            got.extend(ring.get_batch(64).tolist())
        p.join(10)
        assert p.exitcode == 0
        assert got == [(i, i * 7) for i in range(n)]
    finally:
        del ring
        seg.close()
        seg.unlink()
