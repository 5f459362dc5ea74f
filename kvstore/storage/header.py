"""The slot header: the first 4 KiB block of every slot, written with the payload in one I/O.

Layout (little-endian; fields in the first 128 bytes, the rest of the block zero;
docs/FORMAT.md "Slot header")::

    off  size  field
      0     8  magic             b"KVSTSLOT"
      8     4  version           u32, FORMAT_VERSION
     12     4  flags             u32, reserved (0)
     16    16  store_uuid        16 raw bytes
     32     4  device_index      u32
     36     4  area_index        u32
     40     8  slot_index        u64
     48     8  generation        u64, strictly increasing per slot
     56    32  key_digest        BLAKE2b-256 of the salted key
     88     8  payload_length    u64, <= page_size
     96     8  payload_checksum  xxh3_64 of payload[:payload_length]
    104     8  written_ns        u64, CLOCK_REALTIME ns at write (diagnostics only)
    112     8  reserved          zero
    120     8  header_checksum   xxh3_64 of bytes [0, 120)

A reader accepts a slot only if the header checksum holds, store, device,
area, slot, generation and digest are the ones it expected, and the payload
checksum matches: a torn, stale or overwritten slot is then a miss, never
wrong bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from .._native.lib import const
from .superblock import FORMAT_VERSION

MAGIC = b"KVSTSLOT"
HEADER_BLOCK = const("KV_HEADER_BLOCK")

#: The slot header's fields in order, declared once: (name in kvstore.h's ``struct
#: kv_slot_header``, ``struct`` format, numpy fields of the start-up scan's view). ``FIELDS_FMT``
#: and ``HEADER_DTYPE`` derive from it; tests/native/test_layout.py checks it against the C
#: struct (what the I/O worker writes and validates) and against docs/FORMAT.md's table.
HEADER_FIELDS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("magic", "8s", (("magic", "S8"),)),
    ("version", "I", (("version", "<u4"),)),
    ("flags", "I", (("flags", "<u4"),)),
    ("store_uuid", "16s", (("u0", "<u8"), ("u1", "<u8"))),
    ("device", "I", (("device", "<u4"),)),
    ("area", "I", (("area", "<u4"),)),
    ("slot", "Q", (("slot", "<u8"),)),
    ("gen", "Q", (("gen", "<u8"),)),
    ("d", "32s", (("d0", "<u8"), ("d1", "<u8"), ("d2", "<u8"), ("d3", "<u8"))),
    ("length", "Q", (("length", "<u8"),)),
    ("csum", "Q", (("csum", "<u8"),)),
    ("written_ns", "Q", (("wns", "<u8"),)),
    ("reserved", "8x", (("res", "<u8"),)),
    ("hcsum", "Q", (("hcsum", "<u8"),)),
)
FIELDS_FMT = "<" + "".join(f for _n, f, _d in HEADER_FIELDS[:-1])  # what the header checksum covers
FIELDS_SIZE = struct.calcsize(FIELDS_FMT)  # 120
HEADER_FMT = FIELDS_FMT + "Q"
HEADER_SIZE = struct.calcsize(HEADER_FMT)  # 128
#: the header as a numpy record: how the start-up scan reads many at once (service/rebuild.py)
HEADER_DTYPE = np.dtype([sub for _n, _f, subs in HEADER_FIELDS for sub in subs])
assert FIELDS_SIZE == const("KV_FIELDS_SIZE") and HEADER_DTYPE.itemsize == HEADER_SIZE == 128


@dataclass(frozen=True)
class SlotHeader:
    """Decoded slot header."""

    store_uuid: bytes
    device_index: int
    area_index: int
    slot_index: int
    generation: int
    key_digest: bytes
    payload_length: int
    payload_checksum: int
    written_ns: int = 0

    def encode(self) -> bytes:
        """The 128 meaningful bytes of the header block, header checksum included."""
        head = struct.pack(
            FIELDS_FMT, MAGIC, FORMAT_VERSION, 0, self.store_uuid, self.device_index,
            self.area_index, self.slot_index, self.generation, self.key_digest,
            self.payload_length, self.payload_checksum, self.written_ns,
        )
        return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> SlotHeader | None:
        """Parse a header block; ``None`` if it is empty, torn, or not a slot header."""
        raw = bytes(data[:HEADER_SIZE])
        if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
            return None
        (stored,) = struct.unpack_from("<Q", raw, FIELDS_SIZE)
        if stored != xxhash.xxh3_64_intdigest(raw[:FIELDS_SIZE]):
            return None
        (_m, version, _flags, uuid, dev, area, slot, gen, digest, length, csum, wns) = \
            struct.unpack_from(FIELDS_FMT, raw, 0)
        if version != FORMAT_VERSION:
            return None
        return cls(uuid, dev, area, slot, gen, digest, length, csum, wns)


def payload_checksum(payload: bytes | memoryview) -> int:
    """xxh3_64 of a payload (the checksum stored in the header)."""
    return xxhash.xxh3_64_intdigest(payload)
