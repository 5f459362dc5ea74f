"""kvstore: a shared KV-cache page store for LLM inference.

The public API: the client, its result types, the config records and the errors.
"""

from .client import KVCacheClient as KVCacheClient
from .client import PageBatch as PageBatch
from .client import PageReservation as PageReservation
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
    "NotAllowed", "PageBatch", "PageReservation", "PutResult", "QuotaExceeded", "ServerConfig", "ServiceConfig", "ServiceLost", "StoreConfig",
    "StoreNotFound", "Timeout", "ViewsInUse", "WorkerConfig", "WorkerLost", "WouldBlock",
]
__version__ = "0.1.0"
