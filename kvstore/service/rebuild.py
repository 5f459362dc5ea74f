"""Start-up rebuild: scan every slot header on every device and refill the slot tables.

Headers carry store, device, area, slot, generation, key and length, so the
devices alone say what they hold; the scan is what makes a restarted service
serve the pages it (and its peers) saved. Payload checksums are checked on
every later read, so a torn payload becomes a miss then.

How it reads: with small slots (<= 64 KiB) whole runs of slots in 4 MiB
O_DIRECT reads (fewer, larger I/Os: twice the bytes of headers alone at 4 KiB
pages, hundreds of times fewer requests); with larger slots only each slot's
4 KiB header block, up to ``depth`` reads in flight. Either way the headers of
a run are parsed at once with a strided numpy view (magic, version, store,
location, length), and only the candidates get their header checksum
computed one by one.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .._native.aio import OP_READ, AioContext, buffer_address
from .._native.lib import FFI
from ..shm.slots import VALID, SlotMap
from ..storage.header import FIELDS_SIZE, HEADER_BLOCK, HEADER_DTYPE, MAGIC
from ..storage.superblock import FORMAT_VERSION, Superblock


CONTIGUOUS_MAX_SLOT = 64 << 10
RUN_BYTES = 4 << 20


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


class _Reader:
    """Batched O_DIRECT reads into one aligned buffer."""

    def __init__(self, path: str, size: int, depth: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        self.ctx = AioContext(depth, path)
        self.buf = mmap.mmap(-1, size)
        self.base = buffer_address(self.buf)
        self.depth = depth

    def read(self, reqs: list[tuple[int, int, int]]) -> list[int]:
        """``(buffer offset, length, device offset)`` each; returns the byte counts in order."""
        out = [0] * len(reqs)
        for s in range(0, len(reqs), self.depth):
            chunk = reqs[s:s + self.depth]
            sub = [(OP_READ, self.fd, self.base + b, n, off, s + i) for i, (b, n, off) in enumerate(chunk)]
            done = 0
            while done < len(sub):
                done += self.ctx.submit(sub[done:])
            got = 0
            while got < len(sub):
                for c in self.ctx.getevents(1, self.depth, 5.0):
                    out[c.tag] = c.result
                    got += 1
        return out

    def close(self) -> None:
        self.ctx.close()
        os.close(self.fd)
        FFI.release(self.base)
        self.buf.close()


def _parse(view: np.ndarray[Any, Any], mv: memoryview, offs: np.ndarray[Any, Any], ok: np.ndarray[Any, Any],
           sb: Superblock, d: int, a: int, first_slot: int) -> tuple[np.ndarray[Any, Any], int]:
    """Indices (in the run) of valid headers, and the run's highest generation of this store."""
    u0, u1 = np.frombuffer(sb.store_uuid, dtype="<u8")
    cand = ok & (view["magic"] == MAGIC) & (view["version"] == FORMAT_VERSION) \
        & (view["u0"] == u0) & (view["u1"] == u1)
    idx = np.nonzero(cand)[0]
    good = [i for i in idx.tolist()
            if xxhash.xxh3_64_intdigest(mv[offs[i]:offs[i] + FIELDS_SIZE]) == int(view["hcsum"][i])]
    g = np.array(good, dtype=np.int64)
    if not len(g):
        return g, 0
    max_gen = int(view["gen"][g].max())
    here = (view["device"][g] == d) & (view["area"][g] == a) \
        & (view["slot"][g] == first_slot + g) & (view["length"][g] <= sb.page_size)
    return g[here], max_gen


def scan_devices(paths: Sequence[str], sbs: Sequence[Superblock], smap: SlotMap,
                 slots: Any, depth: int = 128) -> RebuildReport:
    """Read all slot headers and write VALID entries into ``slots`` (the caller indexes them)."""
    t0 = time.monotonic()
    scanned = valid = 0
    max_gen = [[0] * smap.n_areas for _ in paths]
    for d, (path, sb) in enumerate(zip(paths, sbs)):
        contiguous = sb.slot_size <= CONTIGUOUS_MAX_SLOT
        per_run = max(1, RUN_BYTES // sb.slot_size) if contiguous else depth * 8
        stride = sb.slot_size if contiguous else HEADER_BLOCK
        reader = _Reader(path, per_run * stride, depth)
        mv = memoryview(reader.buf)
        try:
            for a, area in enumerate(sb.areas):
                for s0 in range(0, area.slot_count, per_run):
                    k = min(per_run, area.slot_count - s0)
                    off0 = area.offset + s0 * sb.slot_size
                    if contiguous:
                        total = k * sb.slot_size
                        reqs = [(b, min(RUN_BYTES, total - b), off0 + b) for b in range(0, total, RUN_BYTES)]
                        res = reader.read(reqs)
                        got = sum(max(0, r) for r in res)
                        ok = (np.arange(k) * stride + FIELDS_SIZE + 8) <= got
                    else:
                        res = reader.read([(i * HEADER_BLOCK, HEADER_BLOCK, off0 + i * sb.slot_size)
                                           for i in range(k)])
                        ok = np.array([r == HEADER_BLOCK for r in res], dtype=bool)
                    view = np.ndarray((k,), dtype=HEADER_DTYPE, buffer=reader.buf, offset=0, strides=(stride,))
                    offs = np.arange(k, dtype=np.int64) * stride
                    good, mg = _parse(view, mv, offs, ok, sb, d, a, s0)
                    scanned += k
                    max_gen[d][a] = max(max_gen[d][a], mg)
                    if len(good):
                        gids = smap.bases[d][a] + s0 + good
                        for f in ("gen", "d0", "d1", "d2", "d3"):
                            slots[f][gids] = view[f][good]
                        slots["length"][gids] = view["length"][good].astype(np.uint32)
                        slots["state"][gids] = VALID
                        valid += len(good)
                    del view
        finally:
            mv.release()
            reader.close()
    return RebuildReport(scanned, valid, tuple(tuple(r) for r in max_gen), time.monotonic() - t0)
