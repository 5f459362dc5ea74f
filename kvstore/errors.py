"""The exceptions kvstore raises, named for what the caller does next.

A miss is never an exception: ``get`` hands back ``None`` for it. Bad arguments
raise the built-in ``ValueError``/``TypeError`` with a message naming the
parameter and its bound.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every kvstore error; catch it to treat the cache as optional."""


class StoreNotFound(KVStoreError):
    """The named store has no config under MASS_HOME, or no service of it runs here.

    Create it with ``mass-ctl kvcache create`` or start its service with
    ``mass-ctl kvcache connect``; check MASS_HOME points where you expect.
    """


class NotAllowed(KVStoreError):
    """This server (or this local user) is not allowed on the store.

    An administrator adds it to the store's servers; nothing is retried.
    """


class AlreadyRunning(KVStoreError):
    """A service of this store and server already runs on this machine.

    Use that one, or stop it (``mass-ctl kvcache disconnect`` or SIGTERM) first.
    """


class DeviceMismatch(KVStoreError):
    """A device is missing, too small, unformatted or formatted for another store.

    Check the device paths in the store config; ``create --force`` reformats a
    device that belongs to another store (destroying its pages).
    """


class AddressUnavailable(KVStoreError):
    """An address the service must listen on (metrics, KV events) cannot be bound here.

    Another process holds it, or (a port inside ``net.ipv4.ip_local_port_range``) an outgoing
    connection took it as its local end; the host is not one of this machine's. Give the server
    another address (``mass-ctl kvcache connect STORE --metrics/--events HOST:PORT``).
    """


class ClosedError(KVStoreError):
    """The client or object was closed; open a new one."""


class WouldBlock(KVStoreError):
    """A ``*_nowait`` call could not proceed without waiting; retry or use the blocking call."""


class QuotaExceeded(KVStoreError):
    """A tenant limit was reached (pinned pages); unpin some, or ask the administrator for a
    larger quota (``[pin_quotas]`` in the store config)."""


class Timeout(KVStoreError):
    """A call did not complete within its timeout; the cache may be overloaded.

    Treat the pages as misses (recompute); buffers held by the request are
    returned to the client once the service is done with them.
    """


class ViewsInUse(KVStoreError):
    """``close()`` was refused: views of pages (or slices and numpy arrays made from them)
    are still alive, and closing would let their buffers be reused under them.

    Drop those objects (or copy what you need) and call ``close()`` again; the client
    stays open and usable until then.
    """


class ServiceLost(KVStoreError):
    """The cache service this client talked to is gone (crashed or stopped).

    Recompute what you needed, and reconnect once the service is back.
    """


class WorkerLost(KVStoreError):
    """An I/O worker died during a request; the supervisor restarts it. Retry the call."""


class CorruptPage(KVStoreError):
    """On-device data failed validation (superblock or header checksum).

    Raised by tools that inspect devices; the data path turns it into a miss.
    """
