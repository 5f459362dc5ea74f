"""On-device format: superblock, slot header, device open/format.

Layer 1: imports nothing from kvstore except ``errors`` and the compiled core
(``kvstore._native``: the slot header's struct and constants, declared in ``kvstore.h``). Every layout here is also written down byte for byte in docs/FORMAT.md,
and tests/storage/test_format_doc.py checks the two agree.
"""
