"""The client's page copy (_native/copy.c): the bytes land exactly, nothing beyond them is
touched, and the checksum is xxh3_64 of the page, for aligned and unaligned sources and tails."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import xxhash

from kvstore.client import _checksum, _copy_summed


@pytest.mark.parametrize("n", [1, 63, 64, 4096, 65535, 65536, 65537, (1 << 20) + 100])
@pytest.mark.parametrize("src_off", [0, 1, 13])
def test_copy_summed(n: int, src_off: int) -> None:
    src = np.random.default_rng(n + src_off).integers(0, 256, n + src_off, dtype=np.uint8)
    with mmap.mmap(-1, n + 8192) as mm:
        dst = np.frombuffer(mm, dtype=np.uint8)
        dst[:] = 0xA5
        h = _copy_summed(memoryview(mm)[4096:4096 + n], memoryview(src)[src_off:])
        assert h == xxhash.xxh3_64_intdigest(src[src_off:].tobytes())
        assert np.array_equal(dst[4096:4096 + n], src[src_off:])
        assert (dst[:4096] == 0xA5).all() and (dst[4096 + n:] == 0xA5).all()
        del dst


@pytest.mark.parametrize("n", [1, 4096, (1 << 20) + 100])
def test_checksum_is_xxh3(n: int) -> None:
    page = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert _checksum(memoryview(page)) == xxhash.xxh3_64_intdigest(page.tobytes())
