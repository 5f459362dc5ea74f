"""Administrator operations on a store's membership, as library calls (mass-ctl is a thin shell).

* ``create_store``: format the devices with the first members, make the administrator's
  signing key (kept on this machine) and this machine's config.
* ``allow_server`` / ``deny_server``: rewrite the membership on every device, signed;
  every machine's running services pick it up by polling the superblocks.
* ``invalidate``: move tenants' key spaces (or every one) to a new key epoch, signed on
  every device: no page saved before is served again (after a weight update, a bad deploy).
* ``join_store``: a GPU server with nothing but a device path (and its own key) learns
  the store from the devices and writes its own config.

Nothing secret travels: servers' private keys stay where ``keygen`` made them, only
public keys go into the membership; the signing key stays where ``create`` ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import stat
import uuid as uuidlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq.utils.z85

from .config import (ADDRESS_RE, LocalConfig, ServerConfig, ServiceConfig, StoreConfig, SyncConfig, WorkerConfig,
                     admin_key_path, check_address, check_name, compose_membership, compose_store, key_path,
                     load_local, load_store, mass_home, note_membership, save_store, seen_record, store_path)
from .errors import DeviceMismatch, NotAllowed, StoreNotFound
from .storage.membership import (AdminKey, Epochs, Membership, change_membership, fingerprint, raw_device_indexes,
                                 read_membership)
from .storage.superblock import AREA_DENIED, Area, Superblock, bump_epochs


@dataclass(frozen=True)
class ServerSpec:
    """A server as an administrator names it: ``NAME[=HOST:PORT][:PUBLIC]``."""

    name: str
    sync: str = ""
    public_key: str = ""
    """Z85 CurveZMQ public key (40 characters); empty: make a keypair on this machine."""

    @classmethod
    def parse(cls, spec: str, key: str = "") -> ServerSpec:
        """Parse ``NAME``, ``NAME=HOST:PORT``, ``NAME=HOST:PORT:PUBLIC`` or ``NAME=:PUBLIC``.

        The public key is the last 40 characters (Z85 may contain ':' itself).

        Raises:
            ValueError: a malformed name, address or key.
        """
        name, _, rest = spec.partition("=")
        check_name(name, "server")
        sync, pub = rest, ""
        if rest and not ADDRESS_RE.match(rest):
            if len(rest) < 41 or rest[-41] != ":":
                raise ValueError(f"server {spec!r}: expected NAME=HOST:PORT or NAME=HOST:PORT:PUBLIC_KEY "
                                 "(the 40-character key printed by 'mass-ctl kvcache keygen')")
            sync, pub = rest[:-41], rest[-40:]
        if key:
            if pub and pub != key:
                raise ValueError(f"server {name}: two different public keys given")
            pub = key
        if sync:
            check_address(sync, f"server {name}: sync address")
        if pub:
            check_public_key(pub, name)
        return cls(name, sync, pub)


def check_public_key(pub: str, server: str) -> bytes:
    """The raw 32 bytes of a Z85 CurveZMQ public key; raises ``ValueError`` if it is not one."""
    try:
        raw = zmq.utils.z85.decode(pub.encode()) if len(pub) == 40 else b""
    except (ValueError, KeyError, TypeError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"server {server}: {pub!r} is not a CurveZMQ public key (40 Z85 characters, as "
                         "'mass-ctl kvcache keygen' prints)")
    return bytes(raw)


@dataclass(frozen=True)
class Claims:
    """What one allowed server takes: its sync PORT and PORT+1, its events PORT and PORT+1,
    its metrics PORT, and its public key. Ports are taken on a machine: the one its sync
    address names, for a metrics or events address on a wildcard host (0.0.0.0, ::) too."""

    name: str
    sync: str = ""
    public_key: str = ""
    events: str = ""
    metrics: str = ""

    def ports(self) -> list[tuple[str, int, str]]:
        """(machine, port, what) of every port this server listens on."""
        home = canonical_host(self.sync.rpartition(":")[0]) if self.sync else f"(the machine of {self.name})"
        out = []
        for what, addr, n in (("sync", self.sync, 2), ("events", self.events, 2), ("metrics", self.metrics, 1)):
            if addr:
                host, _, port = addr.rpartition(":")
                machine = home if canonical_host(host) in WILDCARD_HOSTS else canonical_host(host)
                out += [(machine, int(port) + k, f"{what} address {addr}" + (" (PORT+1)" if k else ""))
                        for k in range(n)]
        return out


WILDCARD_HOSTS = ("0.0.0.0", "*", "::")


def canonical_host(host: str) -> str:
    """One spelling per address: IPv4 dotted as the kernel reads it (127.000.0.1 is 127.0.0.1),
    IPv6 compressed, ``localhost`` as 127.0.0.1, names lower-case (names are not resolved:
    two names of one machine are not recognised as one)."""
    import ipaddress
    import socket

    h = host.strip("[]").lower()
    if h == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(h)) if h and h[0].isdigit() else h
    except OSError:
        return h


def check_collisions(servers: Sequence[Claims]) -> None:
    """Refuse two allowed servers (or two addresses of one) that would listen on one port of
    one machine, or share a public key, naming both parties.

    Raises:
        ValueError: the first collision found.
    """
    taken: dict[tuple[str, int], tuple[str, str]] = {}
    keys: dict[str, str] = {}
    for sv in servers:
        if sv.public_key:
            if sv.public_key in keys:
                raise ValueError(f"server {sv.name}'s public key is server {keys[sv.public_key]}'s too: each "
                                 "server needs its own keypair ('mass-ctl kvcache keygen' on that server)")
            keys[sv.public_key] = sv.name
        for machine, port, what in sv.ports():
            other = taken.get((machine, port))
            if other is not None:
                raise ValueError(f"server {sv.name}'s {what} takes port {port} of {machine}, which server "
                                 f"{other[0]}'s {other[1]} takes too (a sync or events address uses PORT and PORT+1)")
            taken[(machine, port)] = (sv.name, what)


def claims_of(sv: ServerConfig) -> Claims:
    """What an allowed server of a composed store takes."""
    return Claims(sv.name, sv.sync, sv.public_key, sv.events, sv.metrics)


def ephemeral_warnings(servers: Sequence[Claims]) -> list[str]:
    """Sync ports inside this machine's ``net.ipv4.ip_local_port_range``: any outgoing connection
    may hold such a port when the service wants to bind it (a warning: the range is per machine)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return []
    out = []
    for sv in servers:
        for _host, port, what in sv.ports():
            if lo <= port <= hi and what.startswith("sync"):
                out.append(f"server {sv.name}'s {what}: port {port} lies in this machine's ephemeral range "
                           f"{lo}-{hi} (net.ipv4.ip_local_port_range), where an outgoing connection can hold "
                           "it; pick a port below it")
    return out


def _area_of(spec: ServerSpec) -> Area:
    return Area(spec.name, 0, 0, 0, check_public_key(spec.public_key, spec.name), spec.sync)


def create_store(home: Path, name: str, devices: Sequence[str], page_size: int, servers: Sequence[ServerSpec], *,
                 events: dict[str, str] | None = None, metrics: dict[str, str] | None = None,
                 service: ServiceConfig | None = None, worker: WorkerConfig | None = None,
                 sync: SyncConfig | None = None, force: bool = False, areas: int | None = None,
                 area_slots: int | None = None) -> tuple[StoreConfig, list[Superblock], list[str]]:
    """Create store ``name``: keys, formatted devices (membership generation 1), this machine's config.

    Returns the store, each device's superblock, and the servers whose keypair was made here
    (their key files must reach them: the flow for sites that want the administrator to make keys).

    Raises:
        ValueError: bad names, addresses, keys, sizes; DeviceMismatch: a device of another store
        (without ``force``).
    """
    from .crdt.serverkeys import create_keypair
    from .shm.index import MAX_SLOTS
    from .storage.device import device_size, format_device
    from .storage.superblock import plan_areas

    check_name(name, "store")
    devices = [os.path.abspath(d) for d in devices]  # the config is read from any working directory
    slots = 0
    for d in devices:
        try:
            slots += sum(a.slot_count for a in plan_areas(device_size(d), page_size, [s.name for s in servers],
                                                          areas, area_slots))
        except ValueError as e:
            raise ValueError(f"{d}: {e}") from None
    if slots > MAX_SLOTS:  # checked before any device is formatted
        raise ValueError(f"the devices hold {slots} slots of {page_size} bytes; a store holds at most "
                         f"{MAX_SLOTS} (the key index's limit): use larger pages or fewer devices")
    events, metrics = events or {}, metrics or {}
    unknown = (set(events) | set(metrics)) - {s.name for s in servers}
    if unknown:
        raise ValueError(f"events/metrics name servers that are not in --server: {sorted(unknown)}")
    salt = os.urandom(32)
    store_uuid = str(uuidlib.uuid4())
    local = LocalConfig(name=name, uuid=store_uuid, devices=tuple(devices),
                        hosted={n: {k: v for k, v in (("events", events.get(n, "")), ("metrics", metrics.get(n, "")))
                                    if v} for n in {s.name for s in servers} if events.get(n) or metrics.get(n)},
                        service=service or ServiceConfig(), worker=worker or WorkerConfig(), sync=sync or SyncConfig())
    # validates the whole (names unique, sync addresses where several servers) before anything is written
    local.compose(page_size, salt, [(s.name, s.sync, s.public_key, False) for s in servers], 1)
    check_collisions([Claims(s.name, s.sync, s.public_key, events.get(s.name, ""), metrics.get(s.name, ""))
                      for s in servers])
    made = []
    specs = []
    for s in servers:
        if not s.public_key:
            s = dataclasses.replace(s, public_key=create_keypair(name, s.name, home))
            made.append(s.name)
        specs.append(s)
    admin = AdminKey.generate()
    admin.save(admin_key_path(name, home))
    local = dataclasses.replace(local, admin_key=admin.public.hex())
    sbs = [format_device(d, store_uuid=uuidlib.UUID(store_uuid).bytes, store_name=name, page_size=page_size,
                         device_index=i, device_count=len(devices), servers=[_area_of(s) for s in specs],
                         salt=salt, sign=admin.sign, membership_gen=1, force=force, areas=areas,
                         area_slots=area_slots)
           for i, d in enumerate(devices)]
    save_store(local, home)
    return compose_store(local, home), sbs, made


def allow_server(home: Path, cfg: StoreConfig, spec: ServerSpec, *, reuse: str | None = None,
                 events: str = "", metrics: str = "", update: bool = False) -> tuple[StoreConfig, int, bool]:
    """Give ``spec`` an area (``_allow``), holding this machine's administrator lock and
    deciding from the membership read under it (two allows at once never take one area)."""
    with admin_lock(cfg.name, home):
        cfg, m = compose_membership(load_local(cfg.name, home), home, torn_ok=True)
        return _allow(home, cfg, m, spec, reuse=reuse, events=events, metrics=metrics, update=update)


def _allow(home: Path, cfg: StoreConfig, m: Membership, spec: ServerSpec, *, reuse: str | None = None,
           events: str = "", metrics: str = "", update: bool = False) -> tuple[StoreConfig, int, bool]:
    """Give ``spec`` a spare area (or its own area back if it was denied, or a denied server's
    area with ``reuse``) on every device, signed; with ``update``, change an allowed server's
    sync address or key instead. Returns the new store, the area index, and whether a keypair
    was made here.

    Raises:
        NotAllowed: already allowed (without ``update``), no spare area, ``reuse`` not denied,
            or no administrator key here.
        ValueError: several servers without a sync address.
    """
    from .crdt.serverkeys import create_keypair

    admin = _admin(cfg, home)
    existing = {s.name: i for i, s in enumerate(cfg.servers)}
    name = spec.name
    allowed = name in existing and not cfg.servers[existing[name]].denied
    if update:
        if not allowed:
            raise NotAllowed(f"--update: server {name!r} is not allowed on store {cfg.name!r}")
        old = cfg.servers[existing[name]]
        spec = ServerSpec(name, spec.sync or old.sync, spec.public_key or old.public_key)
        if (spec.sync, spec.public_key) == (old.sync, old.public_key):
            raise NotAllowed(f"--update: server {name!r} already has that address and key")
    elif allowed:
        raise NotAllowed(f"server {name!r} is already allowed on store {cfg.name!r} (--update changes its "
                         "sync address or key)")
    if reuse is not None:
        ri = cfg.server_index(reuse)
        if not cfg.servers[ri].denied:
            raise NotAllowed(f"--reuse {reuse}: that server is not denied (deny it first, and stop it)")
        if name in existing:
            raise NotAllowed(f"--reuse: server {name!r} is already on store {cfg.name!r}")
        index, sync = ri, spec.sync
    elif name in existing:  # allowed again (after deny), or updated
        index = existing[name]
        sync = spec.sync or cfg.servers[index].sync
    else:
        index, sync = len(cfg.servers), spec.sync
    servers = list(cfg.servers)
    servers[index:index + 1] = [ServerConfig(name, sync, spec.public_key or "k" * 40, events, metrics)]
    try:
        dataclasses.replace(cfg, servers=tuple(servers))  # validates: sync addresses, server count
    except ValueError as e:
        lacking = next((s.name for s in servers if not s.sync), None)
        if "needs a sync address" in str(e) and lacking and lacking != name:
            raise ValueError(f"{e}: give it one first with 'mass-ctl kvcache allow {cfg.name} {lacking}=HOST:PORT "
                             "--update' (its running service picks it up), then allow again") from None
        raise
    if index >= len(m.newest.areas):
        raise NotAllowed(
            f"store {cfg.name!r} has no spare area: its {len(m.newest.areas)} area(s) per device are all "
            f"assigned. Give it the area of a denied server (--reuse NAME), or recreate the store with "
            f"--area-size or --spare to leave room for more servers")
    # nothing the new entry listens on or holds may be another allowed server's (its own old
    # entry, replaced here, does not count)
    check_collisions([claims_of(sv) for i, sv in enumerate(cfg.servers) if i != index and not sv.denied]
                     + [Claims(name, sync, spec.public_key, events or (cfg.servers[index].events if index < len(
                         cfg.servers) and cfg.servers[index].name == name else ""), metrics)])
    made = not spec.public_key
    pub = spec.public_key or create_keypair(cfg.name, name, home)

    def change(areas: list[Area]) -> list[Area]:
        areas[index] = dataclasses.replace(areas[index], server=name, flags=0, sync=sync,
                                           public_key=check_public_key(pub, name))
        return areas

    _change(home, cfg, admin, change)
    local = load_local(cfg.name, home)
    if events or metrics or name in local.hosted:
        hosted = dict(local.hosted)
        hosted[name] = {k: v for k, v in (("events", events), ("metrics", metrics)) if v}
        local = dataclasses.replace(local, hosted={n: h for n, h in hosted.items() if h})
        save_store(local, home)
    return compose_store(local, home), index, made


def deny_server(home: Path, cfg: StoreConfig, name: str) -> tuple[StoreConfig, int]:
    """Flag ``name``'s area denied and drop its public key on every device, signed; delete
    its key file here if there is one. Returns the new store and the area index.

    Raises:
        NotAllowed: unknown, already denied, the last allowed server, or no administrator key here.
    """
    with admin_lock(cfg.name, home):
        return _deny(home, load_store(cfg.name, home, torn_ok=True), name)


def _deny(home: Path, cfg: StoreConfig, name: str) -> tuple[StoreConfig, int]:
    index = cfg.server_index(name)
    if cfg.servers[index].denied:
        raise NotAllowed(f"server {name!r} is already denied on store {cfg.name!r}")
    if len(cfg.allowed) == 1:
        raise NotAllowed(f"server {name!r} is the last allowed server of store {cfg.name!r}: "
                         "a store needs at least one")
    admin = _admin(cfg, home)

    def change(areas: list[Area]) -> list[Area]:
        areas[index] = dataclasses.replace(areas[index], flags=AREA_DENIED, public_key=b"")
        return areas

    _change(home, cfg, admin, change)
    key_path(cfg.name, name, home).unlink(missing_ok=True)
    return compose_store(load_local(cfg.name, home), home), index


@dataclass(frozen=True)
class Invalidated:
    """What ``invalidate`` did."""

    cfg: StoreConfig
    """The store as composed after it (``membership_gen``, ``key_epoch``, ``epochs``)."""
    namespaces: tuple[str, ...]
    """The key spaces invalidated by name (empty with ``everyone``)."""
    everyone: bool
    """Every key space moved: asked for, or the epoch table had no room for another namespace."""


def invalidate(home: Path, cfg: StoreConfig, tenants: Sequence[str] | None, namespaces: Sequence[str] = ()
               ) -> Invalidated:
    """Invalidate the pages of ``tenants`` (their key spaces as this machine's ``[namespaces]``
    maps them, see ``StoreConfig.namespace_of``; "" is the default tenant) and of the key spaces
    ``namespaces`` named directly, or, with ``tenants`` None, of every tenant, in O(1): the key epochs on
    every device move on (signed, the next membership generation) and every tenant salt of
    those key spaces changes, so no digest of a page saved before is ever asked for again.
    Running services apply it at their next superblock poll; their clients' next lookup uses
    the new salt. The pages stay on the devices until their slots are reused.

    Raises:
        NotAllowed: no administrator key here. ValueError: a bad tenant name, or none given.
    """
    if tenants is not None and not tenants and not namespaces:
        raise ValueError("name the tenants to invalidate (--tenant NAME, '' for the default tenant), key spaces "
                         "(--namespace NAME) or all")
    with admin_lock(cfg.name, home):
        cfg = load_store(cfg.name, home, torn_ok=True)
        names = None if tenants is None else tuple(sorted({cfg.namespace_of(t) for t in tenants}
                                                          | {check_name(n, "namespace") for n in namespaces}))
        admin = _admin(cfg, home)
        everyone = False

        def rekey(epochs: Epochs) -> Epochs:
            nonlocal everyone
            key_epoch, table, everyone = bump_epochs(epochs[0], epochs[1], names)
            return key_epoch, table

        _change(home, cfg, admin, lambda areas: areas, rekey=rekey)
        return Invalidated(compose_store(load_local(cfg.name, home), home), () if everyone else names or (),
                           everyone)


def repair_store(home: Path, store: str, vouched: Sequence[str] = ()) -> tuple[Membership, tuple[int, ...]]:
    """Rewrite every device of ``store`` whose superblock is torn, rolled back (replayed),
    lagging, missing a copy or split, from the newest membership this machine has verified,
    signed at the next generation; the membership itself does not change. Returns the new
    membership and the devices rewritten (empty: nothing to repair, nothing written).
    ``vouched`` paths are rewritten even when their blocks no longer name the device (a wiped
    superblock): the operator vouches for the path.

    Raises:
        NotAllowed: no administrator key here. DeviceMismatch: a device no record covers.
        ValueError: a vouched path that is not one of the store's devices.
    """
    with admin_lock(store, home):
        local = load_local(store, home)
        unknown = sorted(set(vouched) - set(local.devices))
        if unknown:
            raise ValueError(f"--force {', '.join(unknown)}: not a device of store {store!r} "
                             f"({', '.join(local.devices)})")
        cfg, m = compose_membership(local, home, torn_ok=True, vouched=vouched)
        admin = _admin(cfg, home)
        if not m.damaged:
            return m, ()
        return _change(home, cfg, admin, lambda areas: areas, vouched), m.damaged


@contextlib.contextmanager
def admin_lock(store: str, home: Path) -> Iterator[None]:
    """This machine's administrator lock of ``store`` (flock): membership changes run one at a time."""
    p = store_path(store, home).with_suffix(".admin.lock")
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _change(home: Path, cfg: StoreConfig, admin: AdminKey, change: Callable[[list[Area]], list[Area]],
            vouched: Sequence[str] = (), rekey: Callable[[Epochs], Epochs] | None = None) -> Membership:
    record = seen_record(cfg.name, home)
    seen = record.load()
    m = change_membership(cfg.devices, store_uuid=cfg.uuid_bytes, admin=admin, change=change, seen=seen,
                          vouched=vouched, rekey=rekey)
    record.note(m, seen)
    note_membership(cfg.name, cfg.uuid, m.gen, home)
    return m


def _admin(cfg: StoreConfig, home: Path) -> AdminKey:
    try:
        admin = AdminKey.load(admin_key_path(cfg.name, home))
    except PermissionError as e:
        raise NotAllowed(str(e)) from None
    if admin.public.hex() != cfg.admin_key:
        raise NotAllowed(f"the administrator key at {admin_key_path(cfg.name, home)} is not the one store "
                         f"{cfg.name!r} trusts ({cfg.admin_key[:16]}...)")
    return admin


def find_devices(given: Sequence[str], store_uuid: bytes) -> list[str]:
    """``given`` plus the store's other devices found beside them: for a block device, the
    other block devices of this machine (/proc/partitions); for a file, the files in its
    directory. Only superblocks are read (8 KiB each, O_DIRECT).

    Raises:
        DeviceMismatch: two candidates (not given) claim one device index of the store: a copy of
            a device, or one device seen through two paths (multipath, two controllers). Both are
            named; the operator picks one with ``--device``.
    """
    from .storage.device import decode_copies, read_blocks

    candidates: list[str] = list(given)
    for g in given:
        try:
            mode = os.stat(g).st_mode
        except OSError:
            continue
        if stat.S_ISBLK(mode):
            try:
                lines = Path("/proc/partitions").read_text().split("\n")[2:]
            except OSError:
                lines = []
            candidates += [f"/dev/{ln.split()[3]}" for ln in lines if len(ln.split()) == 4]
        elif stat.S_ISREG(mode):
            candidates += sorted(str(p) for p in Path(g).resolve().parent.iterdir() if p.is_file())
    chosen: dict[int, str] = {}
    claims: dict[int, list[str]] = {}
    real_given = {os.path.realpath(g) for g in given}
    seen: set[str] = set()
    for c in candidates:
        real = os.path.realpath(c)
        if real in seen:
            continue
        seen.add(real)
        try:
            blocks = read_blocks(c)
        except (DeviceMismatch, OSError):
            continue
        valid = [x for x in decode_copies(blocks) if isinstance(x, Superblock)]
        if not valid:  # torn: still a claimant of the index its blocks name, so a backup beside it is no pick
            for i in raw_device_indexes(blocks, store_uuid):
                claims.setdefault(i, []).append(f"{c} (its superblock is torn)")
            continue
        sb = max(valid, key=lambda x: x.generation)
        if sb.store_uuid != store_uuid:
            continue
        if real in real_given:
            chosen[sb.device_index] = c  # the operator's pick
        claims.setdefault(sb.device_index, []).append(c)
    for i, paths in sorted(claims.items()):
        if i not in chosen and len(paths) > 1:
            raise DeviceMismatch(f"device {i} of the store is claimed by {' and '.join(paths)} (a copy of a device, "
                                 "one device seen through two paths, or a torn device and its copy): pass the right "
                                 "one with --device")
        if not paths[0].endswith(" (its superblock is torn)"):
            chosen.setdefault(i, paths[0])
    return [chosen[i] for i in sorted(chosen)]


def join_store(home: Path, name: str, devices: Sequence[str], admin_key: str | None = None) -> tuple[
        LocalConfig, Membership, bool]:
    """Write this machine's config of store ``name`` from its devices (``connect --device``).

    The administrator key is ``admin_key`` (hex) if given, else the one the devices name
    (trusted on first use: the caller prints it). Returns the config, the membership, and
    whether a new key was trusted.

    Raises:
        DeviceMismatch: the devices are not store ``name``'s, do not verify, or are incomplete.
        ValueError: a malformed ``admin_key``.
    """
    devices = [os.path.abspath(d) for d in devices]
    pinned = bytes.fromhex(admin_key) if admin_key else None
    if pinned is not None and len(pinned) != 32:
        raise ValueError("--admin-key must be 64 hex characters (as 'mass-ctl kvcache show' prints)")
    from .storage.device import read_superblock

    first = read_superblock(devices[0])
    if first.store_name != name:
        raise DeviceMismatch(f"device {devices[0]} belongs to store {first.store_name!r}, not {name!r}")
    paths = find_devices(devices, first.store_uuid) \
        if len(devices) < first.device_count else list(devices)
    m = read_membership(paths, store_uuid=first.store_uuid, admin_key=pinned)
    try:
        old: LocalConfig | None = load_local(name, home)
    except StoreNotFound:
        old = None
    if old is not None and old.uuid != str(uuidlib.UUID(bytes=first.store_uuid)):
        raise DeviceMismatch(f"this machine's config of store {name!r} ({store_path(name, home)}) is of another "
                             "store (another uuid): remove it to join this one")
    if old is not None and old.admin_key and old.admin_key != m.admin_key.hex():
        raise DeviceMismatch(f"the devices are signed by {fingerprint(m.admin_key)[:16]}..., this machine trusts "
                             f"{old.admin_key[:16]}...: refused")
    base = old or LocalConfig(name=name, uuid=str(uuidlib.UUID(bytes=first.store_uuid)), devices=tuple(m.paths))
    local = dataclasses.replace(base, devices=tuple(m.paths), admin_key=m.admin_key.hex())
    save_store(local, home if home else mass_home())
    return local, m, not (old and old.admin_key) and pinned is None


__all__ = ["Claims", "ServerSpec", "admin_lock", "allow_server", "check_collisions", "check_public_key", "claims_of",
           "create_store", "deny_server", "ephemeral_warnings", "find_devices", "join_store", "repair_store"]
