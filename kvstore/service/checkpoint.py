"""Slot-table checkpoints: a restart that does not read every slot header.

A service writes its whole slot table (every area, as it knows them) to
``$MASS_HOME/stores/<store>.<server>.slots`` every ``service.checkpoint_interval_s``
and at a clean shutdown. A starting service loads it instead of scanning the
devices when it names the same store and the same layout (devices, areas, slot
counts and sizes) and its checksums hold; otherwise it scans, as before.

Trusted only as far as every read's validation allows, which is all the way: a
slot written, retired or rewritten since the checkpoint is either a location
whose header no longer matches (its read fails validation: a miss, and the
location is dropped) or a page this server does not know of (a miss; its slot
may be reused, which only costs that page). Generations stay increasing because
new ones also follow the wall clock (``allocator.Generations``). Peers' areas
catch up through the sync agent's anti-entropy, as after any restart.

Format (docs/FORMAT.md "Slot-table checkpoint"): a 128-byte head, then the
slot table's entries exactly as in shared memory (48 bytes each, ``SLOT_DTYPE``).
The periodic writer runs in a thread over the live table: a fuzzy snapshot,
fine for the same reason. It writes a temporary file and renames it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..shm.slots import EMPTY, VALID, SlotMap
from ..storage.superblock import Superblock

MAGIC = b"KVSCKPT1"
VERSION = 1
HEAD_BYTES = 128
CHUNK = 4 << 20  # written and checksummed 4 MiB at a time (the writer thread holds the GIL only that long)

#: the head (then zero up to HEAD_BYTES)
HEAD_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("flags", "<u4"), ("uuid", "S16"),
    ("layout", "<u8"),       # xxh3_64 of the layout (see ``layout_fingerprint``)
    ("slots", "<u8"),        # entries that follow
    ("written_ns", "<u8"),   # wall clock at the start of the write
    ("body_csum", "<u8"),    # xxh3_64 of the entries
    ("head_csum", "<u8"),    # xxh3_64 of the bytes before this field
])
assert HEAD_DTYPE.itemsize == 72


def checkpoint_path(home: Path, store: str, server: str) -> Path:
    """Where the service of ``store`` as ``server`` keeps its checkpoint."""
    return home / "stores" / f"{store}.{server}.slots"


def layout_fingerprint(sbs: Sequence[Superblock]) -> int:
    """A digest of everything that places a slot table entry on the devices."""
    h = xxhash.xxh3_64()
    for sb in sbs:
        h.update(np.array([sb.slot_size, sb.page_size, len(sb.areas)], dtype="<u8").tobytes())
        for a in sb.areas:
            h.update(np.array([a.offset, a.slot_count], dtype="<u8").tobytes())
    return int(h.intdigest())


@dataclass(frozen=True)
class LoadReport:
    """What a loaded checkpoint held."""

    valid: int
    """Entries taken as VALID."""
    max_gen: tuple[tuple[int, ...], ...]
    """Highest generation per (device, area)."""
    age_s: float
    """How old the checkpoint is (by the wall clock)."""
    seconds: float
    """Time to read and check it."""


def _head(uuid: bytes, layout: int, n: int, written_ns: int, body_csum: int) -> bytes:
    h = np.zeros((), dtype=HEAD_DTYPE)
    h["magic"], h["version"], h["uuid"], h["layout"], h["slots"] = MAGIC, VERSION, uuid, layout, n
    h["written_ns"], h["body_csum"] = written_ns, body_csum
    raw = bytearray(h.tobytes())
    raw[64:72] = xxhash.xxh3_64_intdigest(bytes(raw[:64])).to_bytes(8, "little")
    return bytes(raw) + bytes(HEAD_BYTES - HEAD_DTYPE.itemsize)


def write_checkpoint(path: Path, slots: np.ndarray[Any, Any], uuid: bytes, layout: int) -> int:
    """Write ``slots`` (a live table may change meanwhile: each chunk is copied once, then both
    checksummed and written) to ``path`` atomically; returns the bytes written."""
    t_ns = time.time_ns()
    raw = slots.view(np.uint8).reshape(-1)
    tmp = path.with_name(path.name + ".tmp")
    h = xxhash.xxh3_64()
    with open(tmp, "wb") as f:
        f.write(bytes(HEAD_BYTES))
        for o in range(0, len(raw), CHUNK):
            part = raw[o:o + CHUNK].tobytes()
            h.update(part)
            f.write(part)
        f.seek(0)
        f.write(_head(uuid, layout, len(slots), t_ns, int(h.intdigest())))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return HEAD_BYTES + len(raw)


def load_checkpoint(path: Path, slots: np.ndarray[Any, Any], uuid: bytes, layout: int,
                    smap: SlotMap) -> tuple[LoadReport | None, str]:
    """Fill ``slots`` from the checkpoint at ``path``: the report, or None and why not (then
    ``slots`` is all zero again and the caller scans the devices)."""
    t0 = time.monotonic()
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None, "no checkpoint"
    except OSError as e:
        return None, f"checkpoint unreadable: {e}"
    with f:
        head = f.read(HEAD_BYTES)
        if len(head) < HEAD_BYTES:
            return None, "checkpoint truncated"
        h = np.frombuffer(head, dtype=HEAD_DTYPE, count=1)[0]
        if bytes(h["magic"]) != MAGIC or int(h["version"]) != VERSION:
            return None, "not a checkpoint of this version"
        if xxhash.xxh3_64_intdigest(head[:64]) != int(h["head_csum"]):
            return None, "checkpoint head checksum mismatch"
        if bytes(h["uuid"]) != uuid or int(h["layout"]) != layout or int(h["slots"]) != len(slots):
            return None, "checkpoint of another store or layout"
        raw = slots.view(np.uint8).reshape(-1)
        got = f.readinto(memoryview(raw))  # type: ignore[arg-type]
    if got != len(raw) or xxhash.xxh3_64_intdigest(memoryview(raw)) != int(h["body_csum"]):  # type: ignore[arg-type]
        slots.view(np.uint8)[:] = 0
        return None, "checkpoint body truncated or corrupt"
    st = slots["state"]
    st[st != VALID] = EMPTY  # a write or retirement under way when it was taken is not trusted
    valid = int(np.count_nonzero(st == VALID))
    gen = slots["gen"]
    max_gen = tuple(tuple(int(gen[r.start:r.stop].max()) if len(r) else 0
                          for r in (smap.area_gids(d, a) for a in range(smap.n_areas)))
                    for d in range(smap.n_devices))
    return LoadReport(valid, max_gen, max(0.0, (time.time_ns() - int(h["written_ns"])) / 1e9),
                      time.monotonic() - t0), ""


class CheckpointWriter:
    """Writes checkpoints in a thread, one at a time, so that the service loop never waits for one."""

    def __init__(self, path: Path, slots: np.ndarray[Any, Any], uuid: bytes, layout: int) -> None:
        self.path, self.slots, self.uuid, self.layout = path, slots, uuid, layout
        self._thread: threading.Thread | None = None
        self.written = 0
        self.last_error = ""
        self.last_seconds = 0.0

    @property
    def busy(self) -> bool:
        """A write is under way."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Begin a write in the background unless one is under way; whether one began."""
        if self.busy:
            return False
        self._thread = threading.Thread(target=self.write, name="kvstore-checkpoint", daemon=True)
        self._thread.start()
        return True

    def write(self) -> None:
        """Write one now, in this thread (at shutdown, once the table no longer changes)."""
        t0 = time.monotonic()
        try:
            write_checkpoint(self.path, self.slots, self.uuid, self.layout)
            self.written += 1
            self.last_error = ""
        except OSError as e:
            self.last_error = str(e)
        self.last_seconds = time.monotonic() - t0

    def join(self, timeout: float) -> None:
        """Wait for a background write to end (at shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)
