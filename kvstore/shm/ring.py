"""A single-producer single-consumer ring of fixed-size records in shared memory.

Layout (``Ring.nbytes(capacity, dtype)`` bytes at ``offset`` in a segment)::

    off   size  field
      0      8  head      u64, records consumed (written by the consumer only)
     64      8  tail      u64, records produced (written by the producer only)
    128   cap*R records   numpy structured records of R = dtype.itemsize bytes

head and tail sit on separate cache lines so the two sides do not false-share.
Both only grow; ``tail - head`` is the fill level and ``index % capacity`` the
record position (capacity is a power of two).

Memory order: the producer writes the record, then publishes it with a
store-release of ``tail``; the consumer load-acquires ``tail`` before reading
records, and store-releases ``head`` only after it copied the record out, so
the producer never overwrites a record still being read. Plain Python stores
would be enough on x86_64 but not on aarch64, hence the C atomics.

Wake-ups are not the ring's business: producers post the consumer's wake-up FIFO
(``shm/wake.py``), which it waits on with a timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import WouldBlock


class RingCorrupt(ValueError):
    """The producer's ``tail`` is impossible: behind the consumer's own head, or more than the
    capacity ahead of it (a producer that writes garbage into its own ring)."""
from .._native.lib import FFI, LIB

HEAD_OFF = 0
TAIL_OFF = 64
DATA_OFF = 128


@dataclass(frozen=True)
class RingStatistics:
    """A snapshot of one ring."""

    capacity: int
    """Records the ring holds."""
    used: int
    """Records produced and not yet consumed."""
    produced: int
    """Records produced since the ring was created."""


class Ring:
    """SPSC ring over ``buf[offset:offset+nbytes]``; see the module docstring for the protocol.

    Invariant: ``0 <= tail - head <= capacity``. Exactly one process calls the
    producer methods and exactly one the consumer methods.
    """

    def __init__(self, buf: Any, offset: int, capacity: int, dtype: np.dtype[Any]) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, got {capacity}")
        self.capacity = capacity
        self.dtype = dtype
        self._mask = capacity - 1
        base = FFI.from_buffer(buf)
        self._head = FFI.cast("uint64_t *", base + offset + HEAD_OFF)
        self._tail = FFI.cast("uint64_t *", base + offset + TAIL_OFF)
        self._recs = np.frombuffer(buf, dtype=dtype, count=capacity, offset=offset + DATA_OFF)
        self._keep = base  # keeps the cffi buffer reference alive
        self._empty: np.ndarray[Any, Any] = self._recs[:0].copy()
        self._mine: int | None = None  # get_checked: the consumer's own head

    def point(self, dst: Any) -> None:
        """Point a ``struct kv_ring`` (compiled code's view of a ring) at this ring."""
        dst.head = self._head
        dst.tail = self._tail
        dst.recs = FFI.cast("uint8_t *", self._recs.ctypes.data)
        dst.mask = self.capacity - 1

    @staticmethod
    def nbytes(capacity: int, dtype: np.dtype[Any]) -> int:
        """Bytes a ring of ``capacity`` records of ``dtype`` occupies (a multiple of 64)."""
        n = DATA_OFF + capacity * dtype.itemsize
        return (n + 63) // 64 * 64

    def reset(self) -> None:
        """Empty the ring. Only when neither side is running (e.g. after its peer died)."""
        LIB.kv_store_release_u64(self._head, 0)
        LIB.kv_store_release_u64(self._tail, 0)

    # producer side
    def put_nowait(self, rec: Any) -> None:
        """Append one record (a tuple matching the dtype, or a structured scalar).

        Raises:
            WouldBlock: the ring is full.
        """
        tail = int(self._tail[0])  # only we write tail: a plain load is exact
        if tail - LIB.kv_load_acquire_u64(self._head) >= self.capacity:
            raise WouldBlock("ring is full")
        self._recs[tail & self._mask] = rec
        LIB.kv_store_release_u64(self._tail, tail + 1)

    def put_many(self, recs: np.ndarray[Any, Any]) -> None:
        """Append all of ``recs`` (an array of the ring's dtype) or nothing.

        Raises:
            WouldBlock: fewer than ``len(recs)`` records of room.
        """
        n = len(recs)
        tail = int(self._tail[0])
        if tail + n - LIB.kv_load_acquire_u64(self._head) > self.capacity:
            raise WouldBlock("ring has no room for the batch")
        start = tail & self._mask
        first = min(n, self.capacity - start)
        self._recs[start:start + first] = recs[:first]
        if first < n:
            self._recs[:n - first] = recs[first:]
        LIB.kv_store_release_u64(self._tail, tail + n)

    def put(self, rec: Any, timeout_s: float) -> None:
        """Append one record, waiting up to ``timeout_s`` for room (polling every 50 us..1 ms).

        Raises:
            WouldBlock: still full at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        pause = 50e-6
        while True:
            try:
                return self.put_nowait(rec)
            except WouldBlock:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def free(self) -> int:
        """Records that can be appended now without blocking."""
        return self.capacity - (int(self._tail[0]) - LIB.kv_load_acquire_u64(self._head))

    # consumer side
    def get_nowait(self) -> Any:
        """Remove and return the oldest record (a copy).

        Raises:
            WouldBlock: the ring is empty.
        """
        head = int(self._head[0])
        if LIB.kv_load_acquire_u64(self._tail) == head:
            raise WouldBlock("ring is empty")
        rec = self._recs[head & self._mask].copy()
        LIB.kv_store_release_u64(self._head, head + 1)
        return rec

    def get_checked(self) -> Any:
        """Remove and return the oldest record (a copy), for a consumer that does not trust the
        producer: the head is kept here (the shared word is only published), and the tail is
        checked against it.

        Raises:
            WouldBlock: the ring is empty.
            RingCorrupt: the tail is impossible; nothing is read.
        """
        if self._mine is None:
            self._mine = int(LIB.kv_load_acquire_u64(self._head))
        n = (int(LIB.kv_load_acquire_u64(self._tail)) - self._mine) % (1 << 64)
        if n == 0:
            raise WouldBlock("ring is empty")
        if n > self.capacity:
            raise RingCorrupt(f"ring tail {n} records ahead of the head (capacity {self.capacity})")
        rec = self._recs[self._mine & self._mask].copy()
        self._mine += 1
        LIB.kv_store_release_u64(self._head, self._mine)
        return rec

    def get_batch(self, max_n: int) -> np.ndarray[Any, Any]:
        """Remove and return up to ``max_n`` records (copies, oldest first); empty if none (one
        shared empty array, which callers must not modify)."""
        head = int(self._head[0])
        n = min(int(LIB.kv_load_acquire_u64(self._tail)) - head, max_n)
        if n <= 0:
            return self._empty
        idx = (np.arange(head, head + n, dtype=np.uint64) & np.uint64(self._mask)).astype(np.intp)
        out: np.ndarray[Any, Any] = self._recs[idx]  # fancy indexing copies
        LIB.kv_store_release_u64(self._head, head + n)
        return out

    def __len__(self) -> int:
        return int(LIB.kv_load_acquire_u64(self._tail)) - int(LIB.kv_load_acquire_u64(self._head))

    def statistics(self) -> RingStatistics:
        """Capacity, fill level and total produced."""
        tail = int(LIB.kv_load_acquire_u64(self._tail))
        return RingStatistics(self.capacity, tail - int(LIB.kv_load_acquire_u64(self._head)), tail)
