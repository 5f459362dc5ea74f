"""The key index: key digest -> global slot id, an open-addressing hash table in shm.

Layout (docs/FORMAT.md "Key index"): ``capacity`` (``index_capacity``: 7/4 of the
slot count, rounded up to a multiple of 8) entries of 8 bytes, each read and
written as one u64::

    off size field
      0    4  tag   u32, bits 0..31 of the digest's first word d0
      4    4  gid   u32, global slot id; 0xFFFFFFFF = empty

An entry's home is ``((d0 >> 32) * capacity) >> 32`` (the high half of d0 scaled to
the table, so the capacity need not be a power of two and the tag's bits are
independent of the home's); linear probing wraps at the end. Why 8 bytes and
7/4: shared memory stays under 64 bytes per slot (48 slot-table entry, 14
index, 1 reference byte); a 32-bit tag only filters probes, the truth is the
slot table. Limit: ``MAX_SLOTS`` (2^31) slots per store.

The slot table is the truth: an entry counts only while its slot is VALID and
holds a digest whose low 32 bits of d0 are the entry's tag, and a hit needs the
full 32-byte digest to match. So nothing is ever deleted here: when a slot is
retired or rewritten its entry simply stops counting ("garbage"), inserts reuse
garbage entries on their probe path, and the table is rebuilt from the slot
table when used entries pass 3/4 of the capacity. Why not delete eagerly: a
back-shift deletion moves entries, and a lock-free reader probing meanwhile
could miss a present key; retiring a slot stays one store to the slot table.

A key may have several entries (copies in several areas). ``lookup`` prefers
a copy in a ``local`` slot, and falls back to another when one is retired.

The supervisor is the only writer; clients read the table without a lock
(``IndexReader``, in compiled code). That is safe because an insert only fills an
empty entry or one whose slot no longer holds its key (one 8-byte store, so a
reader never sees a tag with another entry's gid): the entry of a key that is
present never changes under a reader, and an entry never becomes empty again. Only
``rebuild`` rewrites everything, so it runs inside a seqlock (the index head's
``seq`` is odd meanwhile); a reader that overlapped one retries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native.lib import FFI, LIB
from .slots import VALID, entry_words

ENTRY_DTYPE = np.dtype([("tag", "<u4"), ("gid", "<u4")])
EMPTY_GID = 0xFFFF_FFFF
EMPTY_ENTRY = 0xFFFF_FFFF_FFFF_FFFF  # the u64 of an empty entry (gid and tag all ones)
MAX_SLOTS = 1 << 31    # gids fit in u32 with room for EMPTY_GID; capacity stays below 2^32
REBUILD_FILL = 0.75
INDEX_HEAD_BYTES = 64  # u64 seq (the rebuild seqlock), then reserved
READ_TRIES = 8         # lookups that overlap a rebuild before a reader gives up (each waits a bit longer)


def index_capacity(total_slots: int) -> int:
    """Entries for ``total_slots`` slots: 7/4 of them rounded up to a multiple of 8 (min 16).

    Raises ``ValueError`` past ``MAX_SLOTS``."""
    if total_slots > MAX_SLOTS:
        raise ValueError(f"{total_slots} slots exceed the key index's limit of {MAX_SLOTS} per store; "
                         "use larger pages or fewer devices per store")
    return max(16, (7 * total_slots + 31) // 32 * 8)


def home(tags64: np.ndarray[Any, Any], capacity: int) -> np.ndarray[Any, Any]:
    """Home entries (int64) of digests whose first words are ``tags64`` (u64)."""
    h: np.ndarray[Any, Any] = (((tags64 >> np.uint64(32)) * np.uint64(capacity)) >> np.uint64(32)).astype(np.int64)
    return h


def _tags(d0: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    t: np.ndarray[Any, Any] = (d0 & np.uint64(0xFFFF_FFFF)).astype(np.uint32)
    return t


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

    Invariant: every VALID slot's key has an entry reachable by probing from its
    home before the first empty entry.
    """

    def __init__(self, entries: np.ndarray[Any, Any], slots: np.ndarray[Any, Any], *, init: bool,
                 seq: np.ndarray[Any, Any] | None = None) -> None:
        """``seq``: the one-word seqlock readers in other processes check (private if None)."""
        self.e = entries
        self._w = entries.view("<u8")  # each entry as one u64: stores of whole entries
        self.seq = seq if seq is not None else np.zeros(1, dtype="<u8")
        self._seq_ptr = FFI.cast("uint64_t *", self.seq.ctypes.data)
        self.slots = slots
        self.capacity = len(entries)
        self._ep = FFI.cast("void *", entries.ctypes.data)  # for the compiled insert and rebuild
        self._sp = FFI.cast("void *", slots.ctypes.data)
        if len(slots) > MAX_SLOTS or self.capacity >= 1 << 32 or self.capacity < 1:
            raise ValueError(f"an index of {self.capacity} entries over {len(slots)} slots is out of range")
        if init:
            self._w[:] = EMPTY_ENTRY
        self.used = int(np.count_nonzero(self.e["gid"] != EMPTY_GID))
        self.rebuilds = 0

    def _step(self, pos: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        nxt = pos + 1
        nxt[nxt == self.capacity] = 0
        return nxt

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
        d0 = np.ascontiguousarray(words[:, 0]).astype(np.uint64)
        tags = _tags(d0)
        pos = home(d0, self.capacity)
        active = np.arange(n)
        for _ in range(self.capacity):
            p = pos[active]
            g = self.e["gid"][p].astype(np.int64)
            t = self.e["tag"][p]
            empty = g == EMPTY_GID
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
            pos[active] = self._step(pos[active])
        return res

    def contains(self, words: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Per digest (``n x 4`` u64), whether a VALID slot holds it: the readers' compiled probe
        (a put's dedupe asks this for every page; ``lookup`` is its numpy twin that prefers
        local copies). The writer never overlaps its own rebuild, so no retry is needed."""
        words = np.ascontiguousarray(words, dtype="<u8").reshape(-1, 4)
        out = np.empty(len(words), dtype=np.int64)
        if len(words) and LIB.kv_index_lookup(self._seq_ptr, self._ep, self.capacity, self._sp, len(self.slots),
                                              FFI.cast("uint64_t *", words.ctypes.data), len(words),
                                              FFI.cast("int64_t *", out.ctypes.data), FFI.NULL) < 0:
            return self.lookup(words) >= 0  # cannot happen (see above): the numpy probe, to be safe
        return out >= 0

    def insert_many(self, words: np.ndarray[Any, Any], gids: np.ndarray[Any, Any]) -> None:
        """Index slots ``gids`` under digests ``words`` (``n x 4`` u64), in batch order.

        Each item takes the first entry on its probe path that is empty, garbage,
        or already points at its slot. The slots must already be VALID with these
        digests (readers find an entry the moment it is written). One compiled
        call for the batch: one write completing is one insert, and numpy's
        per-call overhead made that the supervisor's largest cost in a put.
        """
        n = len(gids)
        if n == 0:
            return
        if self.used + n > REBUILD_FILL * self.capacity:
            self.rebuild()
            return  # the rebuild indexed every VALID slot, these included
        d0 = np.ascontiguousarray(words[:, 0], dtype=np.uint64)
        g = np.ascontiguousarray(gids, dtype=np.int64)
        fresh = LIB.kv_index_insert(self._ep, self.capacity, self._sp, len(self.slots),
                                    FFI.cast("uint64_t *", d0.ctypes.data), FFI.cast("int64_t *", g.ctypes.data), n)
        if fresh < 0:
            raise RuntimeError("key index full")
        self.used += int(fresh)

    def insert(self, words: np.ndarray[Any, Any], gid: int) -> None:
        """Index one slot (see ``insert_many``)."""
        self.insert_many(np.asarray(words, dtype=np.uint64).reshape(1, 4), np.array([gid], dtype=np.int64))

    def rebuild(self) -> None:
        """Drop every entry and index all VALID slots again (clears the garbage)."""
        LIB.kv_seq_begin(self._seq_ptr)
        try:
            self._w[:] = EMPTY_ENTRY
            self.rebuilds += 1
            # one compiled pass over the slot table itself: no array of every VALID slot's gid
            # and digest (gigabytes at 10^7 slots)
            used = LIB.kv_index_fill(self._ep, self.capacity, self._sp, len(self.slots))
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

    def lookup_keys(self, blob: bytes, lens: bytes, salt: bytes, *, prefix: bool = False
                    ) -> tuple[np.ndarray[Any, Any], int] | None:
        """Digest (with the tenant's ``salt``) and look up keys packed by ``_keypack.pack``, in one
        compiled call (``kv_lookup_keys``).

        Returns the slot ids found (``-1``: miss) and how many keys were looked up: all of them,
        or with ``prefix`` only as far as needed to find the first miss (the keys after that read
        as misses); None where every try overlapped a rebuild of the table (ask the
        writer instead).
        """
        n = len(lens) // 8
        scratch = np.empty(64 * n, dtype=np.uint8)  # the n key ids (32 bytes each), then their salted digests
        out = np.full(n, -1, dtype=np.int64)  # what a prefix lookup does not reach stays a miss
        done = FFI.new("int64_t *")
        base = scratch.ctypes.data
        args = (FFI.from_buffer("uint8_t[]", blob), FFI.from_buffer("uint64_t[]", lens), n,
                FFI.from_buffer("uint8_t[]", salt), len(salt), self._seq, self._entries, self._capacity,
                self._slots, self._nslots, int(prefix), FFI.cast("uint8_t *", base),
                FFI.cast("uint64_t *", base + 32 * n), FFI.cast("int64_t *", out.ctypes.data), self._ref, done)
        pause = 20e-6
        for _ in range(READ_TRIES):
            if LIB.kv_lookup_keys(*args) >= 0:
                return out, int(done[0])
            out.fill(-1)
            time.sleep(pause)
            pause *= 4
        return None
