"""Shared memory: segments, SPSC rings, slot tables, key index, stats (the page buffers: ``kvstore.ipc``).

Layer 1 beside ``kvstore.storage``: imports only ``errors`` and the compiled core
(``kvstore._native``: atomics, the index probe; constants and structs declared in its
``kvstore.h``). Every layout is documented next to its dtype and in docs/FORMAT.md.
"""
