"""The cache service: one supervisor process per store and server.

State, changes and parts: ``state.py`` (``StoreState``: the slot table, key index,
allocator, stats and checkpoints as this server sees them), ``runtime.py`` (the names,
modes and memory of one run; the hello and the workers' parameters come from it),
``changes.py`` (the one feed of slot changes, which the sync link and the KV-event
publisher subscribe to). The parts each take the state explicitly and turn:
``requests.py`` (client requests and device completions), ``clients.py`` and
``connections.py`` (the socket, hellos, each connection), ``workers.py`` (the I/O worker
processes), ``agentproc.py`` and ``sync.py`` (the sync agent's process and the link to it),
``reloads.py`` (allow/deny and config changes while serving), ``events.py`` (vLLM-format
KV events), ``gauges.py`` and ``metrics.py`` (stats gauges, Prometheus). ``allocator.py``,
``rebuild.py`` and ``checkpoint.py`` serve the state. ``supervisor.py`` starts, turns and
stops the parts, and is the only writer of the slot table and key index (through them).
"""
