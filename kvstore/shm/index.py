"""The key index: key digest -> global slot id, an open-addressing hash table in shm.

Layout (docs/FORMAT.md "Key index"): ``capacity`` (a power of two, at least
twice the slot count) entries of 16 bytes::

    off size field
      0    8  tag   u64, first 8 bytes of the key digest
      8    8  gid   i64, global slot id; -1 = empty

Linear probing. The slot table is the truth: an entry counts only while its
slot is VALID and holds a digest whose first word is the entry's tag, and a
hit needs the full 32-byte digest to match. So nothing is ever deleted here:
when a slot is retired or rewritten its entry simply stops counting
("garbage"), inserts reuse garbage entries on their probe path, and the table
is rebuilt from the slot table when used entries pass 3/4 of the capacity.
Why not delete eagerly: merging peers' updates must stay vectorized (numpy over
whole batches), and back-shift deletion is inherently one entry at a time.

A key may have several entries (copies in several areas). ``lookup`` prefers
a copy in a ``local`` slot, and falls back to another when one is retired.

The supervisor is the only writer; clients read the table without a lock
(``IndexReader``, in compiled code). That is safe because an insert only fills an
empty entry or one whose slot no longer holds its key: the entry of a key that is
present never changes under a reader, and an entry never becomes empty again. Only
``rebuild`` rewrites everything, so it runs inside a seqlock (the index head's
``seq`` is odd meanwhile); a reader that overlapped one retries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ioworkers.aio import FFI, LIB
from .slots import VALID, entry_words

ENTRY_DTYPE = np.dtype([("tag", "<u8"), ("gid", "<i8")])
REBUILD_FILL = 0.75
INDEX_HEAD_BYTES = 64  # u64 seq (the rebuild seqlock), then reserved
READ_TRIES = 8         # lookups that overlap a rebuild before a reader gives up (each waits a bit longer)


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
    used: int
    """Entries holding a gid (live or garbage)."""
    rebuilds: int
    """Times the table was rebuilt from the slot table."""


class KeyIndex:
    """Open-addressing table over ``entries`` (numpy view), checked against ``slots``.

    Invariant: every VALID slot's key has an entry reachable by probing from
    ``tag & mask`` before the first empty entry.
    """

    def __init__(self, entries: np.ndarray[Any, Any], slots: np.ndarray[Any, Any], *, init: bool,
                 seq: np.ndarray[Any, Any] | None = None) -> None:
        """``seq``: the one-word seqlock readers in other processes check (private if None)."""
        self.e = entries
        self.seq = seq if seq is not None else np.zeros(1, dtype="<u8")
        self._seq_ptr = FFI.cast("uint64_t *", self.seq.ctypes.data)
        self.slots = slots
        self.capacity = len(entries)
        if self.capacity & (self.capacity - 1):
            raise ValueError("index capacity must be a power of two")
        self.mask = self.capacity - 1
        if init:
            self.e["gid"] = -1
            self.e["tag"] = 0
        self.used = int(np.count_nonzero(self.e["gid"] >= 0))
        self.rebuilds = 0

    def _live(self, gids: np.ndarray[Any, Any], tags: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        s = self.slots[np.maximum(gids, 0)]
        live: np.ndarray[Any, Any] = (gids >= 0) & (s["state"] == VALID) & (s["d0"] == tags)
        return live

    def lookup(self, words: np.ndarray[Any, Any], local: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
        """Global slot ids (``-1`` for a miss) of ``n x 4`` u64 digest words, vectorized.

        Args:
            words: digests as four little-endian u64 each.
            local: optional bool per slot; a hit in a local slot is preferred to others.
        """
        n = len(words)
        res = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return res
        tags = np.ascontiguousarray(words[:, 0])
        pos = (tags & np.uint64(self.mask)).astype(np.int64)
        active = np.arange(n)
        for _ in range(self.capacity):
            p = pos[active]
            g = self.e["gid"][p]
            t = self.e["tag"][p]
            empty = g < 0
            cand = ~empty & (t == tags[active])
            settled = empty.copy()
            if cand.any():
                ci = np.nonzero(cand)[0]
                s = self.slots[g[ci]]
                w = words[active[ci]]
                ok = ((s["d0"] == w[:, 0]) & (s["d1"] == w[:, 1]) & (s["d2"] == w[:, 2])
                      & (s["d3"] == w[:, 3]) & (s["state"] == VALID))
                hit_rows = active[ci[ok]]
                hit_gids = g[ci[ok]]
                if local is None:
                    res[hit_rows] = hit_gids
                    settled[ci[ok]] = True
                else:
                    is_local = local[hit_gids]
                    better = (res[hit_rows] < 0) | is_local
                    res[hit_rows[better]] = hit_gids[better]
                    settled[ci[ok][is_local]] = True  # a local copy ends the search
            active = active[~settled]
            if not len(active):
                break
            pos[active] = (pos[active] + 1) & self.mask
        return res

    def insert_many(self, words: np.ndarray[Any, Any], gids: np.ndarray[Any, Any]) -> None:
        """Index slots ``gids`` under digests ``words`` (``n x 4`` u64), vectorized.

        Each item takes the first entry on its probe path that is empty, garbage,
        or already points at its slot; items racing for one entry in the same
        round are ordered by position in the batch.
        """
        n = len(gids)
        if n == 0:
            return
        if self.used + n > REBUILD_FILL * self.capacity:
            self.rebuild()
            return  # the rebuild indexed every VALID slot, these included
        tags = np.ascontiguousarray(words[:, 0]).astype(np.uint64)
        gids = np.asarray(gids, dtype=np.int64)
        pos = (tags & np.uint64(self.mask)).astype(np.int64)
        pending = np.arange(n)
        for _ in range(self.capacity):
            p = pos[pending]
            g = self.e["gid"][p]
            t = self.e["tag"][p]
            free = (g < 0) | ~self._live(g, t) | (g == gids[pending])
            placed = np.zeros(len(pending), dtype=bool)
            if free.any():
                fi = np.nonzero(free)[0]
                _, first = np.unique(p[fi], return_index=True)
                win = fi[first]
                wp = p[win]
                self.used += int(np.count_nonzero(self.e["gid"][wp] < 0))
                self.e["tag"][wp] = tags[pending[win]]
                self.e["gid"][wp] = gids[pending[win]]
                placed[win] = True
            pending = pending[~placed]
            if not len(pending):
                return
            pos[pending] = (pos[pending] + 1) & self.mask
        raise RuntimeError("key index full")

    def insert(self, words: np.ndarray[Any, Any], gid: int) -> None:
        """Index one slot (see ``insert_many``)."""
        self.insert_many(np.asarray(words, dtype=np.uint64).reshape(1, 4), np.array([gid], dtype=np.int64))

    def rebuild(self) -> None:
        """Drop every entry and index all VALID slots again (clears the garbage)."""
        LIB.kv_seq_begin(self._seq_ptr)
        try:
            self.e["gid"] = -1
            self.e["tag"] = 0
            self.rebuilds += 1
            # one compiled pass over the slot table (the vectorized insert needs seconds and
            # gigabytes of temporaries at 10^7 slots)
            used = LIB.kv_index_fill(FFI.cast("void *", self.e.ctypes.data), self.capacity,
                                     FFI.cast("void *", self.slots.ctypes.data), len(self.slots))
            if used < 0:
                raise RuntimeError("key index full")
            self.used = int(used)
        finally:
            LIB.kv_seq_end(self._seq_ptr)

    def index_slots(self, gids: np.ndarray[Any, Any]) -> None:
        """Index slots ``gids`` under the digests the slot table holds for them."""
        if len(gids):
            self.insert_many(entry_words(self.slots[gids]), np.asarray(gids, dtype=np.int64))

    def statistics(self) -> IndexStatistics:
        """Capacity, used entries, rebuilds."""
        return IndexStatistics(self.capacity, self.used, self.rebuilds)


class IndexReader:
    """A lock-free reader of a key index another process writes (see the module doc).

    One ``lookup`` of any length is one call into compiled code; it also sets the CLOCK
    reference bit of every slot it finds, as a lookup in the service does.
    """

    def __init__(self, seq: np.ndarray[Any, Any], entries: np.ndarray[Any, Any], slots: np.ndarray[Any, Any],
                 ref: np.ndarray[Any, Any] | None = None) -> None:
        self._keep = (seq, entries, slots, ref)  # the views the pointers below point into
        self._seq = FFI.cast("uint64_t *", seq.ctypes.data)
        self._entries = FFI.cast("void *", entries.ctypes.data)
        self._capacity = len(entries)
        self._slots = FFI.cast("void *", slots.ctypes.data)
        self._nslots = len(slots)
        self._ref = FFI.cast("uint8_t *", ref.ctypes.data) if ref is not None else FFI.NULL

    def lookup(self, words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
        """Global slot ids (``-1``: miss) of ``n x 4`` u64 digests, or None when every try
        overlapped a rebuild of the table (ask the writer instead)."""
        words = np.ascontiguousarray(words, dtype="<u8")
        out = np.empty(len(words), dtype=np.int64)
        wp = FFI.cast("uint64_t *", words.ctypes.data)
        op = FFI.cast("int64_t *", out.ctypes.data)
        pause = 20e-6
        for _ in range(READ_TRIES):
            if LIB.kv_index_lookup(self._seq, self._entries, self._capacity, self._slots, self._nslots,
                                   wp, len(words), op, self._ref) >= 0:
                return out
            time.sleep(pause)  # a rebuild takes milliseconds at 10^6 slots: back off, then look again
            pause *= 4
        return None
