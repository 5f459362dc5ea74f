"""kvstore: a shared KV-cache page store for LLM inference.

The public API: the client, its result types, the config records and the errors.

Layers (docs/ARCHITECTURE.md has the map): a module imports only from its own package or
from a lower layer, never upward, so each layer can be read, built and tested with only
what is below it. tests/test_layers.py checks every import against ``_LAYERS``.

    0  _native (the compiled core), errors, _units, logging, keys, _process
    1  storage (on-device formats), shm (shared-memory tables), digests
    2  ipc (the client/service/worker contract), config
    3  crdt (replication), ioworkers (the device I/O process)
    4  service (the cache service), client (the engines' library), admin
    5  engines, tui, testing
    6  quickstart
    7  cli
"""

from .client import KVCacheClient as KVCacheClient
from .client import PageBatch as PageBatch
from .client import PageReservation as PageReservation
from .client import PendingGet as PendingGet
from .client import PendingPut as PendingPut
from .client import PutResult as PutResult
from .config import ServerConfig as ServerConfig
from .config import ServiceConfig as ServiceConfig
from .config import StoreConfig as StoreConfig
from .config import WorkerConfig as WorkerConfig
from .errors import AddressUnavailable as AddressUnavailable
from .errors import AlreadyRunning as AlreadyRunning
from .errors import ClosedError as ClosedError
from .errors import CorruptPage as CorruptPage
from .errors import DeviceMismatch as DeviceMismatch
from .errors import KVStoreError as KVStoreError
from .errors import NotAllowed as NotAllowed
from .errors import QuotaExceeded as QuotaExceeded
from .errors import ServiceLost as ServiceLost
from .errors import StoreNotFound as StoreNotFound
from .errors import Timeout as Timeout
from .errors import ViewsInUse as ViewsInUse
from .errors import WorkerLost as WorkerLost
from .errors import WouldBlock as WouldBlock

__all__ = [
    "AddressUnavailable", "AlreadyRunning", "ClosedError", "CorruptPage", "DeviceMismatch", "KVCacheClient", "KVStoreError",
    "NotAllowed", "PageBatch", "PageReservation", "PendingGet", "PendingPut", "PutResult", "QuotaExceeded", "ServerConfig", "ServiceConfig", "ServiceLost", "StoreConfig",
    "StoreNotFound", "Timeout", "ViewsInUse", "WorkerConfig", "WorkerLost", "WouldBlock",
]
__version__ = "0.1.0"

_LAYERS: tuple[tuple[str, ...], ...] = (
    ("_native", "errors", "_units", "logging", "keys", "_process"),
    ("storage", "shm", "digests"),
    ("ipc", "config"),
    ("crdt", "ioworkers"),
    ("service", "client", "admin"),
    ("engines", "tui", "testing"),
    ("quickstart",),
    ("cli",),
)
"""kvstore's packages and top-level modules by layer, lowest first (see the module doc)."""
