"""SlotMap: global slot ids and (device, area, slot) triples, empty areas included."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.shm.slots import SlotMap


@pytest.mark.parametrize("counts", [[[10]], [[5, 0, 7], [3, 3, 0]], [[0, 4], [0, 0], [6, 1]]])
def test_locate_and_gid_are_inverse(counts: list[list[int]]) -> None:
    sm = SlotMap(counts)
    triples = [(d, a, s) for d, row in enumerate(counts) for a, c in enumerate(row) for s in range(c)]
    assert sm.total == len(triples)
    gids = np.arange(sm.total, dtype=np.int64)
    many = list(zip(*(x.tolist() for x in sm.locate_many(gids))))
    for g, t in zip(gids.tolist(), triples):  # ids count device-major, then area, then slot
        assert sm.locate(g) == t == many[g]
        assert sm.gid(*t) == g
    with pytest.raises(IndexError):
        sm.gid(len(counts), 0, 0)
