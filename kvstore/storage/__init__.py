"""On-device format: superblock, slot header, device open/format.

Bottom layer: imports nothing from kvstore except ``errors`` and ``config``
helpers. Every layout here is also written down byte for byte in docs/FORMAT.md,
and tests/storage/test_format_doc.py checks the two agree.
"""
