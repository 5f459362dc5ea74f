"""Slot tables: what every slot of every area of every device holds, as this server knows it.

One numpy structured array for the whole store, indexed by global slot id
``gid = area_base[device][area] + slot``. Entry layout (48 bytes; docs/FORMAT.md)::

    off size field
      0    8  generation  u64, 0 = never written
      8   32  digest      BLAKE2b-256 key digest, as four u64 (d0..d3)
     40    4  length      u32, payload bytes
     44    1  state       u8: EMPTY, WRITING, VALID, RETIRED
     45    3  pad

The supervisor is the only writer (it applies local completions and, later,
peers' CRDT deltas: "keep the higher generation"); other processes only read.
"""

from __future__ import annotations

import bisect

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._native.lib import const

# declared once, in kvstore/_native/kvstore.h (struct kv_slot; tests/native compare the dtype)
EMPTY = const("KV_SLOT_EMPTY")
WRITING = const("KV_SLOT_WRITING")
VALID = const("KV_SLOT_VALID")
RETIRED = const("KV_SLOT_RETIRED")

SLOT_DTYPE = np.dtype([
    ("gen", "<u8"), ("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"),
    ("length", "<u4"), ("state", "u1"), ("pad", "V3"),
])
assert SLOT_DTYPE.itemsize == 48
SLOT_WORDS = SLOT_DTYPE.itemsize // 8
"""A slot entry as u64 words (gen, d0..d3, length|state|pad): how merges handle a table's rows."""


def digest_words(digests: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """View ``n x 32`` uint8 digests as ``n x 4`` little-endian u64 words."""
    return np.ascontiguousarray(digests, dtype=np.uint8).reshape(-1, 32).view("<u8")


def entry_words(entries: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The key digests of slot-table entries (or registers) as ``n x 4`` u64 words."""
    words: np.ndarray[Any, Any] = np.stack([entries["d0"], entries["d1"], entries["d2"], entries["d3"]],
                                           axis=1).astype("<u8", copy=False)
    return words


class SlotMap:
    """Maps (device, area, slot) to a global slot id and back.

    Invariant: areas are laid out device-major: all areas of device 0, then device 1, ...
    """

    def __init__(self, counts: Sequence[Sequence[int]]) -> None:
        """``counts[device][area]`` is the slot count of that area."""
        self.counts = [list(c) for c in counts]
        self.n_devices = len(counts)
        self.n_areas = len(counts[0]) if counts else 0
        bases = []
        acc = 0
        for dev in self.counts:
            row = []
            for c in dev:
                row.append(acc)
                acc += c
            bases.append(row)
        self.bases = bases
        self.total = acc
        # lookup arrays for gid -> (device, area, slot)
        flat_bases = np.array([b for row in bases for b in row], dtype=np.int64)
        self._flat_bases = flat_bases
        self._base_list = flat_bases.tolist()

    def gid(self, device: int, area: int, slot: int) -> int:
        """Global slot id; raises ``IndexError`` for an out-of-range triple."""
        if not (0 <= device < self.n_devices and 0 <= area < self.n_areas
                and 0 <= slot < self.counts[device][area]):
            raise IndexError(f"slot ({device}, {area}, {slot}) out of range")
        return self.bases[device][area] + slot

    def locate(self, gid: int) -> tuple[int, int, int]:
        """(device, area, slot) of a global slot id (as ``locate_many``, without numpy: it is
        called per I/O)."""
        k = bisect.bisect_right(self._base_list, gid) - 1
        return k // self.n_areas, k % self.n_areas, gid - self._base_list[k]

    def locate_many(self, gids: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any],
                                                               np.ndarray[Any, Any]]:
        """(device, area, slot) arrays of global slot ids, vectorized. An empty area shares its
        base with the next one; searching to the right picks the area that holds the slot."""
        k = np.searchsorted(self._flat_bases, gids, side="right") - 1
        return k // self.n_areas, k % self.n_areas, gids - self._flat_bases[k]

    def area_gids(self, device: int, area: int) -> range:
        """Global ids of one area's slots."""
        b = self.bases[device][area]
        return range(b, b + self.counts[device][area])


def slot_table(buf: Any, offset: int, total: int) -> np.ndarray[Any, Any]:
    """The slot table view of ``total`` entries at ``offset`` in ``buf``."""
    return np.frombuffer(buf, dtype=SLOT_DTYPE, count=total, offset=offset)
