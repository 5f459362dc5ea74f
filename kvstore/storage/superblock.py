"""The superblock: an 8 KiB block at offset 0 of every device, and its copy at 8192.

The devices are the authority on the store: its layout *and* its membership
(which server owns which area, its sync address and public key, allowed or
denied). Every machine that sees the devices sees the same store; nothing is
copied between machines.

Layout (little-endian, 8192 bytes; docs/FORMAT.md "Superblock")::

    off  size  field
      0     8  magic            b"KVSTSUPR"
      8     4  version          u32, 2; 3 once a key epoch is set (older readers refuse it)
     12     4  block_size       u32, 4096
     16    16  store_uuid       16 raw bytes
     32     8  generation       u64, bumped by every rewrite of this device's superblock
     40     8  page_size        u64, payload bytes per slot (multiple of 4096)
     48     8  device_size      u64, bytes of the device when formatted
     56     8  data_offset      u64, byte offset of the first area (1 MiB)
     64     4  device_index     u32, this device's index in the store
     68     4  device_count     u32
     72     4  area_count       u32, <= MAX_AREAS
     76     4  reserved         zero
     80    32  store_name       utf-8, NUL padded
    112     8  membership_gen   u64, store-wide: bumped by every create/allow/deny, same on every device
    120     8  key_epoch        u64, store-wide key epoch: +1 by every `invalidate` of all tenants
    128    32  salt             key-digest salt of the store (shared by all its servers)
    160    32  admin_key        Ed25519 public key of the store's administrator
    192    64  signature        Ed25519 by admin_key over bytes [0, 8184) with this field zeroed
    256 160*48 area table       MAX_AREAS entries of AREA_FMT (below), unused ones zero
   7936   240  epoch table      EPOCH_SLOTS entries of EPOCH_FMT (below), unused ones zero
   8176     8  reserved         zero
   8184     8  checksum         xxh3_64 of bytes [0, 8184)

    area entry (160 bytes):
      0    32  server_name      utf-8, NUL padded; empty: a spare area for `allow`
     32     8  offset           u64, byte offset of the area's slot 0
     40     8  slot_count       u64
     48     4  flags            u32, bit 0 DENIED (its server was cut off; nobody reads it)
     52     4  reserved         zero
     56     8  changed_gen      u64, membership_gen of the entry's last change
     64    32  public_key       CurveZMQ public key (raw); zero: none
     96    64  sync             utf-8 "HOST:PORT" of its peer sync endpoint, NUL padded; empty: none

    epoch entry (40 bytes):
      0    32  namespace        utf-8, NUL padded (a key space: a tenant or shared namespace name,
                                ":default" for the default tenant's)
     32     8  epoch            u64, +1 by every `invalidate` of that namespace

Key epochs (``mass-ctl kvcache invalidate``): every tenant's salt is derived from the store
salt, its namespace and (key_epoch, the namespace's epoch). Bumping one moves that key space
to digests no page ever written carries, in O(1); the pages become unreachable and are
reused as space is needed. Pairs never repeat: key_epoch only grows, and a namespace's
epoch restarts at 0 only together with a key_epoch bump (which clears the table).

Why two copies: a rewrite (generation g+1) writes copy A, syncs, then copy B.
A torn write leaves one copy whose checksum fails; the reader takes the valid
copy with the highest generation, so either the old or the new superblock wins.

Why a signature: every server of the store can write the devices, a denied one
included (until the fabric's own access list shuts it out). The checksum finds
torn and rotten blocks; only the signature of the administrator's key, which
every machine pins at its first connect, makes a forged membership entry (a
denied server allowing itself again, a key nobody admitted) fail to verify.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..errors import CorruptPage

MAGIC = b"KVSTSUPR"
SUPERBLOCK_VERSION = 2
#: Written instead of 2 once a key epoch is set, so a kvstore that cannot honour epochs refuses it.
SUPERBLOCK_VERSION_EPOCHS = 3
#: Version of the slot header format (storage/header.py); the superblock has its own.
FORMAT_VERSION = 1
BLOCK = 4096
SUPERBLOCK_SIZE = 8192
COPY_OFFSETS = (0, 8192)
DATA_OFFSET = 1 << 20
MAX_AREAS = 48
AREA_DENIED = 1
AREA_FLAGS = AREA_DENIED
KEY_BYTES = 32
SYNC_BYTES = 64

HEAD_FMT = "<8sII16sQQQQIIII32sQQ32s32s64s"
AREA_FMT = "<32sQQI4xQ32s64s"
HEAD_SIZE = struct.calcsize(HEAD_FMT)  # 256
AREA_SIZE = struct.calcsize(AREA_FMT)  # 160
AREA_TABLE_OFFSET = HEAD_SIZE
EPOCH_TABLE_OFFSET = 7936
EPOCH_FMT = "<32sQ"
EPOCH_SIZE = struct.calcsize(EPOCH_FMT)  # 40
EPOCH_SLOTS = 6
#: The epoch-table name of the default tenant's key space (":" is in no tenant or namespace name).
DEFAULT_NAMESPACE = ":default"
SIGNATURE_OFFSET = 192
SIGNATURE_SIZE = 64
CHECKSUM_OFFSET = SUPERBLOCK_SIZE - 8


@dataclass(frozen=True)
class Area:
    """One server's area on one device: ``slot_count`` slots starting at ``offset``.

    ``server`` is empty for a spare area (reserved at create for a server allowed later);
    ``flags & AREA_DENIED`` marks the area of a denied server. ``public_key`` (raw 32 bytes,
    or empty) and ``sync`` (``HOST:PORT`` or empty) are the server's identity for its peers."""

    server: str
    offset: int
    slot_count: int
    flags: int = 0
    public_key: bytes = b""
    sync: str = ""
    changed_gen: int = 0

    @property
    def spare(self) -> bool:
        """No server owns this area yet."""
        return not self.server

    @property
    def denied(self) -> bool:
        """Its server was denied: its pages are not read."""
        return bool(self.flags & AREA_DENIED)


@dataclass(frozen=True)
class Superblock:
    """Decoded superblock of one device."""

    store_uuid: bytes
    store_name: str
    generation: int
    page_size: int
    device_size: int
    device_index: int
    device_count: int
    areas: tuple[Area, ...]
    data_offset: int = DATA_OFFSET
    membership_gen: int = 0
    salt: bytes = bytes(32)
    admin_key: bytes = bytes(32)
    signature: bytes = bytes(64)
    key_epoch: int = 0
    """Store-wide key epoch (see the module docstring)."""
    epochs: tuple[tuple[str, int], ...] = ()
    """(namespace, epoch) of the key spaces invalidated on their own since ``key_epoch`` last grew."""

    @property
    def version(self) -> int:
        """The format version this superblock is written with."""
        return SUPERBLOCK_VERSION_EPOCHS if self.key_epoch or self.epochs else SUPERBLOCK_VERSION

    @property
    def slot_size(self) -> int:
        """Bytes per slot on the device: one 4 KiB header block plus the payload."""
        return BLOCK + self.page_size

    def signed_bytes(self) -> bytes:
        """What the administrator signs: the encoded block before the checksum, signature zeroed."""
        return bytes(self._pack(bytes(SIGNATURE_SIZE))[:CHECKSUM_OFFSET])

    def _pack(self, signature: bytes) -> bytearray:
        if len(self.areas) > MAX_AREAS:
            raise ValueError(f"at most {MAX_AREAS} areas per device, got {len(self.areas)}")
        if len(self.salt) != 32 or len(self.admin_key) != KEY_BYTES or len(signature) != SIGNATURE_SIZE:
            raise ValueError("superblock: salt and admin key are 32 bytes, the signature 64")
        if len(self.epochs) > EPOCH_SLOTS:
            raise ValueError(f"at most {EPOCH_SLOTS} namespace epochs, got {len(self.epochs)}")
        buf = bytearray(SUPERBLOCK_SIZE)
        struct.pack_into(
            HEAD_FMT, buf, 0, MAGIC, self.version, BLOCK, self.store_uuid, self.generation,
            self.page_size, self.device_size, self.data_offset, self.device_index,
            self.device_count, len(self.areas), 0, _fixed(self.store_name, 32, "store name"),
            self.membership_gen, self.key_epoch, self.salt, self.admin_key, signature,
        )
        for i, (ns, epoch) in enumerate(self.epochs):
            if not ns or epoch < 1:
                raise ValueError(f"epoch entry {i}: a namespace name and an epoch >= 1")
            struct.pack_into(EPOCH_FMT, buf, EPOCH_TABLE_OFFSET + i * EPOCH_SIZE, _fixed(ns, 32, "namespace"), epoch)
        for i, a in enumerate(self.areas):
            if a.public_key and len(a.public_key) != KEY_BYTES:
                raise ValueError(f"area {i}: a public key is {KEY_BYTES} bytes")
            struct.pack_into(AREA_FMT, buf, AREA_TABLE_OFFSET + i * AREA_SIZE,
                             _fixed(a.server, 32, "server name"), a.offset, a.slot_count, a.flags,
                             a.changed_gen, a.public_key or bytes(KEY_BYTES), _fixed(a.sync, SYNC_BYTES, "sync address"))
        return buf

    def encode(self) -> bytes:
        """The 8192-byte on-device form, signature and checksum included."""
        buf = self._pack(self.signature)
        struct.pack_into("<Q", buf, CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(bytes(buf[:CHECKSUM_OFFSET])))
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Superblock:
        """Parse and validate one copy (checksum, version, ranges; the signature is the
        caller's to verify against the key it trusts: storage/membership.py).

        Raises:
            CorruptPage: bad magic, version, checksum or field range.
        """
        data = bytes(data[:SUPERBLOCK_SIZE])
        if len(data) < 16:
            raise CorruptPage(f"superblock: {len(data)} bytes, need {SUPERBLOCK_SIZE}")
        magic, version = struct.unpack_from("<8sI", data, 0)
        if magic != MAGIC:
            raise CorruptPage("superblock: bad magic (not a kvstore device)")
        if version not in (SUPERBLOCK_VERSION, SUPERBLOCK_VERSION_EPOCHS):
            raise CorruptPage(
                f"superblock: format version {version}, this kvstore reads {SUPERBLOCK_VERSION} and "
                f"{SUPERBLOCK_VERSION_EPOCHS}"
                + (" (version 1 kept the membership in a config file; re-create the store with "
                   "'mass-ctl kvcache create ... --force': its pages are regenerable cache)" if version == 1 else ""))
        if len(data) < SUPERBLOCK_SIZE:
            raise CorruptPage(f"superblock: {len(data)} bytes, need {SUPERBLOCK_SIZE}")
        (stored,) = struct.unpack_from("<Q", data, CHECKSUM_OFFSET)
        if stored != xxhash.xxh3_64_intdigest(data[:CHECKSUM_OFFSET]):
            raise CorruptPage("superblock: checksum mismatch")
        (_m, _v, block, uuid, gen, page_size, dev_size, data_off, dev_idx, dev_count, n_areas, _res, name,
         mgen, key_epoch, salt, admin, sig) = struct.unpack_from(HEAD_FMT, data, 0)
        if block != BLOCK or page_size % BLOCK or page_size == 0 or n_areas > MAX_AREAS \
                or dev_idx >= dev_count or data_off % BLOCK:
            raise CorruptPage("superblock: field out of range")
        areas = []
        for i in range(n_areas):
            sname, off, count, flags, cgen, key, sync = struct.unpack_from(
                AREA_FMT, data, AREA_TABLE_OFFSET + i * AREA_SIZE)
            if off % BLOCK or off + count * (BLOCK + page_size) > dev_size:
                raise CorruptPage(f"superblock: area {i} lies outside the device")
            if flags & ~AREA_FLAGS:
                raise CorruptPage(f"superblock: area {i} has unknown flags {flags:#x}")
            areas.append(Area(_text(sname), off, count, flags, b"" if key == bytes(KEY_BYTES) else key,
                              _text(sync), cgen))
        epochs = []
        for i in range(EPOCH_SLOTS):
            ns, epoch = struct.unpack_from(EPOCH_FMT, data, EPOCH_TABLE_OFFSET + i * EPOCH_SIZE)
            if ns.strip(b"\0") or epoch:
                if not ns.strip(b"\0") or not epoch:
                    raise CorruptPage(f"superblock: epoch entry {i} is half empty")
                epochs.append((_text(ns), epoch))
        if (key_epoch or epochs) and version != SUPERBLOCK_VERSION_EPOCHS:
            raise CorruptPage(f"superblock: key epochs in a version {version} superblock")
        return cls(uuid, _text(name), gen, page_size, dev_size, dev_idx, dev_count, tuple(areas), data_off,
                   mgen, salt, admin, sig, key_epoch, tuple(epochs))


def bump_epochs(key_epoch: int, epochs: tuple[tuple[str, int], ...], namespaces: Sequence[str] | None
                ) -> tuple[int, tuple[tuple[str, int], ...], bool]:
    """The key epochs after invalidating ``namespaces`` (``None``: every key space). Returns
    ``(key_epoch, epochs, everyone)``; ``everyone`` is True when every key space moved, asked
    for or because the table has no room for another namespace (then the store-wide epoch
    grows and the table is cleared: more misses, never a page served from before)."""
    if namespaces is None:
        return key_epoch + 1, (), True
    table = dict(epochs)
    for ns in namespaces:
        table[ns] = table.get(ns, 0) + 1
    if len(table) > EPOCH_SLOTS:
        return key_epoch + 1, (), True
    return key_epoch, tuple(sorted(table.items())), False


def _fixed(text: str, size: int, what: str) -> bytes:
    raw = text.encode()
    if len(raw) > size:
        raise ValueError(f"superblock: {what} {text!r} is longer than {size} bytes")
    return raw


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def plan_areas(device_size: int, page_size: int, servers: list[str], areas: int | None = None,
               area_slots: int | None = None) -> tuple[Area, ...]:
    """Lay out ``areas`` areas (default: one per server) after the reserved first MiB.

    The first ``len(servers)`` areas are named after the servers, the rest are spare
    (for ``mass-ctl kvcache allow``). Each area has ``area_slots`` slots, default the
    device split equally.

    Raises:
        ValueError: too many areas, or the device cannot hold them with at least one slot each.
    """
    n = len(servers) if areas is None else areas
    if n < len(servers):
        raise ValueError(f"{n} areas cannot hold {len(servers)} servers")
    if n > MAX_AREAS:
        raise ValueError(f"at most {MAX_AREAS} areas per device (servers plus spares), got {n}")
    slot = BLOCK + page_size
    room = (device_size - DATA_OFFSET) // slot if device_size > DATA_OFFSET else 0
    per = room // max(1, n) if area_slots is None else area_slots
    if per < 1 or per * n > room:
        need = DATA_OFFSET + slot * n * max(1, area_slots or 1)
        raise ValueError(
            f"device of {device_size} bytes is too small: {n} area(s) of {max(1, area_slots or 1)} "
            f"slot(s) of {page_size}-byte pages need at least {need} bytes"
        )
    names = list(servers) + [""] * (n - len(servers))
    return tuple(Area(s, DATA_OFFSET + i * per * slot, per) for i, s in enumerate(names))


def areas_that_fit(device_size: int, page_size: int, area_slots: int) -> int:
    """How many areas of ``area_slots`` slots fit on a device (at most ``MAX_AREAS``)."""
    room = (device_size - DATA_OFFSET) // (BLOCK + page_size) if device_size > DATA_OFFSET else 0
    return min(MAX_AREAS, room // max(1, area_slots))
