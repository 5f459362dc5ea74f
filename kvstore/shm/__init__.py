"""Shared memory: segments, SPSC rings, the page-buffer arena, slot tables, key index, stats.

Bottom layer beside ``kvstore.storage``: imports only ``errors`` and the
compiled atomics from ``kvstore.ioworkers._aio`` (the single cffi build holds
both libaio and the atomics). Every layout is documented next to its dtype and
in docs/FORMAT.md.
"""
