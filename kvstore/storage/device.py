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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import CorruptPage, DeviceMismatch
from .superblock import (AREA_DENIED, COPY_OFFSETS, SUPERBLOCK_SIZE, Area, Superblock, plan_areas)

if TYPE_CHECKING:
    from ..config import StoreConfig


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


def _read_copies(fd: int) -> list[Superblock | CorruptPage]:
    buf = mmap.mmap(-1, SUPERBLOCK_SIZE)
    out: list[Superblock | CorruptPage] = []
    try:
        for off in COPY_OFFSETS:
            n = os.preadv(fd, [buf], off)
            try:
                out.append(Superblock.decode(memoryview(buf)[:n]))
            except CorruptPage as e:
                out.append(e)
    finally:
        buf.close()
    return out


def read_superblock(path: str) -> Superblock:
    """Read a device's superblock: the valid copy with the highest generation.

    Raises:
        DeviceMismatch: neither copy is a valid kvstore superblock.
    """
    fd = open_direct(path, writable=False)
    try:
        copies = _read_copies(fd)
    finally:
        os.close(fd)
    valid = [c for c in copies if isinstance(c, Superblock)]
    if not valid:
        raise DeviceMismatch(f"device {path} is not formatted for kvstore ({copies[0]})")
    return max(valid, key=lambda s: s.generation)


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
                  device_index: int, device_count: int, servers: Sequence[str],
                  force: bool = False, areas: int | None = None, area_slots: int | None = None) -> Superblock:
    """Format one device of a store: plan its areas and write the superblock.

    Slot headers are not cleared: each carries the store UUID, device, area and
    slot, so leftovers of another store (or an earlier format) never validate.

    Raises:
        DeviceMismatch: the device holds another store's superblock and ``force`` is false.
        ValueError: the device is too small for the areas (see ``plan_areas``).
    """
    size = device_size(path)
    try:
        old = read_superblock(path)
    except DeviceMismatch:
        old = None
    if old is not None and not force:
        raise DeviceMismatch(
            f"device {path} already belongs to store {old.store_name!r} "
            f"(uuid {old.store_uuid.hex()}); pass --force to reformat it and lose its pages"
        )
    layout = plan_areas(size, page_size, list(servers), areas, area_slots)
    sb = Superblock(store_uuid=store_uuid, store_name=store_name, generation=(old.generation + 1) if old else 1,
                    page_size=page_size, device_size=size, device_index=device_index,
                    device_count=device_count, areas=layout)
    write_superblock(path, sb)
    return sb


def verify_device(path: str, *, store_uuid: bytes, page_size: int, device_index: int,
                  device_count: int, servers: Sequence[str], denied: Sequence[str] = ()) -> Superblock:
    """Open a store's device and check that its superblock matches the store config:
    areas named after ``servers`` in order (then spare ones), ``denied`` flagged so.

    Raises:
        DeviceMismatch: with what differs and what to do.
    """
    sb = read_superblock(path)
    if sb.store_uuid != store_uuid:
        raise DeviceMismatch(
            f"device {path} belongs to store {sb.store_name!r} ({sb.store_uuid.hex()}), "
            "not this one: check the device list in the store config")
    if sb.device_index != device_index or sb.device_count != device_count:
        raise DeviceMismatch(
            f"device {path} is device {sb.device_index} of {sb.device_count} in its superblock, "
            f"but the config lists it as {device_index} of {device_count}: devices out of order?")
    if sb.page_size != page_size:
        raise DeviceMismatch(f"device {path} has page size {sb.page_size}, config says {page_size}")
    names = [a.server for a in sb.areas]
    want = list(servers) + [""] * (len(names) - len(servers))
    if names != want:
        raise DeviceMismatch(f"device {path} has areas for {[n for n in names if n]}, config lists servers "
                             f"{list(servers)}: is this host's copy of the store config current?")
    flagged = sorted(a.server for a in sb.areas if a.denied)
    if flagged != sorted(denied):
        raise DeviceMismatch(f"device {path} marks {flagged or 'no server'} denied, config says "
                             f"{sorted(denied) or 'none'}: is this host's copy of the store config current?")
    size = device_size(path)
    if size < sb.device_size:
        raise DeviceMismatch(f"device {path} shrank: {size} bytes, formatted with {sb.device_size}")
    return sb


def verify_store(cfg: StoreConfig) -> list[Superblock]:
    """``verify_device`` for every device of ``cfg``: their superblocks, in device order."""
    return [verify_device(p, store_uuid=cfg.uuid_bytes, page_size=cfg.page_size, device_index=i,
                          device_count=len(cfg.devices), servers=[s.name for s in cfg.servers], denied=cfg.denied)
            for i, p in enumerate(cfg.devices)]


def set_area(path: str, *, store_uuid: bytes, index: int, server: str, denied: bool) -> Superblock:
    """Rewrite one area entry (``allow``: name a spare area; ``deny``: flag it) with the next generation.

    Raises:
        DeviceMismatch: the device is not this store's, or has no area ``index``.
    """
    sb = read_superblock(path)
    if sb.store_uuid != store_uuid:
        raise DeviceMismatch(f"device {path} belongs to store {sb.store_name!r}, not this one")
    if not 0 <= index < len(sb.areas):
        raise DeviceMismatch(f"device {path} has {len(sb.areas)} areas, no area {index}")
    areas = list(sb.areas)
    areas[index] = dataclasses.replace(areas[index], server=server, flags=AREA_DENIED if denied else 0)
    new = dataclasses.replace(sb, generation=sb.generation + 1, areas=tuple(areas))
    write_superblock(path, new)
    return new


__all__ = ["Area", "device_size", "format_device", "open_direct", "read_superblock", "set_area",
           "verify_device", "verify_store", "write_superblock"]
