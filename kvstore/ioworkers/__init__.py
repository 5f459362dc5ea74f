"""I/O workers: one process per device, O_DIRECT libaio I/O between the device and page buffers.

``worker.py`` is the process: it maps the rings (``kvstore.ipc.iorings``), the
connections' segments and the slot table, and calls the compiled turn
(``kvstore._native``, ``worker.c``) once per loop; it keeps connections coming and
going, wake-ups, idling, health and shutdown.
"""
