"""The owner's delta log and the supervisor <-> sync agent rings.

``DeltaLog`` keeps the last ``capacity`` updates this server made to its own
registers, numbered by a sequence that starts at 0 in every epoch (service
run). A peer that missed updates asks "from seq S of epoch E": the answer is
the log's tail when it still reaches back to S in the same epoch, otherwise a
snapshot of the owner's areas (a big delta: the join does not care).

The sync segment holds two rings of ``SYNC_REC`` (64 bytes; docs/FORMAT.md):

    out  supervisor -> agent: K_DELTA (own update, with its seq),
         K_ANSWER (a register for one peer's answer), K_ANSWER_END
    in   agent -> supervisor: K_REMOTE (a peer's validated register),
         K_REQUEST (a peer asks for our log from a seq)
    both K_HINT: hit hints, batched and lossy (dropped when a ring is full)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..shm.ring import Ring
from .register import REGISTER_DTYPE

K_DELTA = 1
K_ANSWER = 2
K_ANSWER_END = 3
K_REMOTE = 4
K_REQUEST = 5
K_HINT = 6  # out: slots of owner ``peer`` we read (a hit hint); in: our slots that peer ``peer`` read

#: bits of ``state`` in K_ANSWER_END
END_SNAPSHOT = 1
END_LAST = 2

SYNC_REC = np.dtype([
    ("kind", "u1"),      # K_*
    ("state", "u1"),     # register state; K_ANSWER_END: END_* flags
    ("device", "<u2"),
    ("area", "<u2"),
    ("peer", "<u2"),     # the peer concerned (area index): source of K_REMOTE/K_REQUEST, target of answers
    ("slot", "<u4"),
    ("length", "<u4"),
    ("gen", "<u8"),      # register generation; K_REQUEST: the epoch the peer knows; K_ANSWER_END: next seq
    ("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"),
    ("seq", "<u8"),      # K_DELTA: its seq; K_REQUEST: from seq; K_ANSWER_END: from seq
])
assert SYNC_REC.itemsize == 64

RING_CAP = 1 << 16
REG_FIELDS = ("device", "area", "slot", "gen", "d0", "d1", "d2", "d3", "length", "state")


class SyncRings:
    """The two rings of the sync segment."""

    def __init__(self, buf: Any) -> None:
        self.out = Ring(buf, 0, RING_CAP, SYNC_REC)
        self.inn = Ring(buf, Ring.nbytes(RING_CAP, SYNC_REC), RING_CAP, SYNC_REC)

    @staticmethod
    def nbytes() -> int:
        """Size of the sync segment."""
        return 2 * Ring.nbytes(RING_CAP, SYNC_REC)


def to_sync(regs: np.ndarray[Any, Any], kind: int, peer: int = 0, seq0: int = 0) -> np.ndarray[Any, Any]:
    """Registers as ring records (``seq`` numbered from ``seq0`` for K_DELTA)."""
    out = np.zeros(len(regs), dtype=SYNC_REC)
    out["kind"] = kind
    out["peer"] = peer
    for f in REG_FIELDS:
        out[f] = regs[f]
    if kind == K_DELTA:
        out["seq"] = np.arange(seq0, seq0 + len(regs), dtype=np.uint64)
    return out


def to_registers(recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Ring records back to wire registers."""
    out = np.zeros(len(recs), dtype=REGISTER_DTYPE)
    for f in REG_FIELDS:
        out[f] = recs[f]
    return out


class DeltaLog:
    """The last ``capacity`` own updates, by sequence number. Invariant: holds seqs
    ``[first, next)`` with ``next - first <= capacity``."""

    def __init__(self, capacity: int) -> None:
        if capacity & (capacity - 1):
            raise ValueError("capacity must be a power of two")
        self.capacity = capacity
        self.buf = np.zeros(capacity, dtype=REGISTER_DTYPE)
        self.next = 0

    @property
    def first(self) -> int:
        """Oldest sequence number still held."""
        return max(0, self.next - self.capacity)

    def append(self, regs: np.ndarray[Any, Any]) -> int:
        """Append registers; returns the seq of the first."""
        seq0 = self.next
        n = len(regs)
        if n > self.capacity:
            regs = regs[-self.capacity:]
            self.next += n - self.capacity
            n = self.capacity
        idx = (np.arange(self.next, self.next + n) & (self.capacity - 1))
        self.buf[idx] = regs
        self.next += n
        return seq0

    def since(self, seq: int) -> np.ndarray[Any, Any] | None:
        """Updates from ``seq`` on, or ``None`` if the log no longer reaches back that far."""
        if seq < self.first or seq > self.next:
            return None
        idx = np.arange(seq, self.next) & (self.capacity - 1)
        out: np.ndarray[Any, Any] = self.buf[idx]
        return out
