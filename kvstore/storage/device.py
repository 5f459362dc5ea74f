"""Devices: size, format (write superblocks), open and verify against a store.

A device is a path: an NVMe namespace, a loop device, or a plain file. All
on-device I/O here uses O_DIRECT with 4 KiB-aligned anonymous-mmap buffers, the
same way the I/O workers do, so what we read is what the device holds and
never a stale page-cache copy.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import stat
from collections.abc import Callable, Sequence

from ..errors import CorruptPage, DeviceMismatch
from .superblock import COPY_OFFSETS, SUPERBLOCK_SIZE, Area, Superblock, plan_areas


def device_size(path: str) -> int:
    """Size in bytes of a block device or plain file.

    Raises:
        DeviceMismatch: the path does not exist or is neither a file nor a block device.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DeviceMismatch(f"device {path} does not exist") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise DeviceMismatch(f"device {path} is neither a block device nor a regular file")
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def open_direct(path: str, writable: bool) -> int:
    """Open ``path`` with O_DIRECT; raises ``DeviceMismatch`` with the reason if that fails."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_DIRECT | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        raise DeviceMismatch(f"device {path} does not exist") from None
    except OSError as e:
        raise DeviceMismatch(f"cannot open {path} with O_DIRECT: {e.strerror}") from None


def read_blocks(path: str) -> list[bytes]:
    """The raw 8192-byte blocks at each superblock copy's offset (shorter at the end of a tiny
    file), unchecked: ``decode_copies`` validates them, ``membership.raw_device_indexes`` reads
    what a torn one still names.

    Raises:
        DeviceMismatch: the device cannot be opened with O_DIRECT.
    """
    fd = open_direct(path, writable=False)
    buf = mmap.mmap(-1, SUPERBLOCK_SIZE)
    try:
        return [bytes(buf[:os.preadv(fd, [buf], off)]) for off in COPY_OFFSETS]
    finally:
        buf.close()
        os.close(fd)


def decode_copies(blocks: list[bytes]) -> list[Superblock | CorruptPage]:
    """Each block decoded, or why it is not a valid superblock."""
    out: list[Superblock | CorruptPage] = []
    for b in blocks:
        try:
            out.append(Superblock.decode(b))
        except CorruptPage as e:
            out.append(e)
    return out


def read_copies(path: str) -> list[Superblock | CorruptPage]:
    """Both superblock copies of a device, decoded, or why each is not valid.

    Raises:
        DeviceMismatch: the device cannot be opened with O_DIRECT.
    """
    return decode_copies(read_blocks(path))


def valid_copies(path: str, copies: list[Superblock | CorruptPage]) -> list[Superblock]:
    """The valid copies among ``copies`` of ``path``; raises ``DeviceMismatch`` if there is none."""
    valid = [c for c in copies if isinstance(c, Superblock)]
    if not valid:
        raise DeviceMismatch(f"device {path} is not formatted for kvstore ({copies[0]})")
    return valid


def read_superblock(path: str) -> Superblock:
    """Read a device's superblock: the valid copy with the highest generation. Its signature
    is not checked here (storage/membership.py does, against the key a machine trusts).

    Raises:
        DeviceMismatch: neither copy is a valid kvstore superblock.
    """
    return max(valid_copies(path, read_copies(path)), key=lambda s: s.generation)


def write_superblock(path: str, sb: Superblock) -> None:
    """Write both copies of ``sb``, syncing between them (see superblock.py for why)."""
    data = sb.encode()
    buf = mmap.mmap(-1, SUPERBLOCK_SIZE)
    buf[:] = data
    fd = open_direct(path, writable=True)
    try:
        for off in COPY_OFFSETS:
            if os.pwritev(fd, [buf], off) != SUPERBLOCK_SIZE:
                raise OSError(f"short superblock write on {path}")
            os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def format_device(path: str, *, store_uuid: bytes, store_name: str, page_size: int,
                  device_index: int, device_count: int, servers: Sequence[Area],
                  salt: bytes, sign: Callable[[Superblock], Superblock], membership_gen: int = 1,
                  force: bool = False, areas: int | None = None, area_slots: int | None = None) -> Superblock:
    """Format one device of a store: plan its areas, name the first ones after ``servers``
    (their name, sync address and public key; offsets are planned here), sign with ``sign``
    (the administrator's key) and write the superblock.

    Slot headers are not cleared: each carries the store UUID, device, area and
    slot, so leftovers of another store (or an earlier format) never validate.

    Raises:
        DeviceMismatch: the device holds another store's superblock and ``force`` is false.
        ValueError: the device is too small for the areas (see ``plan_areas``).
    """
    size = device_size(path)
    copies = read_copies(path)
    old = max((c for c in copies if isinstance(c, Superblock)), key=lambda c: c.generation, default=None)
    if not force:
        if old is not None:
            raise DeviceMismatch(
                f"device {path} already belongs to store {old.store_name!r} "
                f"(uuid {old.store_uuid.hex()}); pass --force to reformat it and lose its pages")
        if any("format version" in str(c) for c in copies):
            raise DeviceMismatch(f"device {path} holds a store of another format version ({copies[0]}); "
                                 "pass --force to reformat it and lose its pages")
    layout = plan_areas(size, page_size, [s.server for s in servers], areas, area_slots)
    layout = tuple(dataclasses.replace(a, public_key=m.public_key, sync=m.sync, flags=m.flags,
                                       changed_gen=membership_gen) for a, m in zip(layout, servers)) \
        + layout[len(servers):]
    sb = sign(Superblock(store_uuid=store_uuid, store_name=store_name,
                         generation=(old.generation + 1) if old else 1, page_size=page_size, device_size=size,
                         device_index=device_index, device_count=device_count, areas=layout,
                         membership_gen=membership_gen, salt=salt))
    write_superblock(path, sb)
    return sb


__all__ = ["Area", "decode_copies", "device_size", "format_device", "open_direct", "read_blocks", "read_copies",
           "read_superblock", "valid_copies", "write_superblock"]
