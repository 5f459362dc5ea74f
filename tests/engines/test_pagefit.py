"""The page-size advice the adapters print (kvstore/engines/pagefit.py)."""

from __future__ import annotations

import pytest

from kvstore.engines.pagefit import advice, fitting_page_size


def test_a_unit_that_fills_its_page_gets_no_advice() -> None:
    assert advice("x", 1 << 20, 1 << 20) is None
    assert advice("x", 800_000, 1 << 20) is None  # 76% used


def test_a_unit_split_over_pages_is_told_the_size_that_fits() -> None:
    tip = advice("an LMCache object", 2 << 20, 256 << 10)
    assert tip is not None and "split into 8 pages of 262144 bytes" in tip and "--page-size 2097152" in tip


def test_a_unit_lost_in_a_large_page_is_told_the_size_that_fits() -> None:
    tip = advice("an SGLang page (64 tokens)", 589_824 + 1, 4 << 20)
    assert tip is not None and "uses 14% of a 4194304-byte page" in tip and "--page-size 593920" in tip


def test_fitting_sizes_are_4k_multiples() -> None:
    assert [fitting_page_size(n) for n in (1, 4096, 4097)] == [4096, 4096, 8192]
    with pytest.raises(ValueError):
        fitting_page_size(0)
