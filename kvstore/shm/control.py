"""The control segment's layout: what the supervisor and its workers write and clients only read.

In order, each part starting on a 64-byte boundary (docs/FORMAT.md "Control segment")::

    slot table      slots x 48 B       (shm/slots.py; the supervisor writes)
    index head      64 B: u64 seq      (odd while the key index is rebuilt; shm/index.py)
    key index       capacity x 8 B     (shm/index.py; the supervisor writes)
    reference bits  slots x 1 B        (CLOCK: set by the I/O workers for each page a client
                                        read, by the supervisor for its own reads; cleared
                                        by the allocator)

Clients map it read-only (with ``service.access_group``, the segment is group-readable, not
group-writable: the kernel refuses a client of another user a writable mapping), so what the
workers check a direct read against is the service's word. Every process computes the layout
from the slot count alone, so the hello only has to carry that number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .index import ENTRY_DTYPE, INDEX_HEAD_BYTES, index_capacity
from .slots import SLOT_DTYPE, slot_table


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
    nbytes: int
    """Size of the segment."""

    @classmethod
    def of(cls, slots: int) -> ControlLayout:
        """The layout for ``slots`` slots."""
        cap = index_capacity(slots)
        idx = _up64(slots * SLOT_DTYPE.itemsize)
        ref = _up64(idx + INDEX_HEAD_BYTES + cap * ENTRY_DTYPE.itemsize)
        return cls(slots, idx, cap, ref, _up64(ref + slots))

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
