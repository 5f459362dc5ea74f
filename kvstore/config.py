"""Store configuration: one frozen dataclass per subsystem, read once, passed down as plain values.

Where things live (``MASS_HOME``, default ``~/.mass``), all of it this machine's own::

    $MASS_HOME/stores/<store>.toml     per-host settings: device paths, the pinned administrator key,
                                       metrics/events addresses, worker tuning, tenants' credentials
    $MASS_HOME/stores/<store>.seen     highest membership generation this machine has seen
    $MASS_HOME/stores/<store>.membership  the newest verified superblock of each device seen here
    $MASS_HOME/keys/<store>/<n>.key    a server's CurveZMQ keypair (private: never leaves the machine)
    $MASS_HOME/keys/<store>/admin.sign the administrator's signing key (only where allow/deny run)
    $MASS_HOME/run/<store>/            runtime state: <server>.sock, <server>.lock, <server>.pid

The superblocks on the devices are the authority on the store itself: layout
(page size, areas), salt and membership (each area's server, sync address,
public key, allowed or denied), signed by the administrator's key
(storage/membership.py). ``load_store`` composes the two into a ``StoreConfig``.
This module is the only place that reads environment variables.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import struct
import sys
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from .errors import StoreNotFound
from .storage.superblock import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from .storage.membership import Membership, SeenRecord

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Store and server names: short, safe in file names and shm segment names.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
MIN_PAGE_SIZE = 4096
MAX_PAGE_SIZE = 64 << 20
MAX_SERVERS = 48
#: Seconds between two reads of the superblocks by a running service (service/reloads.py):
#: the latency of an allow/deny made on another machine.
MEMBERSHIP_POLL_S = 1.0


def mass_home() -> Path:
    """The MASS_HOME directory (env ``MASS_HOME``, default ``~/.mass``)."""
    return Path(os.environ.get("MASS_HOME") or Path.home() / ".mass")


def check_name(name: str, what: str) -> str:
    """Validate a store or server name; raise ``ValueError`` naming ``what``."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"{what} name {name!r} is invalid: use 1-32 characters of a-z, 0-9, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


ADDRESS_RE = re.compile(r"^([A-Za-z0-9_.-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$")


def check_address(addr: str, what: str, max_port: int = 65534) -> str:
    """Validate ``HOST:PORT`` (PORT in 1..max_port; 65534 where PORT+1 is used too)."""
    m = ADDRESS_RE.match(addr)
    if not m or not 1 <= int(m.group(2)) <= max_port:
        raise ValueError(f"{what} {addr!r} is not HOST:PORT (PORT 1..{max_port})")
    return addr


def check_page_size(page_size: int) -> int:
    """Validate a page size: a multiple of 4 KiB between 4 KiB and 64 MiB."""
    if page_size % 4096 or not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(
            f"page_size must be a multiple of 4096 bytes between {MIN_PAGE_SIZE} and "
            f"{MAX_PAGE_SIZE}, got {page_size}"
        )
    return page_size


@dataclass(frozen=True)
class ServerConfig:
    """One GPU server allowed on the store."""

    name: str
    """Server name, unique in the store (e.g. the host name)."""
    sync: str = ""
    """``HOST:PORT`` of its peer-sync endpoint: deltas are published on PORT, anti-entropy
    is served on PORT+1 (needed when several servers share the store)."""
    public_key: str = ""
    """Its CurveZMQ public key (Z85, 40 characters); only these keys may connect to peers."""
    events: str = ""
    """``HOST:PORT`` where its service publishes vLLM-format KV events (PUB on PORT, replay
    ROUTER on PORT+1) for cache-aware routers; empty: no events."""
    metrics: str = ""
    """``HOST:PORT`` of its Prometheus text endpoint (``/metrics``); empty: none."""
    denied: bool = False
    """Cut off by ``mass-ctl kvcache deny``: it may not connect, peers drop its key and stop
    reading its area. Its entry stays so that area indices never shift."""

    def __post_init__(self) -> None:
        check_name(self.name, "server")
        for what, addr, max_port in (("sync", self.sync, 65534), ("events", self.events, 65534),
                                     ("metrics", self.metrics, 65535)):
            if addr:
                check_address(addr, f"server {self.name}: {what} address", max_port)
        if self.public_key and len(self.public_key) != 40:
            raise ValueError(f"server {self.name}: public_key must be 40 Z85 characters")

    @property
    def endpoints(self) -> tuple[str, str]:
        """ZMQ endpoints (deltas, anti-entropy) of this server's sync address."""
        host, _, port = self.sync.rpartition(":")
        return f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}"


@dataclass(frozen=True)
class WorkerConfig:
    """Per-device I/O worker tunables."""

    max_inflight_writes: int = 4
    """Writes outstanding per device at once. Small on purpose: reads queue behind
    whatever writes are already in the device, so a deep write queue is read latency."""
    read_queue_depth: int = 32
    """Reads outstanding per device at once; deeper than writes so reads get the device."""
    io_timeout_s: float = 30.0
    """Seconds an I/O may stay outstanding in the device (counted from ``io_submit``), or a
    worker with work queued may go without turning its loop, before the supervisor declares
    the worker stuck, kills it, fails its requests as misses and restarts it. Time a write
    waits in the ring behind reads (by design) does not count."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_inflight_writes <= 256:
            raise ValueError(f"max_inflight_writes must be in [1, 256], got {self.max_inflight_writes}")
        if not 1 <= self.read_queue_depth <= 256:
            raise ValueError(f"read_queue_depth must be in [1, 256], got {self.read_queue_depth}")
        if not self.io_timeout_s > 0:
            raise ValueError(f"io_timeout_s must be > 0, got {self.io_timeout_s}")


@dataclass(frozen=True)
class ServiceConfig:
    """Supervisor tunables: memory, clients, batches, reuse."""

    client_buffers: int = 64
    """Page buffers leased to each client connection; also the largest batch (keys per call)."""
    max_clients: int = 16
    """Client connections at once; the shm arena holds max_clients x client_buffers page buffers."""
    retire_grace_s: float = 0.0
    """Seconds a retired slot waits before it is overwritten, for readers on other servers.
    0 is safe for a single server (local pins are always drained first)."""
    request_timeout_s: float = 60.0
    """Longest a client waits for one call before raising ``Timeout``."""
    checkpoint_interval_s: float = 60.0
    """Seconds between slot-table checkpoints (and one at every clean stop), which let a restart
    skip reading every slot header; 0 turns checkpoints off (every start scans the devices)."""
    clients_per_user: int = 0
    """Client connections one local user (uid) may hold at once. 0 (the default): the service's
    own user ``max_clients``, any other user (a member of ``access_group``) a quarter of them
    (at least 1), so that no other user can take every place."""
    access_group: str = ""
    """Unix group whose members' engines may connect (the socket and the segments a client
    writes get group read/write, the lookup tables group read; the service's own rings stay
    owner-only). Empty: only the service's own user may connect."""
    trust_declared_tenant: bool = False
    """Grant any tenant a client names at connect, whoever it runs as (the behaviour before
    tenants came from credentials). Only for sites where every local user is trusted: the
    tenant is then the client's word, not the kernel's."""

    def __post_init__(self) -> None:
        if not 1 <= self.client_buffers <= 4096:
            raise ValueError(f"client_buffers must be in [1, 4096], got {self.client_buffers}")
        if not 1 <= self.max_clients <= 1024:
            raise ValueError(f"max_clients must be in [1, 1024], got {self.max_clients}")
        if not 0 <= self.clients_per_user <= self.max_clients:
            raise ValueError(f"clients_per_user must be in [0, max_clients={self.max_clients}], "
                             f"got {self.clients_per_user}")
        if self.retire_grace_s < 0:
            raise ValueError(f"retire_grace_s must be >= 0, got {self.retire_grace_s}")
        if self.checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must be >= 0, got {self.checkpoint_interval_s}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class SyncConfig:
    """Peer replication tunables (sync agent)."""

    flush_interval_s: float = 0.005
    """Longest a location update waits before it is published (seconds)."""
    flush_records: int = 1024
    """Updates that trigger a publish before the interval is up."""
    heartbeat_s: float = 0.5
    """Interval of heartbeats that let peers notice what they missed (seconds)."""
    request_timeout_s: float = 1.0
    """How long an anti-entropy request may stay unanswered before it is sent again (seconds)."""
    delta_log_records: int = 1 << 20
    """Updates the supervisor keeps to answer peers that missed some (56 bytes each); a peer
    further behind gets a snapshot of the areas instead."""

    def __post_init__(self) -> None:
        if not 0 < self.flush_interval_s <= 1:
            raise ValueError(f"flush_interval_s must be in (0, 1], got {self.flush_interval_s}")
        if not 1 <= self.flush_records <= 65536:
            raise ValueError(f"flush_records must be in [1, 65536], got {self.flush_records}")
        if not 0 < self.heartbeat_s <= 60:
            raise ValueError(f"heartbeat_s must be in (0, 60], got {self.heartbeat_s}")
        if not 0 < self.request_timeout_s <= 60:
            raise ValueError(f"request_timeout_s must be in (0, 60], got {self.request_timeout_s}")
        if not 1024 <= self.delta_log_records <= 1 << 26 or self.delta_log_records & (self.delta_log_records - 1):
            raise ValueError("delta_log_records must be a power of two in [1024, 2**26]")


@dataclass(frozen=True)
class StoreConfig:
    """A store: its identity, devices, servers and subsystem settings."""

    name: str
    """Store name (``[a-z0-9][a-z0-9_-]{0,31}``)."""
    uuid: str
    """Store UUID, also written in every superblock and slot header."""
    page_size: int
    """Bytes per page payload (multiple of 4096)."""
    devices: tuple[str, ...]
    """Device paths in device-index order (block devices or plain files)."""
    servers: tuple[ServerConfig, ...]
    """Servers in area-index order (server i owns area i on every device), denied ones included."""
    salt: str = field(default_factory=lambda: secrets.token_hex(32))
    """Hex salt mixed into every key digest (BLAKE2b key), so digests are not guessable
    (kept in the superblocks: every server of the store uses the same)."""
    admin_key: str = ""
    """Hex Ed25519 public key of the store's administrator: superblocks not signed by it
    are refused. Pinned in this machine's config at create or first connect."""
    membership_gen: int = 0
    """The devices' membership generation this config was composed from."""
    key_epoch: int = 0
    """The devices' store-wide key epoch (``mass-ctl kvcache invalidate STORE --all``)."""
    epochs: dict[str, int] = field(default_factory=dict)
    """The devices' per-namespace key epochs (``invalidate --tenant``), by ``namespace_of``."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    namespaces: dict[str, str] = field(default_factory=dict)
    """Tenant -> shared namespace. Every tenant has a key space of its own (its own salt);
    tenants mapped to the same namespace share one. The tenant "" is the default namespace."""
    quotas: dict[str, int] = field(default_factory=dict)
    """Tenant -> most slots its pages may hold in each server's own areas ("*": every tenant
    not listed). A tenant at its quota evicts its own pages (CLOCK over them) to write more."""
    pin_quotas: dict[str, int] = field(default_factory=dict)
    """Tenant -> most pages it may pin per server ("*": every tenant not listed; default a
    quarter of the server's own slots)."""
    tenants: dict[str, list[str]] = field(default_factory=dict)
    """Tenant -> the local users and groups whose processes may use it: ``"user:NAME"``,
    ``"uid:N"``, ``"group:NAME"``, ``"gid:N"``. The service learns who connected from the
    kernel (``SO_PEERCRED``) and grants only a tenant the caller is mapped to; a caller
    mapped to no tenant gets the default tenant "" (see ``tenant_for``)."""

    def __post_init__(self) -> None:
        check_name(self.name, "store")
        uuidlib.UUID(self.uuid)
        check_page_size(self.page_size)
        if not self.devices:
            raise ValueError("a store needs at least one device (--device PATH)")
        twice = sorted({d for d in self.devices if self.devices.count(d) > 1})
        if twice:
            raise ValueError(f"device(s) {', '.join(twice)} listed twice")
        if not self.servers:
            raise ValueError("a store needs at least one server (--server NAME)")
        if len(self.servers) > MAX_SERVERS:
            raise ValueError(f"at most {MAX_SERVERS} servers per store, got {len(self.servers)}")
        names = [s.name for s in self.servers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"server name(s) {', '.join(twice)} listed twice")
        if all(s.denied for s in self.servers):
            raise ValueError("every server of the store is denied: at least one must stay allowed")
        if len(self.servers) > 1:
            for sv in self.servers:
                if not sv.sync:
                    raise ValueError(f"server {sv.name} needs a sync address (NAME=HOST:PORT) in a store "
                                     "with several servers")
        bytes.fromhex(self.salt)
        for t, ns in self.namespaces.items():
            check_name(t, "tenant")
            check_name(ns, "namespace")
        for what, table in (("quotas", self.quotas), ("pin_quotas", self.pin_quotas)):
            for t, n in table.items():
                if t != "*":
                    check_name(t, "tenant")
                if not isinstance(n, int) or n < 0:
                    raise ValueError(f"{what}[{t!r}] must be an integer >= 0, got {n!r}")
        for t, principals in self.tenants.items():
            check_name(t, "tenant")
            if not isinstance(principals, list) or not principals:
                raise ValueError(f"tenants[{t!r}] must be a non-empty list like [\"user:alice\", \"group:ml\"]")
            for p in principals:
                _principal_ids(p)

    def quota_for(self, tenant: str) -> int | None:
        """Slot quota of ``tenant`` per server, or ``None`` when unlimited."""
        return self.quotas.get(tenant, self.quotas.get("*"))

    def pin_quota_for(self, tenant: str, own_slots: int) -> int:
        """Pin quota of ``tenant`` per server."""
        return self.pin_quotas.get(tenant, self.pin_quotas.get("*", own_slots // 4))

    def tenants_of(self, uid: int, groups: frozenset[int]) -> list[str]:
        """The tenants a process of ``uid`` in ``groups`` is mapped to (``tenants``), sorted."""
        out = []
        for t, principals in self.tenants.items():
            for p in principals:
                kind, ident = _principal_ids(p)
                if (kind == "uid" and ident == uid) or (kind == "gid" and ident in groups):
                    out.append(t)
                    break
        return sorted(out)

    def tenant_for(self, asked: str, uid: int, groups: frozenset[int]) -> str:
        """The tenant a connection of ``uid``/``groups`` gets when it asks for ``asked``.

        * ``service.trust_declared_tenant``: ``asked``, whoever asks (the old behaviour);
        * a caller mapped to tenants (``tenants``) may ask for any of them; asking for ""
          gives its only tenant (several: it must name one);
        * a caller mapped to none gets the default tenant "" and may ask for nothing else.

        Raises:
            NotAllowed: the caller may not use ``asked`` (or must name one of several).
            ValueError: ``asked`` is not a valid tenant name.
        """
        from .errors import NotAllowed

        if asked:
            check_name(asked, "tenant")
        if self.service.trust_declared_tenant:
            return asked
        mine = self.tenants_of(uid, groups)
        if not asked:
            if len(mine) > 1:
                raise NotAllowed(f"uid {uid} is mapped to several tenants ({', '.join(mine)}): "
                                 "connect with tenant= one of them")
            return mine[0] if mine else ""
        if asked in mine:
            return asked
        raise NotAllowed(f"uid {uid} may not use tenant {asked!r}: the store config maps it to "
                         f"{', '.join(repr(t) for t in mine) if mine else 'no tenant (the default one)'}; an "
                         "administrator grants tenants in [tenants] (user:NAME, uid:N, group:NAME, gid:N)")

    def namespace_of(self, tenant: str) -> str:
        """The key space ``tenant`` uses (``namespaces``), as the superblock's epoch table names it."""
        if tenant:
            check_name(tenant, "tenant")
        return self.namespaces.get(tenant, tenant) or DEFAULT_NAMESPACE

    def tenant_salt(self, tenant: str) -> bytes:
        """The salt of ``tenant``'s key space (see ``namespaces``) in its current key epochs;
        raises ``ValueError`` on a bad name."""
        ns = self.namespace_of(tenant)
        # the default tenant ("") is derived like any other: the store salt itself never leaves
        # the service (a client holding it could derive every tenant's salt); tenant names are
        # never empty, so its key space is its own
        data = (self.namespaces.get(tenant, tenant)).encode()
        epochs = (self.key_epoch, self.epochs.get(ns, 0))
        if epochs != (0, 0):  # a new key space per epoch pair; NUL is in no name, so none collides
            data += b"\0" + struct.pack("<QQ", *epochs)
        return hashlib.blake2b(data, digest_size=32, key=bytes.fromhex(self.salt), person=b"kvstore-tenant").digest()

    @property
    def uuid_bytes(self) -> bytes:
        """The store UUID as 16 bytes."""
        return uuidlib.UUID(self.uuid).bytes

    def server_index(self, name: str) -> int:
        """Area index of server ``name``; raises ``NotAllowed`` if it is not in the store."""
        from .errors import NotAllowed

        for i, s in enumerate(self.servers):
            if s.name == name:
                return i
        allowed = ", ".join(s.name for s in self.allowed)
        raise NotAllowed(f"server {name!r} is not allowed on store {self.name!r} (allowed: {allowed})")

    @property
    def allowed(self) -> tuple[ServerConfig, ...]:
        """The servers that are not denied."""
        return tuple(s for s in self.servers if not s.denied)

    @property
    def denied(self) -> tuple[str, ...]:
        """Names of denied servers."""
        return tuple(s.name for s in self.servers if s.denied)

    def check_allowed(self, name: str) -> int:
        """Area index of server ``name``; raises ``NotAllowed`` if it is unknown or denied."""
        from .errors import NotAllowed

        i = self.server_index(name)
        if self.servers[i].denied:
            raise NotAllowed(f"server {name!r} was denied on store {self.name!r} "
                             f"(allow it again with 'mass-ctl kvcache allow {self.name} {name}')")
        return i

    def local(self) -> LocalConfig:
        """The part of this config that belongs to this machine (what ``save_store`` writes)."""
        hosted = {sv.name: {k: v for k, v in (("events", sv.events), ("metrics", sv.metrics)) if v}
                  for sv in self.servers}
        return LocalConfig(name=self.name, uuid=self.uuid, devices=self.devices, admin_key=self.admin_key,
                           hosted={n: h for n, h in hosted.items() if h}, worker=self.worker, service=self.service,
                           sync=self.sync, namespaces=dict(self.namespaces), quotas=dict(self.quotas),
                           pin_quotas=dict(self.pin_quotas), tenants={t: list(p) for t, p in self.tenants.items()})

    def to_toml(self) -> str:
        """Serialize this machine's part to the TOML text stored under MASS_HOME."""
        return self.local().to_toml()


@dataclass(frozen=True)
class LocalConfig:
    """What one machine keeps about a store: where its devices are, which administrator key it
    trusts, and its own settings. Everything else is read from the devices."""

    name: str
    uuid: str
    devices: tuple[str, ...]
    admin_key: str = ""
    hosted: dict[str, dict[str, str]] = field(default_factory=dict)
    """Server name -> its per-host addresses here (``events``, ``metrics``)."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    namespaces: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)
    pin_quotas: dict[str, int] = field(default_factory=dict)
    tenants: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_name(self.name, "store")
        uuidlib.UUID(self.uuid)
        if not self.devices:
            raise ValueError("a store needs at least one device (--device PATH)")
        if self.admin_key and len(bytes.fromhex(self.admin_key)) != 32:
            raise ValueError("admin_key must be 64 hex characters")
        for n, h in self.hosted.items():
            check_name(n, "server")
            unknown = set(h) - {"events", "metrics"}
            if unknown:
                raise ValueError(f"[servers.{n}]: unknown setting(s) {sorted(unknown)} (events, metrics)")

    def to_toml(self) -> str:
        """The TOML text stored under MASS_HOME."""
        doc: dict[str, Any] = {
            "store": {"name": self.name, "uuid": self.uuid, "devices": list(self.devices),
                      "admin_key": self.admin_key},
            "servers": {n: dict(h) for n, h in self.hosted.items()},
            "worker": asdict(self.worker),
            "service": asdict(self.service),
            "sync": asdict(self.sync),
            "namespaces": dict(self.namespaces),
            "quotas": dict(self.quotas),
            "pin_quotas": dict(self.pin_quotas),
            "tenants": {t: list(p) for t, p in self.tenants.items()},
        }
        return tomli_w.dumps(doc)

    @classmethod
    def from_toml(cls, text: str) -> LocalConfig:
        """Parse a store config; raises ``ValueError`` on a malformed file."""
        try:
            doc = tomllib.loads(text)
            st = doc["store"]
            if isinstance(doc.get("servers"), list) or "page_size" in st:
                raise ValueError("this store config is of the format before membership moved to the devices "
                                 "(it lists [[servers]]); re-create the store with this version's mass-ctl")
            return cls(
                name=st["name"], uuid=st["uuid"], devices=tuple(st["devices"]), admin_key=st.get("admin_key", ""),
                hosted={n: dict(h) for n, h in doc.get("servers", {}).items()},
                worker=WorkerConfig(**doc.get("worker", {})),
                service=ServiceConfig(**doc.get("service", {})),
                sync=SyncConfig(**doc.get("sync", {})),
                namespaces=dict(doc.get("namespaces", {})),
                quotas=dict(doc.get("quotas", {})),
                pin_quotas=dict(doc.get("pin_quotas", {})),
                tenants={t: list(p) for t, p in doc.get("tenants", {}).items()},
            )
        except (KeyError, TypeError, AttributeError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"malformed store config: {e}") from None

    def compose(self, page_size: int, salt: bytes, members: list[tuple[str, str, str, bool]],
                membership_gen: int, key_epoch: int = 0, epochs: Sequence[tuple[str, int]] = ()) -> StoreConfig:
        """The full config: this machine's part plus the devices' (``members``: name, sync,
        Z85 public key, denied, in area order; the key epochs)."""
        servers = tuple(ServerConfig(n, sync, pub, self.hosted.get(n, {}).get("events", ""),
                                     self.hosted.get(n, {}).get("metrics", ""), denied)
                        for n, sync, pub, denied in members)
        return StoreConfig(name=self.name, uuid=self.uuid, page_size=page_size, devices=self.devices,
                           servers=servers, salt=salt.hex(), admin_key=self.admin_key,
                           membership_gen=membership_gen, key_epoch=key_epoch, epochs=dict(epochs),
                           worker=self.worker, service=self.service,
                           sync=self.sync, namespaces=dict(self.namespaces), quotas=dict(self.quotas),
                           pin_quotas=dict(self.pin_quotas), tenants={t: list(p) for t, p in self.tenants.items()})


def _principal_ids(p: object) -> tuple[str, int]:
    """``("uid", N)`` or ``("gid", N)`` for a principal of ``StoreConfig.tenants``; names are
    resolved on this machine. Raises ``ValueError`` for a malformed or unknown one."""
    if not isinstance(p, str) or ":" not in p:
        raise ValueError(f"tenant principal {p!r} must be user:NAME, uid:N, group:NAME or gid:N")
    kind, _, val = p.partition(":")
    try:
        if kind in ("uid", "gid"):
            return kind, int(val)
        if kind == "user":
            import pwd

            return "uid", pwd.getpwnam(val).pw_uid
        if kind == "group":
            import grp

            return "gid", grp.getgrnam(val).gr_gid
    except (KeyError, ValueError):
        raise ValueError(f"tenant principal {p!r}: no such {kind} here") from None
    raise ValueError(f"tenant principal {p!r} must be user:NAME, uid:N, group:NAME or gid:N")


def store_path(name: str, home: Path | None = None) -> Path:
    """Path of store ``name``'s config file."""
    return (home or mass_home()) / "stores" / f"{check_name(name, 'store')}.toml"


def key_path(store: str, server: str, home: Path | None = None) -> Path:
    """File holding server ``server``'s CurveZMQ keypair for ``store`` (owner-only)."""
    return (home or mass_home()) / "keys" / check_name(store, "store") / f"{check_name(server, 'server')}.key"


def admin_key_path(store: str, home: Path | None = None) -> Path:
    """File holding the administrator's signing key of ``store`` (owner-only; only on the
    machines where ``create``, ``allow`` and ``deny`` run)."""
    return (home or mass_home()) / "keys" / check_name(store, "store") / "admin.sign"


def run_dir(name: str, home: Path | None = None) -> Path:
    """Directory holding store ``name``'s sockets, locks and pid files (owner-only)."""
    return (home or mass_home()) / "run" / check_name(name, "store")


def load_local(name: str, home: Path | None = None) -> LocalConfig:
    """This machine's part of store ``name``; raises ``StoreNotFound`` if it has none."""
    p = store_path(name, home)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise StoreNotFound(
            f"store {name!r} not found: no {p} (create it with 'mass-ctl kvcache create', join it with "
            f"'mass-ctl kvcache connect {name} --device PATH', or set MASS_HOME)"
        ) from None
    return LocalConfig.from_toml(text)


def load_store(name: str, home: Path | None = None, *, torn_ok: bool = False,
               vouched: Sequence[str] = ()) -> StoreConfig:
    """Store ``name``: this machine's config composed with the membership on its devices
    (verified against the pinned administrator key; a replayed older membership is refused).

    Raises:
        StoreNotFound: no config for it here.
        DeviceMismatch: the devices cannot be read or do not verify (see storage/membership.py).
    """
    local = load_local(name, home)
    return compose_membership(local, home, torn_ok=torn_ok, vouched=vouched)[0]


def compose_store(local: LocalConfig, home: Path | None = None) -> StoreConfig:
    """``local`` composed with its devices' membership (see ``load_store``)."""
    return compose_membership(local, home)[0]


def seen_record(name: str, home: Path | None = None) -> SeenRecord:
    """This machine's record of the newest verified superblocks of store ``name``."""
    from .storage.membership import SeenRecord

    return SeenRecord(store_path(name, home).with_suffix(".membership"))


def compose_membership(local: LocalConfig, home: Path | None = None, *, torn_ok: bool = False,
                       vouched: Sequence[str] = ()) -> tuple[StoreConfig, Membership]:
    """``compose_store``, and the membership as read (each device's superblock). A device
    rolled back to an older membership is read as this machine last saw it; with
    ``torn_ok`` a torn one too (storage/membership.py)."""
    from .errors import DeviceMismatch
    from .storage.membership import read_membership

    if not local.admin_key:  # never trust whatever key the devices name, except at an explicit join
        raise DeviceMismatch(f"{store_path(local.name, home)} pins no administrator key: join the store with "
                             f"'mass-ctl kvcache connect {local.name} --device PATH [--admin-key HEX]'")
    record = seen_record(local.name, home)
    seen = record.load()
    m = read_membership(local.devices, store_uuid=uuidlib.UUID(local.uuid).bytes,
                        admin_key=bytes.fromhex(local.admin_key), min_gen=seen_membership(local.name, local.uuid, home),
                        seen=seen, torn_ok=torn_ok, vouched=vouched)
    note_membership(local.name, local.uuid, m.gen, home)
    record.note(m, seen)
    import zmq.utils.z85

    members = [(x.name, x.sync, zmq.utils.z85.encode(x.public_key).decode() if x.public_key else "", x.denied)
               for x in m.members]
    return local.compose(m.newest.page_size, m.newest.salt, members, m.gen, m.newest.key_epoch, m.newest.epochs), m


def seen_membership(name: str, uuid: str, home: Path | None = None) -> int:
    """The highest membership generation this machine has seen of store ``name`` with this
    ``uuid`` (0: none; a store re-created under the same name starts again)."""
    try:
        seen_uuid, gen = (store_path(name, home).with_suffix(".seen")).read_text().split()
        return int(gen) if seen_uuid == uuid else 0
    except (FileNotFoundError, ValueError):
        return 0


def note_membership(name: str, uuid: str, gen: int, home: Path | None = None) -> None:
    """Remember ``gen`` if it is the highest seen (best effort: a reader without write access
    to MASS_HOME, such as a dashboard of another user, just does not record it)."""
    if gen <= seen_membership(name, uuid, home):
        return
    p = store_path(name, home).with_suffix(".seen")
    try:
        tmp = p.with_suffix(f".seen.{os.getpid()}")
        tmp.write_text(f"{uuid} {gen}\n")
        os.replace(tmp, p)
    except OSError:
        pass


def save_store(cfg: StoreConfig | LocalConfig, home: Path | None = None) -> Path:
    """Write this machine's part of ``cfg`` atomically (owner-only) under MASS_HOME; return its path."""
    local = cfg.local() if isinstance(cfg, StoreConfig) else cfg
    p = store_path(local.name, home)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(local.to_toml())
    os.replace(tmp, p)
    return p
