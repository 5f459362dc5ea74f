"""Page buffers: 4 KiB-aligned buffers that a client, the supervisor and the workers share.

Each connection has its own buffers (its *lease*), in its own connection segment
(ipc/connection.py ``ClientChannel.layout``): ``n`` buffers of ``4096 + page_size`` bytes,
and a state word per buffer::

    buffer b at buffers_offset + b * (4096 + page_size):
        [0, 4096)                 slot header block (written by the I/O worker)
        [4096, 4096 + page_size)  page payload (written by the client for a put,
                                  by the device for a get)
    states at states_offset: n x u32

One buffer is exactly one slot's bytes on the device, so a put or a get is a
single O_DIRECT I/O straight between the device and this memory: no copy. A
buffer's *global* index is ``lease_start + b``, with ``lease_start = id * n`` for
connection ``id``: the supervisor names buffers that way on the workers' rings.
No process but the service, its workers and the connection's own client maps a
lease (the segment is owner-only and its descriptor is passed to the client over
the Unix socket), so no client can read or write another connection's buffers.

Ownership: the state word says who may touch the buffer; only the current owner
writes the next state:

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

``g`` is the low 24 bits of the connection's generation, in bits 8..31 (``tagged``).
These words are the client's to write for its own lease: the service never lets them
decide what it keeps (see service/clients.py).

The state is written with store-release and read with load-acquire, so the
new owner sees the buffer's bytes as the old owner left them.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np

from .._native.lib import FFI, LIB, const

BLOCK = const("KV_HEADER_BLOCK")

# declared once, in kvstore/_native/kvstore.h
FREE = const("KV_A_FREE")
CLIENT = const("KV_A_CLIENT")
SERVICE = const("KV_A_SERVICE")
QUARANTINE = const("KV_A_QUARANTINE")
DIRECT = const("KV_A_DIRECT")
READING = const("KV_A_READING")


def tagged(state: int, generation: int) -> int:
    """``state`` (DIRECT or READING) tagged with a connection generation."""
    return state | (generation & 0xFFFFFF) << 8


def kind(state: int) -> int:
    """The state without its connection tag."""
    return state & 0xFF


def buffer_size(page_size: int) -> int:
    """Bytes per arena buffer: a header block plus the page."""
    return BLOCK + page_size


_Array = TypeVar("_Array", bound=np.ndarray)


class BufferStates(Protocol):
    """What the service asks of buffer states, by global buffer index."""

    def state(self, i: int) -> int: ...
    def set_state(self, i: int, state: int) -> None: ...
    def cas_state(self, i: int, expected: int, desired: int) -> bool: ...


class Arena:
    """One lease: views over its buffers and state words in a connection segment.

    Indices are global (``first`` is the lease's first). Invariant: buffer ``i`` starts at a
    4096-byte aligned address (the mapping is page aligned, ``buffers_offset`` and the buffer
    size multiples of 4096).
    """

    def __init__(self, buf: Any, states_offset: int, buffers_offset: int, count: int, page_size: int,
                 first: int = 0) -> None:
        self.count = count
        self.first = first
        self.page_size = page_size
        self.bsize = buffer_size(page_size)
        if buffers_offset % BLOCK or len(buf) < buffers_offset + count * self.bsize \
                or len(buf) < states_offset + 4 * count:
            raise ValueError("lease segment smaller than its layout, or buffers not 4096-aligned")
        self._data = buf
        self._off = buffers_offset
        p = FFI.from_buffer(buf)
        self._keep = p
        self.base = p + buffers_offset
        self._states = FFI.cast("uint32_t *", p + states_offset)
        self.states_c = self._states
        """``uint32_t *`` to the state words (for compiled code: store-release and load-acquire only)."""
        self.mv = memoryview(buf)

    def address(self, i: int) -> Any:
        """``char *`` to buffer ``i`` (header block first)."""
        return self.base + (i - self.first) * self.bsize

    def payload(self, i: int, length: int | None = None) -> memoryview:
        """Writable view of buffer ``i``'s payload (``length`` bytes, default the page size)."""
        start = self._off + (i - self.first) * self.bsize + BLOCK
        return self.mv[start:start + (self.page_size if length is None else length)]

    def payload_array(self, i: int, subtype: type[_Array]) -> _Array:
        """Buffer ``i``'s payload as a u8 array of ``subtype`` (an ``ndarray`` subclass, made as
        that type directly: no intermediate array) over the mapping: its own exporter object."""
        return subtype((self.page_size,), np.uint8, self._data, self._off + (i - self.first) * self.bsize + BLOCK)

    def header(self, i: int) -> memoryview:
        """Writable view of buffer ``i``'s 4 KiB header block."""
        start = self._off + (i - self.first) * self.bsize
        return self.mv[start:start + BLOCK]

    def state(self, i: int) -> int:
        """Current owner state of buffer ``i`` (load-acquire)."""
        return int(LIB.kv_load_acquire_u32(self._states + (i - self.first)))

    def set_state(self, i: int, state: int) -> None:
        """Hand buffer ``i`` on (store-release). Only the current owner may call this."""
        LIB.kv_store_release_u32(self._states + (i - self.first), state)

    def cas_state(self, i: int, expected: int, desired: int) -> bool:
        """Hand buffer ``i`` on only if its state is ``expected`` (one atomic step); whether it did."""
        return bool(LIB.kv_cas_u32(self._states + (i - self.first), expected, desired))

    def set_states(self, rel: np.ndarray[Any, Any], state: int) -> None:
        """Hand buffers ``first + rel`` on (``rel``: int64, lease-relative; store-release each, one
        call). Only their current owner may call this."""
        rel = np.ascontiguousarray(rel, dtype=np.int64)
        LIB.kv_store_release_u32_at(self._states, FFI.from_buffer("int64_t[]", rel), len(rel), state)

    def states(self, start: int, count: int) -> np.ndarray[Any, Any]:
        """A snapshot of ``count`` states from ``start`` (for statistics and leak checks)."""
        return np.array([self.state(i) for i in range(start, start + count)], dtype=np.uint32)

    def release(self) -> None:
        """Drop the memoryview so the segment can be unmapped."""
        self.mv.release()


class LeaseStates:
    """The service's view of every lease's state words, by global buffer index: each
    connection's are in its own segment, attached while the connection lives. A buffer of a
    lease that is not attached reads FREE and ignores writes (its connection is gone)."""

    def __init__(self, per_lease: int, leases: int) -> None:
        self.per_lease = per_lease
        self._ptrs: list[Any] = [None] * leases
        self._keep: list[Any] = [None] * leases

    def attach(self, k: int, buf: Any, states_offset: int) -> None:
        """Lease ``k``'s state words are at ``states_offset`` in ``buf`` from now on."""
        p = FFI.from_buffer(buf)
        self._keep[k] = p
        self._ptrs[k] = FFI.cast("uint32_t *", p + states_offset)

    def detach(self, k: int) -> None:
        """Lease ``k`` has no connection any more."""
        self._ptrs[k] = None
        self._keep[k] = None

    # (called per buffer on the service's hot path: kept to one list look-up and one cffi call)
    def state(self, i: int) -> int:
        """Current owner state of buffer ``i`` (load-acquire); FREE if its lease is gone."""
        p = self._ptrs[i // self.per_lease]
        return FREE if p is None else int(LIB.kv_load_acquire_u32(p + i % self.per_lease))

    def set_state(self, i: int, state: int) -> None:
        """Hand buffer ``i`` on (store-release), if its lease is still there."""
        p = self._ptrs[i // self.per_lease]
        if p is not None:
            LIB.kv_store_release_u32(p + i % self.per_lease, state)

    def cas_state(self, i: int, expected: int, desired: int) -> bool:
        """Compare-and-swap buffer ``i``'s state; False if its lease is gone."""
        p = self._ptrs[i // self.per_lease]
        return p is not None and bool(LIB.kv_cas_u32(p + i % self.per_lease, expected, desired))
