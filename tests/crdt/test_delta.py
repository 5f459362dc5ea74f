"""Peer message decoding: valid messages round-trip; anything else is a BadMessage, never a crash."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.crdt.delta import BadMessage, decode, encode
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.shm.slots import VALID, WRITING, SlotMap

SMAP = SlotMap([[10, 10, 10], [10, 10, 10]])
PS = 65536


def regs(n: int, owner: int = 1, **over: int) -> np.ndarray:
    r = np.zeros(n, REGISTER_DTYPE)
    r["device"] = np.arange(n) % 2
    r["area"] = owner
    r["slot"] = np.arange(n) % 10
    r["gen"] = np.arange(n) + 1
    r["d0"] = 7
    r["length"] = PS
    r["state"] = VALID
    for k, v in over.items():
        r[k][0] = v
    return r


def test_roundtrip_all_kinds() -> None:
    r = regs(25)
    m = decode(encode("d", 1, 99, 5, r), SMAP, PS, 1)
    assert (m.kind, m.owner, m.epoch, m.seq) == ("d", 1, 99, 5) and m.records.tobytes() == r.tobytes()
    m = decode(encode("a", 1, 99, 0, r, next_seq=30, snapshot=True, last=False), SMAP, PS, 1)
    assert m.snapshot and not m.last and m.next_seq == 30
    assert decode(encode("hb", 1, 99, 7), SMAP, PS, 1).seq == 7
    assert decode(encode("q", 1, 99, 3), SMAP, PS, 1).kind == "q"


def test_bytes_per_update_within_64() -> None:
    n = 1024
    assert len(encode("d", 1, 2**60, 2**40, regs(n))) / n <= 64


@pytest.mark.parametrize("over,why", [
    ({"area": 2}, "does not own"), ({"device": 2}, "device index"), ({"slot": 10}, "slot index"),
    ({"state": WRITING}, "state"), ({"length": PS + 1}, "length"), ({"gen": 0}, "generation"),
])
def test_out_of_range_registers_rejected(over: dict[str, int], why: str) -> None:
    with pytest.raises(BadMessage, match=why):
        decode(encode("d", 1, 1, 1, regs(3, **over)), SMAP, PS, 1)


def test_forged_owner_and_truncation_rejected() -> None:
    with pytest.raises(BadMessage, match="about owner 2"):
        decode(encode("d", 2, 1, 1, regs(3, owner=2)), SMAP, PS, 1)
    good = msgpack.unpackb(encode("d", 1, 1, 1, regs(3)))
    good["r"] = good["r"][:-5]
    with pytest.raises(BadMessage, match="truncated"):
        decode(msgpack.packb(good), SMAP, PS, 1)
    with pytest.raises(BadMessage):
        decode(encode("d", 1, 1, 1, regs(3))[:-9], SMAP, PS, 1)


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_garbage_is_bad_message(data: bytes) -> None:
    try:
        decode(data, SMAP, PS, 1)
    except BadMessage:
        pass


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(["v", "t", "o", "e", "s", "r", "n", "snap", "last", "x"]),
                       st.one_of(st.integers(-5, 2**64 - 1), st.binary(max_size=120), st.text(max_size=3),
                                 st.booleans(), st.none())))
def test_fuzzed_maps_never_crash(m: dict) -> None:  # type: ignore[type-arg]
    try:
        decode(msgpack.packb(m), SMAP, PS, 1)
    except BadMessage:
        pass
