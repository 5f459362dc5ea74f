"""I/O workers: one process per device doing O_DIRECT libaio I/O between the device and the shm arena.

Uses ``kvstore.storage`` (slot header format) and ``kvstore.shm`` (rings,
arena, stats). ``_aio_build.py`` is the cffi build script, ``aio.py`` its typed
wrapper, ``protocol.py`` the ring records, ``worker.py`` the process loop.
Keep this file free of imports: ``kvstore.shm`` imports ``aio`` from here.
"""
