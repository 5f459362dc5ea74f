"""The cache service: one supervisor process per store and server.

``supervisor.py`` (start-up, the loop, shutdown), ``clients.py`` and ``connections.py``
(the Unix socket, hellos, each connection's state), ``requests.py`` (serving get/put/pin
requests and their I/O), ``workers.py`` (spawning and watching the I/O workers),
``allocator.py`` (slot allocation, CLOCK eviction, retirement), ``rebuild.py`` and
``checkpoint.py`` (the slot table at start-up), ``sync.py`` and ``agent.py`` (the link
to the sync agent process of ``kvstore.crdt``), ``membership.py`` (the superblock
watcher), ``events.py`` (vLLM-format KV events for routers), ``metrics.py``
(Prometheus). Uses every layer below (storage, shm, ipc, ioworkers, crdt). The
supervisor is the only mutator of the slot tables and the key index.
"""
