"""Parsing and printing of sizes such as ``256KiB``, ``1M`` or ``4g`` (binary units)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, *, name: str = "size") -> int:
    """Parse ``text`` as a byte count; ``K``, ``M``, ``G``, ``T`` (with optional ``iB``/``B``) are powers of 1024.

    Raises:
        ValueError: naming ``name`` when the text is not a size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{name} must be >= 0, got {text}")
        return text
    m = _RE.match(text)
    if not m:
        raise ValueError(f"{name}: {text!r} is not a size (examples: 4096, 256KiB, 1MiB, 10G)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def format_size(n: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
