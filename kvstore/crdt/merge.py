"""The join, vectorized: apply a batch of registers to the slot table in shared memory.

``apply`` is what the supervisor runs on every batch of peers' records (and
what the property tests check for the CRDT laws). It keeps, per slot, the
register with the larger ``(gen, state)``; duplicates inside one batch are
resolved the same way first, so the result does not depend on batch order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..shm.slots import SlotMap


def order_key(gen: np.ndarray[Any, Any], state: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """(gen, state) as one sortable key: gen * 4 + state (states are < 4).

    Generations are below 2**62 (microseconds since the epoch stay far below), so
    the product does not overflow a u64.
    """
    key: np.ndarray[Any, Any] = gen.astype(np.uint64) * np.uint64(4) + state.astype(np.uint64)
    return key


def gids_of(smap: SlotMap, recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Global slot ids of records (whose device, area and slot were validated)."""
    bases = np.array(smap.bases, dtype=np.int64)
    out: np.ndarray[Any, Any] = bases[recs["device"].astype(np.int64), recs["area"].astype(np.int64)] \
        + recs["slot"].astype(np.int64)
    return out


def apply(slots: np.ndarray[Any, Any], gids: np.ndarray[Any, Any], recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Join ``recs`` (REGISTER_DTYPE) into ``slots`` at ``gids``; return the gids that changed.

    Invariant kept: ``order_key(slots[g])`` never decreases.

    Both layouts are handled as rows of u64 words, which is what makes this fast:
    a slot entry is 6 words (gen, d0..d3, length|state|pad) and a register 7
    (device|area|slot, then the same 6), so a whole register is gathered,
    compared and scattered with one fancy-indexing operation each.
    """
    n = len(recs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    R = np.ascontiguousarray(recs).view("<u8").reshape(n, 7)
    S = slots.view("<u8").reshape(len(slots), 6)
    k = R[:, 1] * np.uint64(4) + ((R[:, 6] >> np.uint64(32)) & np.uint64(0xFF))
    # newest record per gid within the batch: group by gid, keep a record with the group's max key
    order = np.argsort(gids, kind="stable")
    g_sorted = gids[order]
    starts = np.flatnonzero(np.r_[True, g_sorted[1:] != g_sorted[:-1]])
    if len(starts) == n:
        pick = order
    else:
        k_sorted = k[order]
        best = np.maximum.reduceat(k_sorted, starts)
        is_best = k_sorted == np.repeat(best, np.diff(np.r_[starts, n]))
        # first record holding the max of each group
        first = np.flatnonzero(is_best & np.r_[True, ~(is_best[:-1] & (g_sorted[1:] == g_sorted[:-1]))])
        pick = order[first]
    g = gids[pick]
    cur = S[g]
    cur_k = cur[:, 0] * np.uint64(4) + ((cur[:, 5] >> np.uint64(32)) & np.uint64(0xFF))
    newer = k[pick] > cur_k
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
