"""The control segment's layout: what the supervisor, its workers and its clients all map.

In order, each part starting on a 64-byte boundary (docs/FORMAT.md "Control segment")::

    slot table      slots x 48 B       (shm/slots.py; the supervisor writes)
    index head      64 B: u64 seq      (odd while the key index is rebuilt; shm/index.py)
    key index       capacity x 8 B     (shm/index.py; the supervisor writes)
    reference bits  slots x 1 B        (CLOCK: set by whoever finds a page, cleared by the allocator)
    arena states    arena_count x u32  (shm/arena.py; each buffer's current owner writes)
    connections     max_clients x 16 B (CONN_DTYPE; the supervisor writes, the I/O workers
                                        read it to find the connections they serve reads for)

Every process computes it from the slot count, the arena size and the number of
connections alone, so the hello only has to carry those numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arena import Arena
from .index import ENTRY_DTYPE, INDEX_HEAD_BYTES, index_capacity
from .slots import SLOT_DTYPE, slot_table


#: one connection as the I/O workers see it
CONN_DTYPE = np.dtype([
    ("gen", "<u8"),          # the connection's generation (unique per service run); 0: none
    ("lease_start", "<u4"),  # first arena buffer of its lease
    ("lease_count", "<u4"),  # buffers in its lease
])
assert CONN_DTYPE.itemsize == 16


def _up64(n: int) -> int:
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class ControlLayout:
    """Byte offsets of the parts of a control segment."""

    slots: int
    """Slot-table entries (every slot of every area of every device)."""
    index_offset: int
    """Offset of the index head; its entries follow it."""
    index_capacity: int
    """Entries in the key index (``index_capacity``: 7/4 of the slots)."""
    ref_offset: int
    """Offset of the reference bits, one byte per slot."""
    states_offset: int
    """Offset of the arena buffer states."""
    conns_offset: int
    """Offset of the connection table."""
    max_clients: int
    """Entries in the connection table."""
    nbytes: int
    """Size of the segment."""

    @classmethod
    def of(cls, slots: int, arena_count: int, max_clients: int) -> ControlLayout:
        """The layout for ``slots`` slots, an arena of ``arena_count`` buffers and ``max_clients``
        connections."""
        cap = index_capacity(slots)
        idx = _up64(slots * SLOT_DTYPE.itemsize)
        ref = _up64(idx + INDEX_HEAD_BYTES + cap * ENTRY_DTYPE.itemsize)
        states = _up64(ref + slots)
        conns = states + Arena.states_nbytes(arena_count)
        return cls(slots, idx, cap, ref, states, conns, max_clients, conns + _up64(max_clients * CONN_DTYPE.itemsize))

    def slot_table(self, buf: Any) -> np.ndarray[Any, Any]:
        """The slot table in ``buf``."""
        return slot_table(buf, 0, self.slots)

    def index_seq(self, buf: Any) -> np.ndarray[Any, Any]:
        """The index's seqlock word (a one-element u64 array) in ``buf``."""
        return np.frombuffer(buf, dtype="<u8", count=1, offset=self.index_offset)

    def index_entries(self, buf: Any) -> np.ndarray[Any, Any]:
        """The key index's entries in ``buf``."""
        return np.frombuffer(buf, dtype=ENTRY_DTYPE, count=self.index_capacity,
                             offset=self.index_offset + INDEX_HEAD_BYTES)

    def ref_bits(self, buf: Any) -> np.ndarray[Any, Any]:
        """The reference bits in ``buf``."""
        return np.frombuffer(buf, dtype=np.uint8, count=self.slots, offset=self.ref_offset)

    def connections(self, buf: Any) -> np.ndarray[Any, Any]:
        """The connection table in ``buf``."""
        return np.frombuffer(buf, dtype=CONN_DTYPE, count=self.max_clients, offset=self.conns_offset)
