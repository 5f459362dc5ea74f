"""The contract between a client, its cache service and the service's I/O workers.

Everything one local process hands another lives here: the connection segment and the hello
(``connection``: request ring, descriptors, direct-read rings, pins, a client's lease), the
page buffers and their ownership states (``lease``), and the supervisor's rings to each I/O
worker with the worker's table of the connections it serves (``iorings``). Layouts, byte for
byte, are in docs/FORMAT.md; ``KVCacheClient`` (kvstore/client.py) is the API over this package.

The trust rules (docs/SECURITY.md), which every reader of these structures keeps:

1. **Every byte another process can write is input, never authority.** A client writes only
   its own connection segment (rings, descriptors, pins, its lease's states and buffers);
   nothing it writes is authority for anything but its own requests.
2. **Who maps what is the kernel's business.** A connection's segment is owner-only and reaches
   its client as a file descriptor sent with the hello answer; the lookup tables are mapped
   read-only by clients (group read-only with an access group); the workers' and the sync
   agent's rings are owner-only. No client is given anything of another connection.
3. **A direct read is authorized by the service's state**: the worker reads a slot only if the
   key id the record names, salted with the reading connection's tenant salt (in the worker's
   own table), is the digest the slot table's register holds at the generation the record
   names; the page is validated against that register. A lie is refused, costs nobody else
   anything, and disconnects its client.
4. **Consumers keep their own ring heads** and range-check what producers wrote; a record out
   of range is counted and dropped, never indexed with.
5. **The service's view of buffers and connections is its own.** A gone client's lease goes
   with its segment once no worker is ``busy`` with it; no state word a client writes can keep
   a connection, a buffer or a pin.
6. **Salts**: a client receives its own tenant's salt, never the store's.
"""
