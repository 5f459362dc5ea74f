from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.shm.index import ENTRY_DTYPE, KeyIndex, index_capacity
from kvstore.shm.slots import EMPTY, SLOT_DTYPE, VALID, digest_words

N = 64


def words_of(k: int, collide: bool) -> np.ndarray:
    d = bytearray(hashlib.blake2b(str(k).encode(), digest_size=32).digest())
    if collide:  # same home position for many keys: exercises probing and back-shift
        d[0:8] = (k % 3).to_bytes(8, "little")
    return digest_words(np.frombuffer(bytes(d), np.uint8))[0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ins", "del"]), st.integers(0, N - 1)), max_size=200), st.booleans())
def test_index_matches_dict(ops: list[tuple[str, int]], collide: bool) -> None:
    slots = np.zeros(N, SLOT_DTYPE)
    ix = KeyIndex(np.zeros(index_capacity(N), ENTRY_DTYPE), slots, init=True)
    model: dict[int, int] = {}
    for op, k in ops:
        w = words_of(k, collide)
        gid = k  # one slot per key in this model
        if op == "ins" and k not in model:
            slots[gid]["d0"], slots[gid]["d1"], slots[gid]["d2"], slots[gid]["d3"] = (int(x) for x in w)
            slots[gid]["state"] = VALID
            ix.insert(w, gid)
            model[k] = gid
        elif op == "del" and k in model:
            slots[gid]["state"] = EMPTY  # retiring the slot is what unindexes it
            del model[k]
    allw = np.stack([words_of(k, collide) for k in range(N)])
    got = ix.lookup(allw)
    want = np.array([model.get(k, -1) for k in range(N)])
    assert (got == want).all()
    assert (ix.contains(allw) == (want >= 0)).all()  # the compiled probe a put's dedupe uses
    ix.rebuild()  # a rebuild from the slot table gives the same answers
    assert (ix.lookup(allw) == want).all()
    assert ix.statistics().used == len(model)


def test_lookup_requires_full_digest_and_valid_state() -> None:
    slots = np.zeros(4, SLOT_DTYPE)
    ix = KeyIndex(np.zeros(16, ENTRY_DTYPE), slots, init=True)
    w = words_of(1, False)
    slots[0]["d0"], slots[0]["d1"], slots[0]["d2"], slots[0]["d3"] = (int(x) for x in w)
    slots[0]["state"] = VALID
    ix.insert(w, 0)
    other = w.copy()
    other[3] ^= 1  # same tag, different digest
    assert ix.lookup(np.stack([w, other])).tolist() == [0, -1]
    slots[0]["state"] = EMPTY  # a slot that is not VALID is never a hit
    assert ix.lookup(np.stack([w])).tolist() == [-1]


def test_batch_insert_with_duplicates_and_local_preference() -> None:
    """Two copies of one key: the local one wins; when it is retired, the other is found."""
    slots = np.zeros(8, SLOT_DTYPE)
    ix = KeyIndex(np.zeros(16, ENTRY_DTYPE), slots, init=True)
    w = words_of(5, False)
    for g in (2, 6):
        slots[g]["d0"], slots[g]["d1"], slots[g]["d2"], slots[g]["d3"] = (int(x) for x in w)
        slots[g]["state"] = VALID
    ix.insert_many(np.stack([w, w]), np.array([2, 6]))
    local = np.zeros(8, dtype=bool)
    local[6] = True
    assert ix.lookup(np.stack([w]), local).tolist() == [6]
    slots[6]["state"] = EMPTY
    assert ix.lookup(np.stack([w]), local).tolist() == [2]


def test_garbage_triggers_rebuild_and_stays_correct() -> None:
    n = 16
    slots = np.zeros(n, SLOT_DTYPE)
    ix = KeyIndex(np.zeros(index_capacity(n), ENTRY_DTYPE), slots, init=True)
    live: dict[int, int] = {}
    for k in range(500):  # every slot rewritten ~30 times with a new key
        g = k % n
        w = words_of(k, False)
        slots[g]["d0"], slots[g]["d1"], slots[g]["d2"], slots[g]["d3"] = (int(x) for x in w)
        slots[g]["state"] = VALID
        ix.insert(w, g)
        live[g] = k
    assert ix.statistics().rebuilds > 0
    allw = np.stack([words_of(k, False) for k in range(500)])
    want = np.array([g if live.get(g) == k else -1 for k in range(500) for g in [k % n]])
    assert (ix.lookup(allw) == want).all()
