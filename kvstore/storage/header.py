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

import xxhash

from .superblock import FORMAT_VERSION

MAGIC = b"KVSTSLOT"
HEADER_BLOCK = 4096
FIELDS_FMT = "<8sII16sIIQQ32sQQQ8x"
FIELDS_SIZE = struct.calcsize(FIELDS_FMT)  # 120
HEADER_FMT = FIELDS_FMT + "Q"
HEADER_SIZE = struct.calcsize(HEADER_FMT)  # 128


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
