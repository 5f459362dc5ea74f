"""Membership on the devices: who owns which area, signed by the store's administrator.

The superblock of every device carries the area table with each server's name,
sync address, CurveZMQ public key and allowed/denied state, plus a store-wide
``membership_gen`` (superblock.py). ``create``, ``allow`` and ``deny`` rewrite
every device with the next ``membership_gen`` and sign each superblock with the
administrator's Ed25519 key; every machine pins that key's public half at its
first ``connect`` (or is given it) and from then on:

* takes, per device, the newest copy whose checksum *and* signature hold (a torn
  or forged copy is refused and the other copy, or the last good membership, stays);
* takes the membership of the device with the highest ``membership_gen`` (a
  change interrupted between devices is finished by the next change);
* refuses a ``membership_gen`` lower than one it has already seen (a replayed old
  superblock cannot allow a denied server again).

Each machine also keeps the newest verified superblock of each device it has read
(``SeenRecord``, ``MASS_HOME/stores/<store>.membership``): signed by the administrator,
so the file needs no trust of its own. A device that went back to an older membership
(a replayed or restored superblock) is read as the record has it (``rolled_back``), so
replays neither lock out the administrator nor stop a restart; with ``torn_ok``, a device
whose copies are both torn is read from the record too (``torn``) when its blocks still
name the store and that device index. The service never starts on a torn device (a path
that now leads elsewhere must not be written); the administrator's next change, or
``repair``, rewrites every torn or rolled-back device.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from ..errors import CorruptPage, DeviceMismatch
from .device import decode_copies, device_size, read_blocks, valid_copies, write_superblock
from .superblock import MAGIC, SUPERBLOCK_SIZE, Area, Superblock


class AdminKey:
    """The administrator's Ed25519 signing key of one store (kept owner-only, never copied to
    GPU servers: they hold only its public half)."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._key = private
        self.public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def generate(cls) -> AdminKey:
        """A new random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> AdminKey:
        """Read a key written by ``save``.

        Raises:
            PermissionError: no key file here (this machine does not administer the store).
        """
        try:
            seed = bytes.fromhex(path.read_text().strip())
        except FileNotFoundError:
            raise PermissionError(f"no administrator key at {path}: allow and deny run on the machine that "
                                  "created the store (or one given a copy of that file)") from None
        except ValueError:
            raise PermissionError(f"administrator key {path} is malformed") from None
        if len(seed) != 32:
            raise PermissionError(f"administrator key {path} is malformed")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def save(self, path: Path) -> None:
        """Write the key owner-only (0600), atomically."""
        seed = self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(seed.hex() + "\n")
        os.replace(tmp, path)

    def sign(self, sb: Superblock) -> Superblock:
        """``sb`` with this key as its admin key and a signature over it."""
        sb = dataclasses.replace(sb, admin_key=self.public)
        return dataclasses.replace(sb, signature=self._key.sign(sb.signed_bytes()))


def signed_by(sb: Superblock, admin_key: bytes) -> bool:
    """True if ``sb`` names ``admin_key`` and carries that key's valid signature."""
    if sb.admin_key != admin_key:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(admin_key).verify(sb.signature, sb.signed_bytes())
        return True
    except (InvalidSignature, ValueError):
        return False


def fingerprint(admin_key: bytes) -> str:
    """The administrator key as printed and pinned: 64 hex characters."""
    return admin_key.hex()


@dataclass(frozen=True)
class Member:
    """One area's owner as the newest membership has it (spare areas are not members)."""

    index: int
    name: str
    sync: str
    public_key: bytes
    denied: bool


@dataclass(frozen=True)
class Membership:
    """The store as its devices have it: each device's own verified superblock, and the
    membership of the newest."""

    sbs: tuple[Superblock, ...]
    """Per device, in device-index order: its newest copy that verified."""
    paths: tuple[str, ...]
    """The device paths, in device-index order."""
    gen: int
    """The highest ``membership_gen`` among the devices: the membership in force."""
    lagging: tuple[int, ...]
    """Devices whose ``membership_gen`` is lower (a change interrupted part-way)."""
    refused: tuple[str, ...]
    """Why copies were refused (torn, forged, signed by another key, rolled back): for the log."""
    torn: tuple[int, ...] = ()
    """Devices with no copy that verifies (torn or forged), read from this machine's record
    (``torn_ok`` only)."""
    rolled_back: tuple[int, ...] = ()
    """Devices whose membership is older than this machine's record: read from the record."""
    degraded: tuple[int, ...] = ()
    """Devices with one copy that does not verify (torn, forged, another device's) beside a good one."""
    split: tuple[int, ...] = ()
    """Devices whose membership at the newest generation differs from the lowest such device's."""

    @property
    def damaged(self) -> tuple[int, ...]:
        """Devices the next change (or ``repair``) should rewrite: torn, rolled back, lagging,
        with a lost copy, or split."""
        return tuple(sorted(set(self.torn) | set(self.rolled_back) | set(self.lagging) | set(self.degraded)
                            | set(self.split)))

    @property
    def newest(self) -> Superblock:
        """The superblock whose membership is in force."""
        return max(self.sbs, key=lambda s: (s.membership_gen, -s.device_index))

    @property
    def admin_key(self) -> bytes:
        return self.newest.admin_key

    @property
    def members(self) -> tuple[Member, ...]:
        """Named areas in area order. Spare areas come only after the named ones."""
        out = []
        for i, a in enumerate(self.newest.areas):
            if a.spare:
                continue
            out.append(Member(i, a.server, a.sync, a.public_key, a.denied))
        return tuple(out)


def read_membership(paths: Sequence[str], *, store_uuid: bytes | None, admin_key: bytes | None,
                    min_gen: int = 0, seen: Mapping[str, Superblock] | None = None,
                    torn_ok: bool = False, vouched: Sequence[str] = ()) -> Membership:
    """Read and verify a store's devices.

    ``admin_key`` is the pinned administrator key; ``None`` trusts the key device 0 names
    (a first connect: the caller pins what it gets). ``store_uuid`` ``None`` takes the
    store of device 0. ``paths`` may come in any order; the result is in device order.
    ``seen`` is this machine's record (``SeenRecord.load``): path -> the newest verified
    superblock read there; it stands in for a rolled-back device and, with ``torn_ok``,
    for a torn one (see the module docstring). ``vouched`` paths (``repair --force``) are read
    from the record even when their blocks no longer name the device (a wiped superblock).

    Raises:
        DeviceMismatch: a device is unreadable, of another store, its copies all fail (torn,
            forged, other key) and no record stands in, devices disagree on the store's shape,
            one is missing or twice, or the membership is older than ``min_gen`` (replayed)
            and no record covers it.
    """
    found: dict[int, Superblock] = {}
    where: dict[int, str] = {}
    refused: list[str] = []
    torn: list[int] = []
    rolled: list[int] = []
    degraded: list[int] = []
    seen = dict(seen or {})
    if admin_key is not None:  # the record is trusted only as far as its signatures
        seen = {p: sb for p, sb in seen.items() if signed_by(sb, admin_key)
                and (store_uuid is None or sb.store_uuid == store_uuid)}
    for p in paths:
        blocks = read_blocks(p)
        copies = decode_copies(blocks)
        rec = seen.get(p)
        try:
            valid = valid_copies(p, copies)
            if store_uuid is None:
                store_uuid = max(valid, key=lambda s: s.generation).store_uuid
            mine = [c for c in valid if c.store_uuid == store_uuid]
            if not mine:
                other = valid[0]
                raise DeviceMismatch(f"device {p} belongs to store {other.store_name!r} "
                                     f"({other.store_uuid.hex()}), not this one: check the device list")
            if admin_key is None:  # first use: the key of the newest copy that verifies under its own key
                selfsigned = [c for c in mine if signed_by(c, c.admin_key)] or mine
                admin_key = max(selfsigned, key=lambda s: s.generation).admin_key
            key = admin_key
            good = []
            for c in mine:
                if rec is not None and c.device_index != rec.device_index:
                    # a validly signed block of another device written here (a copy, a replay):
                    # this path is device rec.device_index, as this machine has verified before
                    refused.append(f"device {p}: a superblock copy names device {c.device_index}, but this path is "
                                   f"device {rec.device_index} of the store: refused")
                elif signed_by(c, key):
                    good.append(c)
                else:
                    refused.append(f"device {p}: a superblock copy (generation {c.generation}) is not signed by "
                                   f"the store's administrator key {fingerprint(key)[:16]}...: refused")
            for bad in copies:
                if isinstance(bad, CorruptPage):
                    refused.append(f"device {p}: a superblock copy is unreadable ({bad})")
            if not good:
                raise DeviceMismatch(f"device {p}: no superblock copy is signed by the store's administrator key "
                                     f"{fingerprint(key)[:16]}... (a forged or foreign membership is refused)")
        except DeviceMismatch as e:
            # no copy verifies (torn or forged): this machine's record stands in where allowed,
            # if the blocks still name that device of the store (not another device at this path)
            uuid = rec.store_uuid if rec is not None else store_uuid
            named = raw_device_indexes(blocks, uuid) if uuid is not None else set()
            ours = bool(named) if rec is None else rec.device_index in named
            if rec is not None and torn_ok and p in vouched:
                ours = True  # the operator says this path is that device (repair --force)
            if not ours:
                raise
            if rec is None or not torn_ok:
                name = rec.store_name if rec is not None else "STORE"
                raise DeviceMismatch(f"{e}; the administrator's 'mass-ctl kvcache repair {name}' rewrites it from "
                                     "the last membership verified there") from None
            refused.append(f"device {p}: no superblock copy verifies ({e}); read from this machine's record "
                           "(the next allow/deny, or 'repair', rewrites it)")
            found[rec.device_index], where[rec.device_index] = rec, p
            torn.append(rec.device_index)
            continue
        sb = max(good, key=lambda s: s.generation)
        if len(good) < len(copies):  # one copy lost (torn, forged, another device's): a rewrite restores two
            degraded.append(sb.device_index)
        if rec is not None and rec.membership_gen > sb.membership_gen and _same_layout(rec, sb):
            refused.append(f"device {p}: its membership (generation {sb.membership_gen}) is older than the one "
                           f"this machine has seen there ({rec.membership_gen}): a replayed or restored superblock, "
                           "read as seen (the administrator's 'repair' rewrites it)")
            sb = rec
            rolled.append(sb.device_index)
        if sb.device_index in found:
            raise DeviceMismatch(f"device {p} is device {sb.device_index} of the store, like another path given")
        if device_size(p) < sb.device_size:
            raise DeviceMismatch(f"device {p} shrank: {device_size(p)} bytes, formatted with {sb.device_size}")
        found[sb.device_index] = sb
        where[sb.device_index] = p
    if not found:
        raise DeviceMismatch("no device given")
    first = next(iter(found.values()))
    missing = [i for i in range(first.device_count) if i not in found]
    if missing:
        raise DeviceMismatch(f"store {first.store_name!r} has {first.device_count} devices; device(s) "
                             f"{missing} not given (pass each with --device)")
    sbs = tuple(found[i] for i in range(first.device_count))
    for s in sbs:
        if (s.page_size, s.device_count, len(s.areas), s.salt) != \
                (first.page_size, first.device_count, len(first.areas), first.salt):
            raise DeviceMismatch(f"devices of store {first.store_name!r} disagree on page size, device or area "
                                 "count, or salt: were some formatted for another store of the same uuid?")
    gen = max(s.membership_gen for s in sbs)
    if gen < min_gen:
        raise DeviceMismatch(f"the devices' membership (generation {gen}) is older than one this machine has "
                             f"seen ({min_gen}): a replayed superblock is refused")
    lagging = tuple(s.device_index for s in sbs if s.membership_gen < gen)
    # devices at the newest generation that disagree on who owns what: two changes written at once
    # from two administrator machines; the membership in force is the lowest device's
    top = [x for x in sbs if x.membership_gen == gen]
    split = tuple(x.device_index for x in top if [_ident(a) for a in x.areas] != [_ident(a) for a in top[0].areas]
                  or (x.key_epoch, x.epochs) != (top[0].key_epoch, top[0].epochs))
    for i in split:
        refused.append(f"device {where[i]}: its membership of generation {gen} differs from device "
                       f"{top[0].device_index}'s: two changes were written at once; the membership in force is "
                       f"device {top[0].device_index}'s ('repair' writes it to every device)")
    return Membership(sbs, tuple(where[i] for i in range(len(sbs))), gen, lagging, tuple(refused),
                      tuple(sorted(torn)), tuple(sorted(rolled)), tuple(sorted(set(degraded))), split)


def _same_layout(a: Superblock, b: Superblock) -> bool:
    return (a.store_uuid, a.device_index, a.device_count, a.page_size, a.salt, a.device_size,
            [(x.offset, x.slot_count) for x in a.areas]) == \
        (b.store_uuid, b.device_index, b.device_count, b.page_size, b.salt, b.device_size,
         [(x.offset, x.slot_count) for x in b.areas])


def raw_device_indexes(blocks: list[bytes], store_uuid: bytes) -> set[int]:
    """The device indexes that a device's superblock blocks (``device.read_blocks``) name for
    store ``store_uuid``, read without checking checksums or signatures: what a torn device
    still says it is, telling it from another device at the same path."""
    return {struct.unpack_from("<I", b, 64)[0] for b in blocks
            if len(b) >= 68 and b[:8] == MAGIC and b[16:32] == store_uuid}


class SeenRecord:
    """This machine's record of the newest verified superblock of each device of one store
    (``MASS_HOME/stores/<store>.membership``): the device path and its 8192-byte block,
    one after another. Written atomically when a read finds something newer; read back
    only through ``read_membership``, which checks each block's checksum and signature."""

    HEAD = struct.Struct("<H")  # path length; the path (utf-8); then the block

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Superblock]:
        """Path -> superblock; empty when there is no record or it does not parse."""
        try:
            data = self.path.read_bytes()
        except OSError:
            return {}
        out: dict[str, Superblock] = {}
        off = 0
        try:
            while off < len(data):
                (n,) = self.HEAD.unpack_from(data, off)
                p = data[off + 2:off + 2 + n].decode()
                off += 2 + n
                out[p] = Superblock.decode(data[off:off + SUPERBLOCK_SIZE])
                off += SUPERBLOCK_SIZE
        except (struct.error, UnicodeDecodeError, CorruptPage):
            return {}
        return out

    def note(self, m: Membership, old: Mapping[str, Superblock] | None = None) -> None:
        """Record ``m``'s superblocks if any is newer than the record's (best effort: a reader
        without write access to MASS_HOME records nothing). ``old``: the record as the caller
        just loaded it for ``read_membership`` (read again when not given)."""
        old = self.load() if old is None else old
        if all(p in old and (old[p].store_uuid, old[p].admin_key) == (sb.store_uuid, sb.admin_key)
               and old[p].generation >= sb.generation and old[p].membership_gen >= sb.membership_gen
               for p, sb in zip(m.paths, m.sbs)):
            return  # nothing newer (a record of another store under this name is replaced)
        blob = b"".join(self.HEAD.pack(len(p.encode())) + p.encode() + sb.encode() for p, sb in zip(m.paths, m.sbs))
        tmp = self.path.with_suffix(f".membership.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()
            except OSError:
                pass


Epochs = tuple[int, tuple[tuple[str, int], ...]]


def change_membership(paths: Sequence[str], *, store_uuid: bytes, admin: AdminKey,
                      change: Callable[[list[Area]], list[Area]],
                      seen: Mapping[str, Superblock] | None = None, vouched: Sequence[str] = (),
                      rekey: Callable[[Epochs], Epochs] | None = None) -> Membership:
    """Apply ``change`` to the newest area table and write it, signed, to every device with
    the next ``membership_gen`` (lagging, torn and rolled-back devices are rewritten by the
    same write; ``seen`` is this machine's record, see ``read_membership``), then read it
    back: a change another administrator wrote at the same time is an error, never a
    silent loss.

    ``change`` gets and returns the list of areas with the newest membership's names,
    keys, addresses and flags; offsets and slot counts stay each device's own. The key
    epochs are the newest membership's on every device, after ``rekey`` when given.

    Raises:
        DeviceMismatch: as ``read_membership``, or the devices did not keep what was written.
        ValueError: ``change`` resized or moved an area.
    """
    cur = read_membership(paths, store_uuid=store_uuid, admin_key=admin.public, seen=seen, torn_ok=True,
                          vouched=vouched)
    gen = cur.gen + 1
    before = list(cur.newest.areas)
    after = change(list(before))
    if len(after) != len(before) or any((a.offset, a.slot_count) != (b.offset, b.slot_count)
                                        for a, b in zip(after, before)):
        raise ValueError("a membership change may not add, move or resize areas")
    after = [dataclasses.replace(a, changed_gen=gen) if _ident(a) != _ident(b) else a for a, b in zip(after, before)]
    key_epoch, epochs = (cur.newest.key_epoch, cur.newest.epochs)
    if rekey is not None:
        key_epoch, epochs = rekey((key_epoch, epochs))
    written = []
    for path, sb in zip(cur.paths, cur.sbs):
        areas = tuple(dataclasses.replace(mine, server=a.server, flags=a.flags, public_key=a.public_key, sync=a.sync,
                                          changed_gen=a.changed_gen) for mine, a in zip(sb.areas, after))
        new = admin.sign(dataclasses.replace(sb, generation=sb.generation + 1, membership_gen=gen, areas=areas,
                                             key_epoch=key_epoch, epochs=epochs))
        write_superblock(path, new)
        written.append(new)
    got = read_membership(paths, store_uuid=store_uuid, admin_key=admin.public, min_gen=gen)
    lost = [p for p, w, g in zip(cur.paths, written, got.sbs) if g.encode() != w.encode()]
    if lost:
        raise DeviceMismatch(f"another membership change was written at the same time (device(s) {', '.join(lost)} "
                             f"hold generation {max(g.membership_gen for g in got.sbs)}, not this one's): check with "
                             "'mass-ctl kvcache show' and run the change again")
    return got


def _ident(a: Area) -> tuple[str, int, bytes, str]:
    return a.server, a.flags, a.public_key, a.sync


__all__ = ["AdminKey", "Epochs", "Member", "Membership", "SeenRecord", "change_membership", "fingerprint",
           "raw_device_indexes", "read_membership", "signed_by"]
