"""The page-buffer arena: 4 KiB-aligned buffers that clients, supervisor and workers share.

Layout of the arena segment (``n`` buffers of ``4096 + page_size`` bytes, then their states)::

    buffer i at offset i * (4096 + page_size):
        [0, 4096)                 slot header block (written by the I/O worker)
        [4096, 4096 + page_size)  page payload (written by the client for a put,
                                  by the device for a get)
    states at n * (4096 + page_size): n x u32, rounded up to 64 bytes

One buffer is exactly one slot's bytes on the device, so a put or a get is a
single O_DIRECT I/O straight between the device and this memory: no copy.

Ownership: a state array of u32 per buffer (in the control segment) says who
may touch the buffer; only the current owner writes the next state:

    FREE -> CLIENT   client allocates it            (client)
    CLIENT -> SERVICE client hands it over in a request (client)
    SERVICE -> CLIENT service answers the request    (service)
    SERVICE -> FREE   service is done with a put's buffer (service)
    SERVICE -> QUARANTINE  an I/O into it is stuck; the worker is being killed (service)
    QUARANTINE -> FREE     the stuck worker is gone, no more DMA can land there (service)
    CLIENT -> FREE   client releases it              (client)
    CLIENT -> DIRECT|g  client posts a direct read into it to a device worker (client)
    DIRECT|g -> READING|g  the worker takes it (compare-and-swap)             (worker)
    DIRECT|g -> CLIENT     the client takes it back before the worker did (CAS) (client)
    DIRECT|g -> FREE       the connection is gone; taken back (CAS)          (service)
    READING|g -> CLIENT    the read is done, its result published            (worker)
    READING|g -> CLIENT    the worker died; its reads are failed             (service)

``g`` is the low 24 bits of the connection's generation, in bits 8..31 (``tagged``): a
worker holding a stale record of a connection that has gone can never take a buffer of
the connection that now leases it.

The state is written with store-release and read with load-acquire, so the
new owner sees the buffer's bytes as the old owner left them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ioworkers.aio import FFI, LIB

BLOCK = 4096

FREE = 0
CLIENT = 1
SERVICE = 2
QUARANTINE = 3
DIRECT = 4
READING = 5


def tagged(state: int, generation: int) -> int:
    """``state`` (DIRECT or READING) tagged with a connection generation."""
    return state | (generation & 0xFFFFFF) << 8


def kind(state: int) -> int:
    """The state without its connection tag."""
    return state & 0xFF


def buffer_size(page_size: int) -> int:
    """Bytes per arena buffer: a header block plus the page."""
    return BLOCK + page_size


class Arena:
    """Views over the arena segment and its state array.

    Invariant: buffer ``i`` starts at a 4096-byte aligned address (the mapping is
    page aligned and the buffer size a multiple of 4096).
    """

    def __init__(self, data: Any, states: Any, states_offset: int, count: int, page_size: int) -> None:
        self.count = count
        self.page_size = page_size
        self.bsize = buffer_size(page_size)
        if len(data) < count * self.bsize:
            raise ValueError("arena segment smaller than count * buffer size")
        self._data = data
        self.base = FFI.from_buffer(data)
        sbase = FFI.from_buffer(states)
        self._states = FFI.cast("uint32_t *", sbase + states_offset)
        self._skeep = sbase
        self.mv = memoryview(data)

    @staticmethod
    def states_nbytes(count: int) -> int:
        """Bytes of the state array for ``count`` buffers (rounded to 64)."""
        return (count * 4 + 63) // 64 * 64

    @staticmethod
    def states_offset(count: int, page_size: int) -> int:
        """Offset of the state array in the arena segment."""
        return count * buffer_size(page_size)

    @staticmethod
    def nbytes(count: int, page_size: int) -> int:
        """Size of an arena segment of ``count`` buffers of ``page_size`` pages, states included."""
        return count * buffer_size(page_size) + Arena.states_nbytes(count)

    def address(self, i: int) -> Any:
        """``char *`` to buffer ``i`` (header block first)."""
        return self.base + i * self.bsize

    def payload(self, i: int, length: int | None = None) -> memoryview:
        """Writable view of buffer ``i``'s payload (``length`` bytes, default the page size)."""
        start = i * self.bsize + BLOCK
        return self.mv[start:start + (self.page_size if length is None else length)]

    def payload_array(self, i: int) -> np.ndarray[Any, Any]:
        """Buffer ``i``'s payload as a u8 array over the mapping (its own exporter object)."""
        return np.frombuffer(self._data, dtype=np.uint8, count=self.page_size, offset=i * self.bsize + BLOCK)

    def header(self, i: int) -> memoryview:
        """Writable view of buffer ``i``'s 4 KiB header block."""
        start = i * self.bsize
        return self.mv[start:start + BLOCK]

    def state(self, i: int) -> int:
        """Current owner state of buffer ``i`` (load-acquire)."""
        return int(LIB.kv_load_acquire_u32(self._states + i))

    def set_state(self, i: int, state: int) -> None:
        """Hand buffer ``i`` on (store-release). Only the current owner may call this."""
        LIB.kv_store_release_u32(self._states + i, state)

    def cas_state(self, i: int, expected: int, desired: int) -> bool:
        """Hand buffer ``i`` on only if its state is ``expected`` (one atomic step); whether it did."""
        return bool(LIB.kv_cas_u32(self._states + i, expected, desired))

    def states(self, start: int, count: int) -> np.ndarray[Any, Any]:
        """A snapshot of ``count`` states from ``start`` (for statistics and leak checks)."""
        return np.array([self.state(i) for i in range(start, start + count)], dtype=np.uint32)

    def release(self) -> None:
        """Drop the memoryview so the segment can be unmapped."""
        self.mv.release()
