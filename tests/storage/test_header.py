from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from kvstore.storage.header import HEADER_SIZE, SlotHeader


def hdr() -> SlotHeader:
    return SlotHeader(os.urandom(16), 1, 2, 3, 4, os.urandom(32), 4096, 12345, 99)


def test_roundtrip() -> None:
    h = hdr()
    data = h.encode()
    assert len(data) == HEADER_SIZE
    assert SlotHeader.decode(data + bytes(4096 - HEADER_SIZE)) == h


def test_empty_block_is_no_header() -> None:
    assert SlotHeader.decode(bytes(4096)) is None


@given(st.integers(0, HEADER_SIZE - 1), st.integers(1, 255))
def test_any_flipped_byte_is_rejected(pos: int, flip: int) -> None:
    data = bytearray(hdr().encode())
    data[pos] ^= flip
    assert SlotHeader.decode(bytes(data)) is None


@given(st.binary(max_size=200))
def test_garbage_never_crashes(data: bytes) -> None:
    assert SlotHeader.decode(data) is None or isinstance(SlotHeader.decode(data), SlotHeader)
