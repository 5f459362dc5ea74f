"""Does the store's page size fit what an engine stores in a page? The advice each adapter prints.

A store has one page size, chosen at ``mass-ctl kvcache create --page-size``. An engine's unit
of K/V has its own size: tokens per page x layers x 2 (K and V) x KV heads per rank x head
dim x dtype bytes (vLLM: ``page_tokens``; SGLang: ``--page-size`` tokens; LMCache: a chunk of
``chunk_size`` tokens, one object). A unit larger than a page is split (LMCache) or refused
(vLLM, SGLang); one much smaller wastes the rest of every page, on the device and in every
transfer. Either way each transferred byte costs more: the adapters say so once, with the page
size that fits (the unit rounded up to 4 KiB).
"""

from __future__ import annotations

BLOCK = 4096
MIN_USE = 0.75
"""A page used at least this much, one unit per page, fits; anything else gets advice."""


def fitting_page_size(unit_bytes: int) -> int:
    """The page size that holds one unit of ``unit_bytes``: rounded up to 4 KiB."""
    if unit_bytes <= 0:
        raise ValueError(f"a unit of K/V has a positive size, got {unit_bytes}")
    return -(-unit_bytes // BLOCK) * BLOCK


def advice(what: str, unit_bytes: int, page_size: int) -> str | None:
    """None when one ``unit_bytes`` unit fills one store page well; otherwise what it costs and
    the page size that fits, as a sentence for the log (``what`` names the unit)."""
    pages = -(-unit_bytes // page_size)
    used = unit_bytes / (pages * page_size)
    if pages == 1 and used >= MIN_USE:
        return None
    fit = fitting_page_size(unit_bytes)
    cost = (f"is split into {pages} pages of {page_size} bytes (per-page costs {pages} times over)"
            if pages > 1 else f"uses {used:.0%} of a {page_size}-byte page")
    return (f"{what} of {unit_bytes} bytes {cost}; a store created with --page-size {fit} holds one "
            f"per page ('mass-ctl kvcache create STORE DEVICE... --page-size {fit}', or change the "
            "engine's tokens per page)")


__all__ = ["advice", "fitting_page_size"]
