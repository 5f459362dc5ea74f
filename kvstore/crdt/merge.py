"""The join, vectorized: apply a batch of registers to the slot table in shared memory.

``apply`` is what the supervisor runs on every batch of peers' records (and
what the property tests check for the CRDT laws). It keeps, per slot, the
register that is greater in ``(gen, state, digest, length)`` order; duplicates inside one batch are
resolved the same way first, so the result does not depend on batch order. The
order is total over the whole register (``order_columns``), so two registers
that tie on ``(gen, state)`` but differ in content still converge everywhere.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..shm.slots import SLOT_DTYPE, SLOT_WORDS, SlotMap

# the word view below reads a slot entry as SLOT_DTYPE lays it out (kvstore.h struct kv_slot):
# gen, d0..d3, then length in the low half of the last word and state in its next byte
assert SLOT_WORDS == 6 and SLOT_DTYPE.fields is not None
assert SLOT_DTYPE.fields["length"][1] == 8 * (SLOT_WORDS - 1) and SLOT_DTYPE.fields["state"][1] == 8 * (SLOT_WORDS - 1) + 4


_LOW32 = np.uint64(0xFFFF_FFFF)


def order_columns(gen: np.ndarray[Any, Any], state: np.ndarray[Any, Any], digest: np.ndarray[Any, Any],
                  length: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The total order over whole registers, as an n x 7 u64 matrix compared row-wise,
    lexicographically: ``(gen, state, d0, d1, d2, d3, length)``.

    ``(gen, state)`` decide every case an honest owner produces; the digest and
    length only break ties between registers that agree on both but differ in
    content (a confused or forged owner, or a slot reused under a restored clock).
    Without them the winner would be whichever arrived first, and replicas
    could disagree for ever.
    """
    return np.column_stack([gen.astype(np.uint64), state.astype(np.uint64), digest.astype(np.uint64),
                            length.astype(np.uint64)])


def _greater(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Row-wise lexicographic ``a > b`` of two n x k matrices."""
    diff = a != b
    first = np.argmax(diff, axis=1)
    rows = np.arange(len(a))
    out: np.ndarray[Any, Any] = diff.any(axis=1) & (a[rows, first] > b[rows, first])
    return out


def gids_of(smap: SlotMap, recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Global slot ids of records (whose device, area and slot were validated)."""
    bases = np.array(smap.bases, dtype=np.int64)
    out: np.ndarray[Any, Any] = bases[recs["device"].astype(np.int64), recs["area"].astype(np.int64)] \
        + recs["slot"].astype(np.int64)
    return out


def apply(slots: np.ndarray[Any, Any], gids: np.ndarray[Any, Any], recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Join ``recs`` (REGISTER_DTYPE) into ``slots`` at ``gids``; return the gids that changed.

    Invariant kept: per slot, the register only grows in ``order_columns`` order, so
    the result is the same whatever the order, grouping or duplication of batches.

    Both layouts are handled as rows of u64 words, which is what makes this fast:
    a slot entry is ``SLOT_WORDS`` (6) words (gen, d0..d3, length|state|pad) and a register one
    more (device|area|slot, then the same 6), so a whole register is gathered,
    compared and scattered with one fancy-indexing operation each.
    """
    n = len(recs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    R = np.ascontiguousarray(recs).view("<u8").reshape(n, SLOT_WORDS + 1)
    S = slots.view("<u8").reshape(len(slots), SLOT_WORDS)
    k = order_columns(R[:, 1], (R[:, 6] >> np.uint64(32)) & np.uint64(0xFF), R[:, 2:6], R[:, 6] & _LOW32)
    # the greatest record per gid within the batch: sort by gid, then by the order, keep each group's last
    order = np.lexsort(tuple(k[:, c] for c in range(k.shape[1] - 1, -1, -1)) + (gids,))
    g_sorted = gids[order]
    last = np.r_[g_sorted[1:] != g_sorted[:-1], True]
    pick = order[last]
    g = gids[pick]
    cur = S[g]
    cur_k = order_columns(cur[:, 0], (cur[:, 5] >> np.uint64(32)) & np.uint64(0xFF), cur[:, 1:5],
                          cur[:, 5] & _LOW32)
    newer = _greater(k[pick], cur_k)
    g = g[newer]
    if len(g):
        rows = R[pick[newer], 1:7]
        rows[:, 5] &= np.uint64(0xFF_FFFF_FFFF)  # length and state; the pad stays zero
        S[g] = rows
    changed: np.ndarray[Any, Any] = g
    return changed


def registers_of(slots: np.ndarray[Any, Any], smap: SlotMap, device: int, area: int) -> np.ndarray[Any, Any]:
    """Registers of one area in a wire state (VALID or RETIRED), as wire records (a snapshot).

    A slot being written (WRITING) is left out: peers keep its tombstone until the
    commit arrives with the same generation and state VALID.
    """
    from ..shm.slots import RETIRED, VALID
    from .register import REGISTER_DTYPE

    r = smap.area_gids(device, area)
    s = slots[r.start:r.stop]
    idx = np.nonzero((s["gen"] > 0) & ((s["state"] == VALID) | (s["state"] == RETIRED)))[0]
    out = np.zeros(len(idx), dtype=REGISTER_DTYPE)
    out["device"] = device
    out["area"] = area
    out["slot"] = idx
    for f in ("gen", "d0", "d1", "d2", "d3", "length", "state"):
        out[f] = s[f][idx]
    return out
