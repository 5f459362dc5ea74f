"""Shared memory: segments, SPSC rings, slot tables, key index, stats (the page buffers: ``kvstore.ipc``).

Bottom layer beside ``kvstore.storage``: imports only ``errors`` and the
compiled atomics from ``kvstore.ioworkers._aio`` (the single cffi build holds
both libaio and the atomics). Every layout is documented next to its dtype and
in docs/FORMAT.md.
"""
