"""I/O workers: one process per device, O_DIRECT libaio I/O between the device and page buffers.

Uses ``kvstore.storage`` (slot header format) and ``kvstore.shm`` (rings,
arena, stats). ``_aio_build.py`` is the cffi build script, ``aio.py`` its typed
wrapper, ``worker.py`` the process loop (its rings: ``kvstore.ipc.iorings``).
Keep this file free of imports: ``kvstore.shm`` imports ``aio`` from here.
"""
