"""The key index: key digest -> global slot id, an open-addressing hash table in shm.

Layout (docs/FORMAT.md "Key index"): ``capacity`` (a power of two, at least
twice the slot count, so the load factor stays <= 0.5) entries of 16 bytes::

    off size field
      0    8  tag   u64, first 8 bytes of the key digest
      8    8  gid   i64, global slot id; -1 = empty

Linear probing; deletion shifts later entries back (no tombstones), so a probe
stops at the first empty entry. The tag only narrows the search: a candidate
counts as a hit only when the slot table holds the full 32-byte digest and the
slot is VALID. The supervisor is the only writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .slots import VALID

ENTRY_DTYPE = np.dtype([("tag", "<u8"), ("gid", "<i8")])


def index_capacity(total_slots: int) -> int:
    """Entries for ``total_slots`` slots: the next power of two >= 2 * slots (min 16)."""
    cap = 16
    while cap < 2 * total_slots:
        cap *= 2
    return cap


@dataclass(frozen=True)
class IndexStatistics:
    """A snapshot of the key index."""

    capacity: int
    """Entries in the table."""
    entries: int
    """Keys indexed."""
    max_probe: int
    """Longest probe sequence any insert needed (bounds a lookup)."""


class KeyIndex:
    """Open-addressing table over ``entries`` (numpy view) checked against ``slots``.

    Invariant: every key with a VALID slot that was inserted and not removed is
    found by probing from ``tag & mask`` before the first empty entry.
    """

    def __init__(self, entries: np.ndarray[Any, Any], slots: np.ndarray[Any, Any], *, init: bool) -> None:
        self.e = entries
        self.slots = slots
        self.capacity = len(entries)
        if self.capacity & (self.capacity - 1):
            raise ValueError("index capacity must be a power of two")
        self.mask = self.capacity - 1
        if init:
            self.e["gid"] = -1
            self.e["tag"] = 0
        self.count = int(np.count_nonzero(self.e["gid"] >= 0))
        self.max_probe = 0

    def lookup(self, words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Global slot ids (``-1`` for a miss) of ``n x 4`` u64 digest words, vectorized."""
        n = len(words)
        res = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return res
        tags = words[:, 0]
        pos = (tags & np.uint64(self.mask)).astype(np.int64)
        active = np.arange(n)
        for _ in range(self.max_probe + 1):
            p = pos[active]
            g = self.e["gid"][p]
            t = self.e["tag"][p]
            empty = g < 0
            cand = ~empty & (t == tags[active])
            hit = np.zeros(len(active), dtype=bool)
            if cand.any():
                ci = np.nonzero(cand)[0]
                s = self.slots[g[ci]]
                w = words[active[ci]]
                ok = ((s["d0"] == w[:, 0]) & (s["d1"] == w[:, 1]) & (s["d2"] == w[:, 2])
                      & (s["d3"] == w[:, 3]) & (s["state"] == VALID))
                hit[ci[ok]] = True
                res[active[ci[ok]]] = g[ci[ok]]
            active = active[~(empty | hit)]
            if not len(active):
                break
            pos[active] = (pos[active] + 1) & self.mask
        return res

    def _find_gid(self, tag: int, gid: int) -> int:
        p = tag & self.mask
        for _ in range(self.capacity):
            g = int(self.e["gid"][p])
            if g < 0:
                return -1
            if g == gid:
                return p
            p = (p + 1) & self.mask
        return -1

    def insert(self, words: np.ndarray[Any, Any], gid: int) -> None:
        """Index slot ``gid`` under the digest ``words`` (4 u64). A key may map to one slot:
        an existing entry for the same digest is replaced.

        Raises:
            RuntimeError: the table is full (cannot happen at load factor <= 0.5).
        """
        tag = int(words[0])
        p = tag & self.mask
        for dist in range(self.capacity):
            g = int(self.e["gid"][p])
            if g < 0:
                self.e[p] = (tag, gid)
                self.count += 1
                self.max_probe = max(self.max_probe, dist)
                return
            if int(self.e["tag"][p]) == tag:
                s = self.slots[g]
                if (int(s["d0"]), int(s["d1"]), int(s["d2"]), int(s["d3"])) == tuple(int(x) for x in words) \
                        or g == gid:
                    self.e[p] = (tag, gid)
                    return
            p = (p + 1) & self.mask
        raise RuntimeError("key index full")

    def remove(self, tag: int, gid: int) -> bool:
        """Remove the entry for slot ``gid`` (whose digest starts with ``tag``); True if found."""
        p = self._find_gid(tag, gid)
        if p < 0:
            return False
        # backward-shift deletion: move later entries of the cluster into the hole
        # when their home position is not between the hole and themselves.
        hole = p
        q = (p + 1) & self.mask
        while True:
            g = int(self.e["gid"][q])
            if g < 0:
                break
            home = int(self.e["tag"][q]) & self.mask
            if ((q - home) & self.mask) >= ((q - hole) & self.mask):
                self.e[hole] = self.e[q]
                hole = q
            q = (q + 1) & self.mask
        self.e[hole] = (0, -1)
        self.count -= 1
        return True

    def statistics(self) -> IndexStatistics:
        """Capacity, entries and the longest probe."""
        return IndexStatistics(self.capacity, self.count, self.max_probe)
