"""Start-up rebuild: scan every slot header on every device and refill the slot tables.

Headers carry store, device, area, slot, generation, key and length, so the
devices alone say what they hold; the scan is what makes a restarted service
serve the pages it (and its peers) saved. Only the 4 KiB header block of each
slot is read (libaio, O_DIRECT, ``depth`` at a time); payload checksums are
checked on every later read, so a torn payload becomes a miss then.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..ioworkers.aio import FFI, OP_READ, AioContext, buffer_address
from ..shm.slots import VALID, SlotMap
from ..storage.header import HEADER_BLOCK, SlotHeader
from ..storage.superblock import Superblock


@dataclass(frozen=True)
class RebuildReport:
    """What the scan found."""

    scanned: int
    """Slot headers read."""
    valid: int
    """Headers that belong to this store and slot."""
    max_gen: tuple[tuple[int, ...], ...]
    """Highest generation seen per (device, area), including headers later superseded."""
    seconds: float
    """Wall time of the scan."""


def scan_devices(paths: Sequence[str], sbs: Sequence[Superblock], smap: SlotMap,
                 slots: Any, depth: int = 64) -> RebuildReport:
    """Read all slot headers and write VALID entries into ``slots`` (the caller indexes them)."""
    t0 = time.monotonic()
    scanned = valid = 0
    max_gen = [[0] * smap.n_areas for _ in paths]
    bufs = mmap.mmap(-1, depth * HEADER_BLOCK)
    mv = memoryview(bufs)
    base = buffer_address(bufs)
    try:
        for d, (path, sb) in enumerate(zip(paths, sbs)):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            ctx = AioContext(depth, path)
            try:
                todo = [(a, s, area.offset + s * sb.slot_size)
                        for a, area in enumerate(sb.areas) for s in range(area.slot_count)]
                for start in range(0, len(todo), depth):
                    chunk = todo[start:start + depth]
                    reqs = [(OP_READ, fd, base + i * HEADER_BLOCK, HEADER_BLOCK, off, i)
                            for i, (_a, _s, off) in enumerate(chunk)]
                    n = 0
                    while n < len(reqs):
                        n += ctx.submit(reqs[n:])
                    got = 0
                    while got < len(chunk):
                        for c in ctx.getevents(1, depth, 5.0):
                            got += 1
                            if c.result != HEADER_BLOCK:
                                continue
                            a, s, _off = chunk[c.tag]
                            h = SlotHeader.decode(mv[c.tag * HEADER_BLOCK:(c.tag + 1) * HEADER_BLOCK])
                            scanned += 1
                            if h is None or h.store_uuid != sb.store_uuid:
                                continue
                            max_gen[d][a] = max(max_gen[d][a], h.generation)
                            if (h.device_index, h.area_index, h.slot_index) != (d, a, s) \
                                    or h.payload_length > sb.page_size:
                                continue
                            gid = smap.gid(d, a, s)
                            e = slots[gid]
                            e["gen"] = h.generation
                            w = h.key_digest
                            e["d0"] = int.from_bytes(w[0:8], "little")
                            e["d1"] = int.from_bytes(w[8:16], "little")
                            e["d2"] = int.from_bytes(w[16:24], "little")
                            e["d3"] = int.from_bytes(w[24:32], "little")
                            e["length"] = h.payload_length
                            e["state"] = VALID
                            valid += 1
            finally:
                ctx.close()
                os.close(fd)
    finally:
        mv.release()
        FFI.release(base)
        bufs.close()
    return RebuildReport(scanned, valid, tuple(tuple(r) for r in max_gen), time.monotonic() - t0)
