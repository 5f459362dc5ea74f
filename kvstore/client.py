"""KVCacheClient: the engine side of kvstore, talking to the local cache service.

A connection is a Unix-socket hello followed by shared-memory rings and a
lease of page buffers in its own connection segment (see ``ipc/connection.py``).
Pages move between the device and those buffers with O_DIRECT I/O; ``get``
hands out read-only views of them (zero copy) until the batch is released.

Example::

    from kvstore import KVCacheClient
    with KVCacheClient.connect("demo") as c:
        c.put(keys, pages, wait=True)
        n = c.lookup(keys)
        with c.get(keys) as pages:      # memoryview per key, None for a miss
            ...
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


from .config import check_name, mass_home, run_dir, store_path
from .errors import (ClosedError, KVStoreError, NotAllowed, QuotaExceeded, ServiceLost, StoreNotFound, Timeout,
                     ViewsInUse, WouldBlock)
from .digests import check_keys, key_digests, pack_keys
from .ipc import connection as P
from ._native.lib import FFI, LIB
from .ipc.iorings import ST_OK
from .shm.control import ControlLayout
from .shm.index import IndexReader
from .shm.slots import VALID, SlotMap
from .shm.stats import bucket_of
from .ipc import lease as A
from .shm.segment import Segment
from .shm.wake import WakeReader, WakeWriter

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_POLL_S = 0.002  # see ``connect``
_NONE = np.zeros(0, dtype=np.int64)
_NONE_U64 = np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True)
class PutResult:
    """What ``put`` did with each page."""

    stored: int
    """Pages written and indexed before ``put`` returned (``wait=True``)."""
    queued: int
    """Pages accepted and still being written (``wait=False``)."""
    skipped: int
    """Pages not written because the store already holds the key, or another write of it is in
    flight (that write may still fail: ``lookup`` finds the page once it is done)."""
    dropped: int
    """Pages not written: no slot could be freed (all pinned or being written) or the write failed."""
    dropped_at: tuple[int, ...] = ()
    """The indices (in the call's ``keys``) of the pages dropped."""


def _copy_summed(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` and return its xxh3_64, computed on the way (_native/copy.c:
    computed afterwards, it reads the page from memory again)."""
    return int(LIB.kv_copy_sum(FFI.from_buffer("uint8_t[]", dst), FFI.from_buffer("uint8_t[]", src), len(src)))


def _checksum(page: memoryview) -> int:
    """xxh3_64 of a page (compiled: the same function as the slot header's checksum)."""
    return int(LIB.kv_xxh3(FFI.from_buffer("uint8_t[]", page), len(page)))


def _answered(d: P.Descriptor, seq: int) -> bool:
    """Whether the service has answered request ``seq`` in descriptor ``d``."""
    return d.state == P.D_ANSWERED and int(d.head["answered"][0]) == seq


def _put_result(results: list[int]) -> PutResult:
    """Count a put's per-page results."""
    return PutResult(results.count(P.R_STORED), results.count(P.R_QUEUED), results.count(P.R_SKIPPED),
                     results.count(P.R_DROPPED), tuple(i for i, r in enumerate(results) if r == P.R_DROPPED))


class _PageArray(np.ndarray[Any, Any]):
    """The exporter behind one page view: a read-only array over an arena buffer.

    Every view handed out, and everything derived from it (slices, numpy arrays,
    ``memoryview``s of those), keeps this object alive; the client holds only a weak
    reference, so it knows exactly when the last reader is gone. It also keeps the
    client (and so the connection and its lease) alive while any view exists.
    """

    _owner: Any


class PageBatch(Sequence["memoryview | None"]):
    """The result of ``get``: one read-only ``memoryview`` per key, ``None`` for a miss.

    The views point into shared memory the client leases from the service (zero
    copy). A view never changes under its reader: ``release()`` (or the end of the
    ``with`` block) invalidates the views this batch handed out, and a buffer
    goes back to the pool only once nothing derived from its view (a slice, a
    numpy array made with ``np.frombuffer``) is alive any more. Until then the
    buffer stays out of use, so keep such arrays short-lived, or copy them.
    """

    def __init__(self, client: KVCacheClient, views: list[memoryview | None], held: list[tuple[int, Any]]) -> None:
        self._client = client
        self._views = views
        self._held = held  # (buffer, weakref to its exporter)
        self._released = False

    def __getitem__(self, i: Any) -> Any:
        if self._released:
            raise ClosedError("page batch was released; its views are no longer valid")
        return self._views[i]

    def __len__(self) -> int:
        return len(self._views)

    @property
    def hits(self) -> int:
        """Number of keys found."""
        return sum(v is not None for v in self._views)

    def release(self) -> None:
        """Give the buffers back (idempotent). The batch's views are released; a buffer
        with arrays or slices still derived from its view returns once they are gone."""
        with self._client._release_lock:  # one release, whichever threads call it
            if self._released:
                return
            self._released = True
            views, self._views = self._views, []
            held, self._held = self._held, []
        for v in views:
            if v is not None:
                try:
                    v.release()
                except BufferError:
                    pass  # something still exports it: its buffer lingers until that is gone
        self._client._linger(held)

    def __enter__(self) -> PageBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PageReservation(Sequence[memoryview]):
    """Writable page buffers leased for a ``put`` without a copy in the client (``KVCacheClient.reserve``).

    Fill ``reservation[i]`` (a writable ``memoryview`` of ``page_size`` bytes into the
    shared memory the device is written from: copy a tensor into it, or decode into
    it), then ``commit(keys)``. Commit revokes the views first: it refuses, with
    ``ViewsInUse``, while any array, slice or tensor made from them is alive, because
    the service must never write a page that can still change under it. Buffers not
    committed go back at ``release()`` or the end of the ``with`` block.
    """

    def __init__(self, client: KVCacheClient, bufs: list[int]) -> None:
        self._client = client
        self._bufs = bufs
        self._refs: list[Any] = [None] * len(bufs)
        self._views: list[memoryview] = [self._view(i) for i in range(len(bufs))]
        self._done = False

    def _view(self, i: int) -> memoryview:
        """A writable view of reserved page ``i`` over its exporter (made anew if none is alive)."""
        page = self._refs[i]() if self._refs[i] is not None else None
        if page is None:
            page = self._client._arena.payload_array(self._bufs[i], _PageArray)
            page._owner = self._client
            self._refs[i] = weakref.ref(page)
        return memoryview(page)  # type: ignore[arg-type]

    def __getitem__(self, i: Any) -> Any:
        if self._done:
            raise ClosedError("reservation was committed or released; its views are no longer valid")
        return self._views[i]

    def __len__(self) -> int:
        return len(self._bufs)

    def _revoke(self) -> None:
        for v in self._views:
            try:
                v.release()
            except BufferError:
                pass  # exported further: caught by the weak references below
        self._views = []

    def commit(self, keys: Sequence[bytes], *, wait: bool = False, timeout: float | None = None) -> PutResult:
        """Save the first ``len(keys)`` reserved pages under ``keys`` (the rest go back unused).

        Raises:
            ViewsInUse: something made from the views is still alive (nothing was sent; the
                reservation stays usable: drop it and commit again).
            ValueError: more keys than reserved pages, or an empty key.
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: as ``put``.
        """
        r = self._commit(keys, wait, timeout, False)
        assert isinstance(r, PutResult)
        return r

    def commit_async(self, keys: Sequence[bytes], *, timeout: float | None = None) -> PendingPut:
        """``commit`` as ``put_async``: returns once the pages are posted; ``result()`` waits for
        them as ``commit(wait=True)`` does. An engine that fills a reservation while the one
        before is written keeps the device busy between them (reserve at most half the lease
        at a time, or the next ``reserve`` waits for the last one's writes).

        Raises: as ``commit``.
        """
        r = self._commit(keys, True, timeout, True)
        assert isinstance(r, PendingPut)
        return r

    def _commit(self, keys: Sequence[bytes], wait: bool, timeout: float | None, detach: bool) -> PutResult | PendingPut:
        """``commit`` and ``commit_async`` (``detach``)."""
        with self._client._release_lock:  # one commit or release, whichever threads call them
            if self._done:
                raise ClosedError("reservation was already committed or released")
            keys = check_keys(keys)  # a bad key is refused before anything happens to the reservation
            if len(keys) > len(self._bufs):
                raise ValueError(f"{len(keys)} keys for {len(self._bufs)} reserved pages")
            self._revoke()
            alive = sum(r() is not None for r in self._refs)
            if alive:  # nothing was sent: hand out views again, over the same exporters
                self._views = [self._view(i) for i in range(len(self._bufs))]
                raise ViewsInUse(f"{alive} reserved page(s) still have arrays, slices or tensors made from "
                                 "them: drop them, then commit (the pages must not change once they are sent)")
            self._done = True
        n = len(keys)
        used, rest = self._bufs[:n], self._bufs[n:]
        self._client._give_back(rest)
        return self._client._put_buffers(keys, used, wait, timeout, detach)

    def release(self) -> None:
        """Give back the pages not committed (idempotent). A page with arrays still made from
        its view returns once they are gone."""
        with self._client._release_lock:
            if self._done:
                return
            self._done = True
            self._revoke()
        self._client._linger(list(zip(self._bufs, self._refs)))

    def __enter__(self) -> PageReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Reads:
    """A direct get in flight (``KVCacheClient._post_direct``)."""

    bufs: list[int]             # the lease buffers of the batch, one per key
    good: np.ndarray[Any, Any]  # per key: read and validated
    rows: np.ndarray[Any, Any]  # of the reads not answered yet: the key's row,
    lbs: np.ndarray[Any, Any]   # its buffer (lease-relative, int64)
    seqs: np.ndarray[Any, Any]  # and the read's seq (uint64)
    t0: float
    deadline: float

    @property
    def waiting(self) -> int:
        return len(self.rows)


class PendingGet:
    """A ``get`` whose reads are in flight (``KVCacheClient.get_async``)."""

    def __init__(self, client: KVCacheClient, reads: _Reads | None, batch: PageBatch | None) -> None:
        self._client = client
        self._reads = reads
        self._batch = batch

    def result(self) -> PageBatch:
        """Wait for the reads (until the timeout given to ``get_async``, counted from then)
        and return their ``PageBatch``; again the same batch on later calls.

        Raises:
            Timeout, ServiceLost: as ``get`` (the pages are misses; the buffers come back).
            ClosedError: the get was cancelled, or the client closed before it finished.
        """
        if self._batch is not None:
            return self._batch
        c = self._client
        with c._lock:
            if self._batch is not None:
                return self._batch
            if self._reads is None:
                raise ClosedError("this get was cancelled")
            c._check_open()
            r, self._reads = self._reads, None
            self._batch = c._finish_direct(r)  # gives the reads up itself if it raises
            return self._batch

    def cancel(self) -> None:
        """Give the reads up (idempotent; a finished get's batch is released)."""
        c = self._client
        with c._lock:
            r, self._reads = self._reads, None
            if r is not None and not c._closed:
                c._abandon(r)
        if self._batch is not None:
            self._batch.release()

    def _forget(self) -> None:
        """Give the reads up without the client's lock (a finalizer may run while the lock is
        held, by this thread): they are given up at the client's next call (``_reclaim_orphans``)."""
        r, self._reads = self._reads, None
        if r is not None:
            self._client._dropped.append(r)

    def __del__(self) -> None:
        self._forget()  # never waited for: its buffers come back


@dataclass
class _PutPart:
    """A sub-batch of a put, posted in descriptor ``d`` as request ``seq``."""

    d: P.Descriptor
    seq: int
    bufs: list[int]
    results: list[int] | None = None  # its per-page results, once its answer was taken
    error: BaseException | None = None  # or why there are none

    @property
    def taken(self) -> bool:
        return self.results is not None or self.error is not None


class PendingPut:
    """A ``put`` whose pages are being written (``KVCacheClient.put_async``, or
    ``PageReservation.commit_async``): ``result()`` returns once they are on the device and
    indexed, counted as ``put(wait=True)`` counts them."""

    def __init__(self, client: KVCacheClient, parts: list[_PutPart], deadline: float) -> None:
        self._client = client
        self._parts = parts
        self._deadline = deadline
        self._result: PutResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether ``result()`` would return or raise without waiting for the service: every
        answer is in, or the timeout has passed, or the client closed, or the service is gone.
        (Like every call, it waits for a call running in another thread to end.)"""
        c = self._client
        with c._lock:
            if self._result is not None or self._error is not None or c._closed:
                return True
            c._harvest()
            if all(p.taken for p in self._parts) or time.monotonic() >= self._deadline:
                return True
            try:
                c._check_service()
            except KVStoreError:
                return True
            return False

    def result(self) -> PutResult:
        """Wait for the writes (until the timeout given to ``put_async``, counted from then)
        and return their ``PutResult`` (no page ``queued``: each is stored, skipped or
        dropped); the same again on later calls.

        Raises:
            Timeout, ServiceLost: as ``put`` (a sub-batch the service had not started is not
                written; one it had started may still be). Raised again on later calls.
            ClosedError: the client closed before the answers were taken (the writes the
                service had taken still complete).
        """
        c = self._client
        with c._lock:
            if self._result is not None:
                return self._result
            if self._error is not None:
                raise self._error
            if c._closed and not all(p.taken for p in self._parts):
                raise ClosedError("client is closed; this put's outcome is unknown")
            try:
                for part in self._parts:
                    if not part.taken:
                        c._take_part(part, self._deadline)
                    if part.error is not None:
                        raise part.error
            except (KVStoreError, ValueError) as e:
                # as put: the rest is given up (the service's until answered, ``_await``)
                self._error = e
                for part in self._parts:
                    if not part.taken:
                        c._take_part(part, time.monotonic())
                raise
            # (anything else, an interrupt while waiting: nothing is given up, and a later
            # result() waits on)
            self._result = _put_result([r for part in self._parts for r in (part.results or [])])
            return self._result


class KVCacheClient:
    """A connection to the local cache service of one store.

    Invariants: at most one call runs at a time (a lock); a request descriptor
    is either the client's (FREE, or ANSWERED and being read) or the service's
    (POSTED), and the client writes none of the service's; every leased buffer
    is FREE, held by this client (CLIENT: being filled, or behind a view that is
    still alive), or the service's (SERVICE/QUARANTINE) - never lost, and never
    reused while a view of it is alive.
    """

    def __init__(self, sock: socket.socket, hello: dict[str, Any], timeout: float,
                 poll_s: float = 0.0, seg_fd: int = -1, wake_fd: int = -1) -> None:
        self._sock = sock
        self.timeout = timeout
        self._poll_s = poll_s
        self.store: str = hello["store"]
        """Store name."""
        self.server: str = hello["server"]
        """Server name of the service this client talks to."""
        self.tenant: str = hello.get("tenant", "")
        """The tenant whose key space this connection uses (as the service granted it)."""
        self.page_size: int = hello["page_size"]
        """Bytes per page."""
        self.max_batch: int = hello["max_batch"]
        """Most keys per ``get`` (``put`` and ``lookup`` split larger batches)."""
        self._service_pid: int = hello["service_pid"]
        # our connection's segment (channel and lease) comes as a file descriptor over the socket:
        # it is owner-only, no other process of another user can open it by name
        if seg_fd < 0 or wake_fd < 0:
            raise KVStoreError("the service sent no connection segment (client and service of different "
                               "kvstore versions?)")
        # our wake-up too: a FIFO whose only read end is ours (shm/wake.py), so nobody can take
        # the wake-ups meant for us; the service's and the workers' we may only post
        self._wake = WakeReader.adopt(wake_fd)
        self._seg = Segment.adopt(hello["segment"], seg_fd)
        self._control_seg = Segment.attach(hello["control"], readonly=True)  # the service's word: read only
        states_off, buffers_off, size = P.ClientChannel.layout(self.max_batch, len(hello["areas"]), self.page_size)
        if (size > self._seg.size or hello.get("states_offset") != states_off
                or hello.get("buffers_offset") != buffers_off):
            raise KVStoreError("the service's shared-memory layout is not this client's "
                               "(client and service of different kvstore versions?)")
        self._arena = A.Arena(self._seg.buf, states_off, buffers_off, self.max_batch, self.page_size,
                              first=hello["lease_start"])
        self._chan = P.ClientChannel(self._seg.buf, self.max_batch, len(hello["areas"]))
        self._doorbell = WakeWriter.open(hello["doorbell"])
        self._lease = range(hello["lease_start"], hello["lease_start"] + hello["lease_count"])
        self._lease_states = np.frombuffer(self._seg.buf, dtype="<u4", count=hello["lease_count"], offset=states_off)
        self._orphans: set[int] = set()  # buffers of timed-out requests, still the service's
        self._abandoned: set[int] = set()  # descriptors of timed-out requests, still the service's
        self._lingering: list[tuple[int, Any]] = []  # released buffers whose views are still alive
        self._released: deque[list[tuple[int, Any]]] = deque()  # released, not looked at yet (``_linger``)
        self._dropped: list[_Reads] = []  # gets posted and never waited for (``PendingGet.__del__``)
        self._put_parts: dict[int, _PutPart] = {}  # descriptor -> the ``put_async`` part it holds, unanswered
        self._salt: bytes = hello["salt"]
        self._salt_seq = 0  # the channel's keyspace word when ``_salt`` was taken (see ``_tenant_salt``)
        lay = ControlLayout.of(hello["slots"])
        if lay.nbytes > self._control_seg.size:
            raise KVStoreError("the service's shared-memory layout is not this client's "
                               "(client and service of different kvstore versions?)")
        cb = self._control_seg.buf
        self._slots = lay.slot_table(cb)
        # no reference bits: the workers set them for the pages a client reads (a client writes
        # nothing of the service's)
        self._index = IndexReader(lay.index_seq(cb), lay.index_entries(cb), self._slots)
        self._smap = SlotMap(hello["areas"])  # where each slot is, for direct reads
        self._direct_state = A.tagged(A.DIRECT, hello["generation"])
        self._wakes = [WakeWriter.open(name) for name in hello["workers"]]
        # what _native/direct.c's kv_post_direct is given beside the channel's per-buffer words:
        # the slot table, the slot map's bases, our direct-read rings
        self._slots_c = FFI.cast("void *", self._slots.ctypes.data)
        self._bases_c = FFI.cast("int64_t *", self._smap._flat_bases.ctypes.data)
        self._rings_c = FFI.new("struct kv_ring[]", max(1, len(self._chan.direct)))
        for i, ring in enumerate(self._chan.direct):
            ring.point(self._rings_c[i])
        self._seqbox = FFI.new("uint64_t *")
        self._lock = threading.Lock()
        # a batch's or reservation's own release or commit, test-and-set (reentrant: a finalizer
        # releasing another batch may run inside it, in this thread)
        self._release_lock = threading.RLock()
        self._seq = 1
        self._closed = False

    # ---- connection ------------------------------------------------------------------------
    @classmethod
    def connect(cls, store: str, *, server: str | None = None, home: str | Path | None = None,
                timeout: float = DEFAULT_TIMEOUT_S, tenant: str = "",
                poll_s: float = DEFAULT_POLL_S) -> KVCacheClient:
        """Connect to the cache service of ``store`` running on this machine.

        Args:
            store: store name.
            server: which local service, if several servers of the store run here.
            home: MASS_HOME (default: the ``MASS_HOME`` env var, else ``~/.mass``).
            timeout: seconds any call may take before raising ``Timeout``.
            tenant: the tenant whose key space this connection uses. The service checks it
                against this process's user and groups (``[tenant_users]`` in the store config);
                empty asks for the tenant this user is mapped to. Tenants share pages only when
                the store config maps them to one namespace (``[namespaces]``).
            poll_s: how long a get of one or two pages polls for its answer (yielding the core)
                before it sleeps: a sleep adds a scheduler wake-up (~50 us) to each such get.
                0 always sleeps: where the clients outnumber the free cores, polling takes CPU the
                device workers need (measured: 8 clients of single-page gets on 2 cores, -12%
                aggregate throughput).

        Raises:
            StoreNotFound: no such store, or no service of it runs here.
            NotAllowed: this user may not use ``tenant``.
            KVStoreError: the service refused the connection (e.g. too many clients).
        """
        check_name(store, "store")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        if not 0 <= poll_s <= 1:
            raise ValueError(f"poll_s must be between 0 and 1 second, got {poll_s}")
        h = Path(home) if home is not None else mass_home()
        if not store_path(store, h).exists():
            raise StoreNotFound(f"store {store!r} not found under {h} (create it with "
                                "'mass-ctl kvcache create', or set MASS_HOME)")
        rd = run_dir(store, h)
        if server is None:
            socks = sorted(rd.glob("*.sock")) if rd.is_dir() else []
            if len(socks) > 1:
                raise ValueError(f"several services of store {store!r} run here "
                                 f"({', '.join(s.stem for s in socks)}): pass server=")
            path = socks[0] if socks else rd / "none.sock"
        else:
            path = rd / f"{check_name(server, 'server')}.sock"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(str(path))
            P.send_frame(s, {"v": P.VERSION, "op": "hello", "tenant": tenant})
            hello, fds = P.recv_frame_fds(s)
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            raise StoreNotFound(f"no service of store {store!r} runs here: start one with "
                                f"'mass-ctl kvcache connect {store}'") from None
        except (OSError, ValueError, ConnectionError) as e:
            s.close()
            raise ServiceLost(f"handshake with the service of {store!r} failed: {e}") from None
        if not hello.get("ok") or len(fds) != 2:
            s.close()
            for fd in fds:
                os.close(fd)
            if hello.get("ok"):
                raise ServiceLost(f"handshake with the service of {store!r} failed: no connection segment came")
            if hello.get("kind") == "tenant":
                raise NotAllowed(f"the service of {store!r} refused the connection: {hello.get('error')}")
            raise KVStoreError(f"the service of {store!r} refused the connection: {hello.get('error')}")
        try:
            return cls(s, hello, timeout, poll_s, fds[0], fds[1])
        except OSError as e:  # e.g. ENXIO: the service's wake-ups lost their reader, it is gone
            s.close()
            raise ServiceLost(f"the service of {store!r} went away during the handshake: {e}") from None

    def close(self) -> None:
        """Disconnect (idempotent). A call running in another thread ends first (it waits for
        the service at most its timeout); answers of ``put_async`` calls not taken yet are
        given up (the writes the service had taken still complete).

        Raises:
            ViewsInUse: views of pages (or arrays made from them) are still alive; the
                client stays open, since closing would let other clients reuse their
                buffers under them. Drop them (or copy what you need) and close again.
        """
        with self._lock:  # a call running in another thread finishes first (within its timeout)
            if self._closed:
                return
            self._collect_lingering()
            if self._lingering:
                raise ViewsInUse(f"{len(self._lingering)} page view(s) from released batches are still in use "
                                 "(slices or numpy arrays made from them): drop or copy them, then close again")
            self._closed = True
            self._sock.close()
            self._wake.close()
            self._doorbell.close()
            for w in self._wakes:
                w.close()
            self._arena.release()
            for seg in (self._seg, self._control_seg):
                seg.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- buffers -------------------------------------------------------------------------
    def _reclaim_orphans(self) -> None:
        while self._dropped:
            self._abandon(self._dropped.pop())
        for b in list(self._orphans):
            st = self._arena.state(b)
            if st == A.CLIENT:  # answered after the call gave up: nobody holds a view of it
                self._arena.set_state(b, A.FREE)
            if st in (A.CLIENT, A.FREE):
                self._orphans.discard(b)

    def _linger(self, held: list[tuple[int, Any]]) -> None:
        """Buffers of a released batch or reservation: free once their views are gone. Called
        without the client's lock (``release`` may run in any thread, or as a finalizer while
        this thread holds the lock): queued, and looked at now only if the lock is free."""
        self._released.append(held)  # (atomic)
        if self._lock.acquire(blocking=False):
            try:
                self._collect_lingering()
            finally:
                self._lock.release()

    def _collect_lingering(self) -> None:
        """Free the lingering buffers whose views are gone. Caller holds the lock."""
        while self._released:
            self._lingering += self._released.popleft()
        alive = []
        for b, ref in self._lingering:
            if ref() is None:
                self._arena.set_state(b, A.FREE)
            else:
                alive.append((b, ref))
        self._lingering = alive

    def _alloc(self, n: int, deadline: float) -> list[int]:
        pause = 20e-6
        while True:
            self._reclaim_orphans()
            self._collect_lingering()
            free = self._lease.start + np.nonzero(self._lease_states == A.FREE)[0]
            LIB.kv_fence()  # the loads above act as load-acquires: see the buffers as freed
            if len(free) >= n:
                self._arena.set_states(free[:n] - self._lease.start, A.CLIENT)
                got: list[int] = free[:n].tolist()
                # an orphan the service freed since ``_reclaim_orphans`` looked is ours now, and
                # no orphan any more: left listed, the next reclaim would take it for an answer
                # nobody holds and free it under this call's views
                self._orphans.difference_update(got)
                return got
            self._check_service()
            if time.monotonic() >= deadline:
                raise Timeout(f"no free page buffer within the timeout ({len(free)} of {n} free, "
                              f"{len(self._lingering)} held by live views): writes are backed up or "
                              "views of released batches are still in use; slow down or raise the timeout")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _give_back(self, bufs: Sequence[int]) -> None:
        """Buffers of a request the service refused (it never took them) are free again."""
        for b in bufs:
            self._arena.set_state(b, A.FREE)

    # ---- requests ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")

    def _check_service(self) -> None:
        if P.readable([self._sock]):
            try:
                data = self._sock.recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            if not data:
                raise ServiceLost(f"the cache service of store {self.store!r} is gone; recompute, "
                                  f"and reconnect once 'mass-ctl kvcache connect {self.store}' runs again")

    def _acquire(self, deadline: float) -> P.Descriptor:
        """A request descriptor this client owns: a free one, or one the service gave back
        after answering a timed-out call."""
        while True:
            if self._put_parts:  # answers of ``put_async`` calls nobody waited for yet
                self._harvest()
            for i, d in enumerate(self._chan.desc):
                st = d.state
                if i in self._abandoned:
                    if st != P.D_ANSWERED:
                        continue  # still the service's
                    self._abandoned.discard(i)
                    d.set_state(P.D_FREE)
                    st = P.D_FREE
                if st == P.D_FREE:
                    return d
            self._check_service()
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"the service still holds all {P.NDESC} requests of this connection "
                              "(earlier calls timed out); treat these pages as misses")
            self._wake.wait(min(left, 0.05))

    def _call(self, d: P.Descriptor, op: int, count: int, flags: int, deadline: float,
              bufs: Sequence[int] = ()) -> tuple[int, np.ndarray[Any, Any]]:
        """Post the request in ``d`` (filled by the caller) and wait for its answer.

        Returns ``(value, results)``. On timeout the descriptor and ``bufs`` stay the
        service's (it is told to cancel) and come back once it answers."""
        return self._await(d, self._post(d, op, count, flags), count, deadline, bufs)

    def _post(self, d: P.Descriptor, op: int, count: int, flags: int) -> int:
        """Hand the request in ``d`` to the service; returns its seq (for ``_await``)."""
        seq = self._seq
        self._seq += 1
        h = d.head
        h["seq"] = seq
        h["op"] = op
        h["count"] = count
        h["flags"] = flags
        d.set_cancel(0)
        d.set_state(P.D_POSTED)  # from here on the descriptor is the service's
        try:
            self._chan.requests.put_nowait((seq, d.index, 0))
        except WouldBlock:  # cannot happen: the ring holds as many records as there are descriptors
            d.set_state(P.D_FREE)
            raise Timeout("the service did not take the request in time") from None
        self._doorbell.post()
        return seq

    def _await(self, d: P.Descriptor, seq: int, count: int, deadline: float,
               bufs: Sequence[int] = (), freed_early: bool = False) -> tuple[int, np.ndarray[Any, Any]]:
        """Wait for the answer to the request ``seq`` posted in ``d`` (see ``_call``).
        ``freed_early``: the service may give ``bufs`` back before it answers (a put's: a page
        skipped at intake, a write done), so on a timeout only those it still holds become
        orphans; one it gave back may be another call's already."""
        h = d.head
        while True:
            if _answered(d, seq):
                st = int(h["status"][0])
                value = int(h["value"][0])
                res = d.results[:count].copy()
                d.set_state(P.D_FREE)
                if st == P.S_OK:
                    return value, res
                if bufs:
                    self._give_back(bufs)
                if st == P.S_TOO_LARGE:
                    raise ValueError(f"batch of {count} keys exceeds the service's max batch {self.max_batch}")
                raise KVStoreError(f"the service rejected the request (status {st})")
            self._check_service()
            left = deadline - time.monotonic()
            if left <= 0:
                d.set_cancel(1)
                self._abandoned.add(d.index)
                self._orphans.update(b for b in bufs if not freed_early
                                     or self._arena.state(b) in (A.SERVICE, A.QUARANTINE))
                raise Timeout(f"no answer from the cache service within the timeout ({self.timeout} s "
                              "default); treat these pages as misses")
            self._wake.wait(min(left, 0.05))

    def _keys(self, d: P.Descriptor, ids: np.ndarray[Any, Any], start: int, n: int) -> None:
        d.keys[:n] = ids[start:start + n]

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    def contains(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Per key, whether the store holds it now (a later ``get`` may still miss).

        Raises:
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: the service did not answer.
        """
        found: list[bool] = self._lookup(keys, timeout, prefix=False)[1].tolist()
        return found

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading keys of ``keys`` (a prefix chain) the store holds.

        Raises:
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: the service did not answer.
        """
        return self._lookup(keys, timeout, prefix=True)[0]

    def _lookup(self, keys: Sequence[bytes], timeout: float | None, *, prefix: bool
                ) -> tuple[int, np.ndarray[Any, Any]]:
        """The leading hits and, unless ``prefix``, which keys hit (with ``prefix`` the mask is
        meaningful only up to the first miss: the keys after it need not be looked at)."""
        with self._lock:
            self._check_open()
            self._check_service()
            if not isinstance(keys, (list, tuple)):
                keys = list(keys)  # any iterable, as elsewhere
            blob, lens = pack_keys(keys)  # checks the keys (TypeError, ValueError)
            # answered here from the shared index, no round trip (it is a hint either way: a
            # get validates what it reads); only a lookup that keeps overlapping an index
            # rebuild asks the service
            found = self._index.lookup_keys(blob, lens, self._tenant_salt(), prefix=prefix)
            if found is not None:
                gids, done = found
                hit = gids >= 0
                c = self._chan.counters
                c[P.C_LOOKUPS] += 1
                c[P.C_LOOKUP_KEYS] += len(hit)  # keys asked about (a prefix lookup may look at fewer)
                lead = hit[:done]
                return int(np.argmin(lead)) if not lead.all() else done, hit
            return self._lookup_service(key_digests(keys)[0], timeout)

    def _tenant_salt(self) -> bytes:
        """This connection's tenant salt: the hello's, or the one the service published since
        (an administrator moved the tenant's key space; ipc/connection.py "keyspace")."""
        seq = self._chan.salt_seq()
        if seq != self._salt_seq:
            salt = self._chan.read_salt(seq)
            if salt is not None:  # None: being rewritten this instant; the next call takes it
                self._salt, self._salt_seq = salt, seq
        return self._salt

    def _lookup_service(self, ids: np.ndarray[Any, Any], timeout: float | None) -> tuple[int, np.ndarray[Any, Any]]:
        """Lookup through the service (caller holds the lock)."""
        deadline = self._deadline(timeout)
        found = np.zeros(len(ids), dtype=bool)
        lead = 0
        for start in range(0, len(ids), self.max_batch):
            n = min(self.max_batch, len(ids) - start)
            d = self._acquire(deadline)
            self._keys(d, ids, start, n)
            value, res = self._call(d, P.OP_LOOKUP, n, 0, deadline)
            found[start:start + n] = res == P.R_HIT
            if lead == start:
                lead += value
        return lead, found

    def get(self, keys: Sequence[bytes], *, timeout: float | None = None) -> PageBatch:
        """Read the pages of ``keys``: a ``PageBatch`` of read-only views (``None`` per miss).

        Every returned page was validated by the service (header, generation,
        key and checksum); anything else is a miss. Release the batch (or use
        ``with``) to give its buffers back; a view never changes while it, or
        anything made from it, is alive.

        Raises:
            ValueError: more keys than ``max_batch``.
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: the service did not answer (treat as misses).
        """
        return self.get_async(keys, timeout=timeout).result()

    def _views(self, bufs: list[int], ok: Sequence[bool]) -> PageBatch:
        """The batch over ``bufs`` whose reads succeeded (``ok``); the other buffers go back."""
        views: list[memoryview | None] = []
        held: list[tuple[int, Any]] = []
        arena = self._arena
        for j, b in enumerate(bufs):
            mine = arena.state(b) == A.CLIENT
            if ok[j] and mine:
                page = arena.payload_array(b, _PageArray)
                page.flags.writeable = False
                page._owner = self
                views.append(memoryview(page))  # type: ignore[arg-type]
                held.append((b, weakref.ref(page)))
            else:
                views.append(None)
                if mine:
                    self._arena.set_state(b, A.FREE)
        return PageBatch(self, views, held)

    def _get_service(self, ids: np.ndarray[Any, Any], deadline: float) -> PageBatch:
        """A get the supervisor carries out (caller holds the lock)."""
        n = len(ids)
        d = self._acquire(deadline)
        self._keys(d, ids, 0, n)
        bufs = self._alloc(n, deadline)
        d.bufs[:n] = bufs
        for b in bufs:
            self._arena.set_state(b, A.SERVICE)
        _, res = self._call(d, P.OP_GET, n, 0, deadline, bufs)
        return self._views(bufs, (res == P.R_HIT).tolist())

    def _post_direct(self, ids: np.ndarray[Any, Any], words: np.ndarray[Any, Any], gids: np.ndarray[Any, Any],
                     deadline: float, t0: float) -> _Reads:
        """Pin the slots found and post the reads straight to the device workers' rings in our
        segment (caller holds the lock); ``_finish_direct`` waits for the workers' answers.
        The protocol is in ipc/connection.py. A record names the slot, the generation found
        and the key id; the worker reads only if the key id, salted with this connection's
        tenant salt, is the digest the service's register holds, and validates the page
        against that register, as for the supervisor's reads."""
        n = len(words)
        bufs = self._alloc(n, deadline)
        rel = np.asarray(bufs, dtype=np.int64) - self._lease.start
        gids = np.ascontiguousarray(gids, dtype=np.int64)
        words = np.ascontiguousarray(words, dtype=np.uint64)
        ids = np.ascontiguousarray(ids)
        rows, lbs, seqs = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.uint64)
        woken = np.zeros(len(self._wakes), dtype=np.uint8)
        box = self._seqbox
        box[0] = self._seq
        m = int(LIB.kv_post_direct(
            self._slots_c, len(self._slots), FFI.from_buffer("int64_t[]", gids), FFI.from_buffer("uint64_t[]", words),
            FFI.from_buffer("uint64_t[]", ids), FFI.from_buffer("int64_t[]", rel), n, self._chan._pins,
            self._chan._dseq, self._chan._ddev, self._arena.states_c, self._direct_state, self._bases_c,
            len(self._smap._flat_bases), self._smap.n_areas, self._rings_c, len(self._wakes), box,
            FFI.from_buffer("int64_t[]", rows), FFI.from_buffer("int64_t[]", lbs),
            FFI.from_buffer("uint64_t[]", seqs), FFI.from_buffer("uint8_t[]", woken)))
        self._seq = int(box[0])
        for dv in np.nonzero(woken)[0].tolist():
            self._wakes[dv].post()
        prow, plb, pseq = rows[:m], lbs[:m], seqs[:m]
        return _Reads(bufs, np.zeros(n, dtype=bool), prow, plb, pseq, t0, deadline)

    def _landed(self, r: _Reads) -> bool:
        """Take the answers that came for ``r``; whether all have (caller holds the lock). (The
        worker unpinned each answered read's slot before it answered.)"""
        if not r.waiting:
            return True
        k = int(LIB.kv_take_landed(self._arena.states_c, self._chan._wseq, self._chan._wstat,
                                   FFI.from_buffer("int64_t[]", r.rows), FFI.from_buffer("int64_t[]", r.lbs),
                                   FFI.from_buffer("uint64_t[]", r.seqs), r.waiting, A.CLIENT, ST_OK,
                                   FFI.from_buffer("uint8_t[]", r.good)))
        if k < r.waiting:
            r.rows, r.lbs, r.seqs = r.rows[:k], r.lbs[:k], r.seqs[:k]
        return not k

    def _finish_direct(self, r: _Reads) -> PageBatch:
        """Wait for the workers' answers to the reads of ``r`` (caller holds the lock); on any
        exception the reads are given up (their buffers come back)."""
        try:
            return self._await_direct(r)
        except BaseException:
            if r.bufs:
                self._abandon(r)
            raise

    def _await_direct(self, r: _Reads) -> PageBatch:
        ch = self._chan
        # a read of one or two pages is over in a few hundred microseconds: poll for it (yielding
        # the core) rather than sleep, which adds a scheduler wake-up
        # (~50 us) to every single-page get; bigger batches sleep at once (``poll_s``, ``connect``)
        poll_until = time.monotonic() + self._poll_s if r.waiting <= P.POLL_READS else 0.0
        while not self._landed(r):
            self._check_service()
            rest = r.deadline - time.monotonic()
            if rest <= 0:
                raise Timeout("the device workers did not finish the reads within the timeout; "
                              "treat these pages as misses")
            if time.monotonic() < poll_until:
                os.sched_yield()
                continue
            # wake me when the last of them lands (reads of later batches may be in flight too:
            # a worker's "none of yours left" would come only after those); then look again
            # before sleeping (it may have landed before the worker could see the word)
            ch.wait_for(int(r.seqs[-1]))
            if self._landed(r):
                break
            self._wake.wait(min(rest, 0.05))
        bufs, r.bufs = r.bufs, []  # the batch's from here on
        batch = self._views(bufs, r.good.tolist())
        c = ch.counters
        c[P.C_GETS] += 1
        c[P.C_GET_KEYS] += len(r.good)
        c[P.C_GET_MISSES] += len(r.good) - batch.hits
        c[P.C_HIST + bucket_of(time.monotonic() - r.t0)] += 1
        return batch

    def _abandon(self, r: _Reads) -> None:
        """Give up on the reads of ``r`` still in flight (caller holds the lock): a buffer the
        worker has not taken is ours again; one being read is handed back (and unpinned) by
        the worker when done, and freed then. The rest of ``r``'s buffers are free."""
        ch, lease0 = self._chan, self._lease.start
        out = set()
        for b in r.lbs.tolist():
            out.add(lease0 + b)
            if self._arena.cas_state(lease0 + b, self._direct_state, A.CLIENT):
                ch.pins[b] = -1  # the worker had not taken it: ours again, and free below
                self._arena.set_state(lease0 + b, A.FREE)
            else:  # being read: the worker hands it back (and unpins it) when done
                self._orphans.add(lease0 + b)
        r.rows, r.lbs, r.seqs = _NONE, _NONE, _NONE_U64
        rest, r.bufs = [b for b in r.bufs if b not in out], []
        self._views(rest, [False] * len(rest)).release()

    def get_async(self, keys: Sequence[bytes], *, timeout: float | None = None) -> PendingGet:
        """Start reading the pages of ``keys``; ``result()`` of the returned ``PendingGet``
        waits for them and gives the ``PageBatch`` that ``get`` would have.

        The reads run on the devices while the caller does other work, or starts further
        gets: several gets in flight keep the devices' queues full where one waited-for
        batch at a time drains them (``get_many`` does this over a long list of keys). The
        timeout counts from this call. Each pending get holds ``len(keys)`` of this
        connection's ``max_batch`` page buffers until its batch is released; one never
        waited for gives them back when it is garbage-collected.

        Raises:
            ValueError: more keys than ``max_batch``.
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: no free page buffers or request within the timeout.
        """
        keys = check_keys(keys)
        if len(keys) > self.max_batch:
            raise ValueError(f"get of {len(keys)} keys exceeds max_batch {self.max_batch} "
                             "(service.client_buffers in the store config); split the batch")
        if not keys:
            return PendingGet(self, None, PageBatch(self, [], []))
        deadline = self._deadline(timeout)
        with self._lock:
            self._check_open()
            t0 = time.monotonic()
            ids, words = key_digests(keys, self._tenant_salt())
            assert words is not None
            gids = self._index.lookup(words)
            if gids is None:  # the index kept being rebuilt under us: the service reads, now
                return PendingGet(self, None, self._get_service(ids, deadline))
            return PendingGet(self, self._post_direct(ids, words, gids, deadline, t0), None)

    def get_many(self, keys: Sequence[bytes], *, batch: int | None = None,
                 timeout: float | None = None) -> Generator[tuple[int, PageBatch], None, None]:
        """Read the pages of any number of ``keys``: yields ``(start, PageBatch)`` for
        ``keys[start:start + batch]`` in order, while the next batches' reads are already in
        flight (``get_async``), so one caller keeps the devices busy while it copies pages out.

        Release each batch (``with``, or let the loop go on: a batch is released when the
        next is asked for) and copy out what you keep: the buffers of a batch are reused for
        the batches after it.

        Args:
            batch: keys per batch (default: a quarter of ``max_batch``, so that three batches
                are in flight while the caller handles a fourth).
            timeout: seconds for each batch, counted from when its reads are posted.

        Raises:
            ValueError: ``batch`` is not in ``1..max_batch``.
            TypeError: a key is not ``bytes``.
            Timeout, ServiceLost: as ``get``; the batches after the one that failed are
                given up (their buffers come back).
        """
        keys = check_keys(keys)
        step = max(1, self.max_batch // 4) if batch is None else batch
        if not 1 <= step <= self.max_batch:
            raise ValueError(f"batch of {step} keys: between 1 and max_batch ({self.max_batch})")
        return self._get_many(keys, step, timeout)

    def _get_many(self, keys: list[bytes], step: int, timeout: float | None
                  ) -> Generator[tuple[int, PageBatch], None, None]:
        depth = max(1, self.max_batch // step)  # batches whose buffers the lease holds at once
        flight: deque[tuple[int, PendingGet]] = deque()
        nxt = 0
        try:
            while flight or nxt < len(keys):
                # the first batch in any case; more only while buffers are free (views of earlier
                # batches a caller kept alive must not stall the pipeline: it goes one at a time)
                while nxt < len(keys) and len(flight) < depth and (
                        not flight or self._free_count() >= min(step, len(keys) - nxt)):
                    flight.append((nxt, self.get_async(keys[nxt:nxt + step], timeout=timeout)))
                    nxt += step
                start, pending = flight.popleft()
                with pending.result() as b:
                    yield start, b
        finally:  # (this may run as a finalizer, with the client's lock held by this very thread)
            for _start, pending in flight:
                pending._forget()

    def put(self, keys: Sequence[bytes], pages: Sequence[Any], *, wait: bool = False,
            timeout: float | None = None) -> PutResult:
        """Save ``pages[i]`` under ``keys[i]``; keys the store already holds are skipped.

        Each page is copied once, into a shared-memory buffer the device is
        written from. With ``wait=False`` the call returns once the service has
        taken the batch; the writes finish later (and may still be dropped).

        Args:
            keys: ``bytes`` keys.
            pages: buffer-protocol objects (bytes, numpy arrays, ...) of exactly ``page_size`` bytes.
            wait: return only after the pages are on the device and indexed.
            timeout: seconds for the whole call (default: the client's timeout).

        Raises:
            ValueError: ``len(keys) != len(pages)`` or a page of the wrong size.
            TypeError: a key is not ``bytes`` or a page has no buffer interface.
            Timeout, ServiceLost: the service did not take or finish the batch (a
                sub-batch the service had not started when the call timed out is not
                written; one it had started may still be).
        """
        keys, views = self._page_views(keys, pages)
        deadline = self._deadline(timeout)
        ids, _ = key_digests(keys)
        with self._lock:
            self._check_open()
            results = self._put_stream(ids, self._copier(views, deadline), wait, deadline)
        return _put_result(results)

    def put_async(self, keys: Sequence[bytes], pages: Sequence[Any], *, timeout: float | None = None) -> PendingPut:
        """Start saving ``pages[i]`` under ``keys[i]``; ``result()`` of the returned
        ``PendingPut`` waits for the writes, as ``put(wait=True)``.

        Returns once every page is copied and handed to the service, so the caller's pages
        may change from then on, and the next batch can be prepared while these are written:
        an engine that keeps two or three puts in flight keeps the device busy between them
        (``put(wait=True)`` in a loop lets its queue drain at each call's end). A connection
        has 8 requests in flight at most (a put of up to a quarter of ``max_batch`` pages is
        one); a call that finds them all taken waits for the oldest answers, as does one that
        finds no free page buffer. A ``PendingPut`` nobody waits for costs nothing: its answers
        are taken by later calls.

        Args, Raises: as ``put`` (``Timeout`` here: no request slot or page buffer freed within
            the timeout; the timeout also bounds ``result()``, counted from this call).
        """
        keys, views = self._page_views(keys, pages)
        deadline = self._deadline(timeout)
        ids, _ = key_digests(keys)
        with self._lock:
            self._check_open()
            return self._start_put_async(ids, self._copier(views, deadline), deadline)

    def _start_put_async(self, ids: np.ndarray[Any, Any], fill: Callable[[int, int], tuple[list[int], list[int]]],
                         deadline: float) -> PendingPut:
        """Post a waiting put's sub-batches (``_put_post_all``) as a ``PendingPut``. Caller holds
        the lock."""
        pending = PendingPut(self, [], deadline)
        self._put_post_all(ids, fill, deadline, pending._parts)
        return pending

    def _page_views(self, keys: Sequence[bytes], pages: Sequence[Any]) -> tuple[list[bytes], list[memoryview]]:
        """The checked keys, and a flat byte view of each page (``put``'s arguments checked)."""
        keys = check_keys(keys)
        pages = list(pages)
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        views = []
        for i, p in enumerate(pages):
            try:
                v = memoryview(p)
            except TypeError:
                raise TypeError(f"pages[{i}] has no buffer interface ({type(p).__name__})") from None
            if not v.contiguous:
                raise ValueError(f"pages[{i}] is not contiguous")
            if v.nbytes != self.page_size:
                raise ValueError(f"pages[{i}] has {v.nbytes} bytes; this store's page_size is {self.page_size}")
            views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
        return keys, views

    def _copier(self, views: list[memoryview], deadline: float) -> Callable[[int, int], tuple[list[int], list[int]]]:
        """``fill`` for ``_put_stream``: pages ``start..start+n`` copied into leased buffers."""
        def fill(start: int, n: int) -> tuple[list[int], list[int]]:
            bufs = self._alloc(n, deadline)
            return bufs, [_copy_summed(self._arena.payload(b), views[start + j]) for j, b in enumerate(bufs)]
        return fill

    def reserve(self, n: int, *, timeout: float | None = None) -> PageReservation:
        """Lease ``n`` writable page buffers to fill in place and ``commit`` as a put: the
        page goes from the engine's memory into the buffer the device is written from in
        one copy, the engine's (``put`` copies it once more). See ``PageReservation``.

        Raises:
            ValueError: ``n`` is not in ``1..max_batch``.
            Timeout: no ``n`` buffers free within the timeout (writes backed up, or views
                of released batches still alive).
        """
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"reserve({n}): between 1 and max_batch ({self.max_batch}) pages")
        deadline = self._deadline(timeout)
        with self._lock:
            self._check_open()
            return PageReservation(self, self._alloc(n, deadline))

    def _put_buffers(self, keys: list[bytes], bufs: list[int], wait: bool, timeout: float | None,
                     detach: bool = False) -> PutResult | PendingPut:
        """Post filled client buffers as a put (``PageReservation.commit``; with ``detach``, as a
        ``put_async``: ``commit_async``)."""
        deadline = self._deadline(timeout)
        if not keys:
            return PendingPut(self, [], deadline) if detach else PutResult(0, 0, 0, 0)
        taken = 0  # buffers handed to the service: the rest are still ours to give back
        with self._lock:
            try:
                self._check_open()
                ids, _ = key_digests(keys)

                def fill(start: int, n: int) -> tuple[list[int], list[int]]:
                    # filled in place, never copied here: one pass to checksum each page, so
                    # that the device worker does not make it (it serves every client of its device)
                    nonlocal taken
                    part = bufs[start:start + n]
                    taken = start + n
                    return part, [_checksum(self._arena.payload(b)) for b in part]

                if detach:
                    return self._start_put_async(ids, fill, deadline)
                return _put_result(self._put_stream(ids, fill, wait, deadline))
            finally:
                self._give_back(bufs[taken:])

    def _put_stream(self, ids: np.ndarray[Any, Any], fill: Callable[[int, int], tuple[list[int], list[int]]],
                    wait: bool, deadline: float) -> list[int]:
        """Put the pages of key ids ``ids`` in sub-batches of a quarter lease: ``fill(start, n)``
        returns the buffers of pages ``start..start+n`` and their checksums. While the service
        writes one sub-batch the next is being filled (a whole-lease batch would wait for every
        write of the previous one), and one is posted ahead of its answer (waiting for each
        answer before filling the next left the client idle that long). Per-page results in
        order. Caller holds the lock."""
        results: list[int] = []
        posted: tuple[P.Descriptor, int, list[int]] | None = None
        try:
            for d, seq, bufs in self._post_parts(ids, fill, wait, deadline):
                prev, posted = posted, (d, seq, bufs)
                if prev is not None:
                    results += self._put_answer(*prev, deadline)
            if posted is not None:
                p, posted = posted, None
                results += self._put_answer(*p, deadline)
        finally:
            if posted is not None:  # failing with a sub-batch posted: it is the service's until answered
                try:
                    self._put_answer(*posted, deadline)
                except Exception:
                    pass  # timed out too: its descriptor and buffers come back when answered
        return results

    def _post_parts(self, ids: np.ndarray[Any, Any], fill: Callable[[int, int], tuple[list[int], list[int]]],
                    wait: bool, deadline: float) -> Generator[tuple[P.Descriptor, int, list[int]], None, None]:
        """Post the put of key ids ``ids`` in sub-batches of a quarter lease (``fill`` as in
        ``_put_stream``), yielding each one's ``(descriptor, seq, buffers)`` once posted."""
        step = max(1, self.max_batch // 4)
        for start in range(0, len(ids), step):
            n = min(step, len(ids) - start)
            d = self._acquire(deadline)
            self._keys(d, ids, start, n)
            bufs, csums = fill(start, n)
            yield d, self._post_put(d, bufs, wait, csums), bufs

    def _post_put(self, d: P.Descriptor, bufs: list[int], wait: bool, csums: list[int]) -> int:
        """Hand the filled ``bufs`` (payload checksums ``csums``) to the service as the put in
        ``d`` (its keys written); returns its seq. Caller holds the lock."""
        n = len(bufs)
        for b in bufs:
            self._arena.set_state(b, A.SERVICE)
        d.bufs[:n] = bufs
        d.lengths[:n] = self.page_size
        d.csums[:n] = csums
        return self._post(d, P.OP_PUT, n, P.FLAG_CSUM | (P.FLAG_WAIT if wait else 0))

    def _put_answer(self, d: P.Descriptor, seq: int, bufs: list[int], deadline: float) -> list[int]:
        """The per-page results of the put ``seq`` posted in ``d``."""
        _, res = self._await(d, seq, len(bufs), deadline, bufs, freed_early=True)
        return [int(r) for r in res.tolist()]

    def _put_post_all(self, ids: np.ndarray[Any, Any], fill: Callable[[int, int], tuple[list[int], list[int]]],
                      deadline: float, parts: list[_PutPart]) -> None:
        """Post every sub-batch of a ``put_async`` (waiting) into ``parts`` without taking their
        answers. If posting one fails, the ones posted are waited for (as ``_put_stream`` does)
        before the error is raised: the call then failed as a whole, as ``put``. Caller holds
        the lock."""
        try:
            for d, seq, bufs in self._post_parts(ids, fill, True, deadline):
                part = _PutPart(d, seq, bufs)
                parts.append(part)
                # its answer is taken by whichever call needs the descriptor first (``_acquire``):
                # a call of more parts than the connection has requests takes its own first ones
                self._put_parts[d.index] = part
        except (KVStoreError, ValueError):
            for part in parts:
                if not part.taken:
                    self._take_part(part, deadline)
            raise
        # (an interrupt: nothing waited for; the parts posted are taken by later calls)

    def _take_part(self, part: _PutPart, deadline: float) -> None:
        """Take the answer of ``part`` (waiting until ``deadline``); its results, or the error,
        are kept in it. Caller holds the lock."""
        d = part.d
        if d.state == P.D_FREE or int(d.head["seq"][0]) != part.seq:
            # its answer was taken, and lost to an exception (an interrupt) before it was
            # recorded; the descriptor may hold another request now: touch nothing of it
            part.error = KVStoreError("this put's answer was lost (an exception interrupted the call "
                                      "taking it); its pages may or may not be stored")
        else:
            try:
                part.results = self._put_answer(d, part.seq, part.bufs, deadline)
            except (KVStoreError, ValueError) as e:
                part.error = e
        if self._put_parts.get(d.index) is part:  # (an interrupt above leaves it listed)
            del self._put_parts[d.index]

    def _harvest(self) -> None:
        """Take the answers already given to ``put_async`` calls (frees their descriptors for
        other requests), without waiting: at most one part per descriptor. Caller holds the lock."""
        now = time.monotonic()
        for part in list(self._put_parts.values()):
            if _answered(part.d, part.seq):
                self._take_part(part, now)

    def pin(self, keys: Sequence[bytes], *, timeout: float | None = None, wait: bool = True) -> int:
        """Pin pages (a shared system prompt, say) so that this server never evicts them.

        Only pages held in this server's own areas can be pinned here; pins belong to
        the tenant, outlive this connection, and last until ``unpin`` or a service
        restart. Returns how many of ``keys`` are pinned.

        ``wait=False`` posts the pins and returns 0 at once, without a round trip: the
        service pins the pages at its next turn, in order with this connection's later
        requests (an ``unpin`` after it undoes it), and a pin refused by the quota is not
        reported. For a lock that only keeps pages from being evicted while they are
        loaded (a get validates what it reads either way).

        Raises:
            QuotaExceeded: the tenant's pin quota is reached (the pages before the limit stay pinned).
            TypeError: a key is not ``bytes``.
        """
        n, quota = self._pin_op(P.OP_PIN, keys, timeout, wait)
        if quota:
            raise QuotaExceeded(f"{quota} page(s) not pinned: the tenant's pin quota is reached ({n} pinned by "
                                "this call); unpin some pages or ask for a larger [pin_quotas] entry")
        return n

    def unpin(self, keys: Sequence[bytes], *, timeout: float | None = None, wait: bool = True) -> int:
        """Release this tenant's pins of ``keys``; returns how many were pinned (0 with
        ``wait=False``: posted without waiting, taken in order with this connection's other
        requests, as ``pin(wait=False)``)."""
        return self._pin_op(P.OP_UNPIN, keys, timeout, wait)[0]

    def _pin_op(self, op: int, keys: Sequence[bytes], timeout: float | None,
                wait: bool = True) -> tuple[int, int]:
        keys = check_keys(keys)
        ids, _ = key_digests(keys)
        deadline = self._deadline(timeout)
        done = quota = 0
        with self._lock:
            self._check_open()
            for start in range(0, len(keys), self.max_batch):
                n = min(self.max_batch, len(keys) - start)
                d = self._acquire(deadline)
                self._keys(d, ids, start, n)
                if not wait:  # the answer is not waited for: the descriptor comes back once answered
                    self._post(d, op, n, 0)
                    self._abandoned.add(d.index)
                    continue
                _, res = self._call(d, op, n, 0, deadline)
                done += int((res == P.R_PINNED).sum())
                quota += int((res == P.R_QUOTA).sum())
        return done, quota

    def ping(self, *, timeout: float | None = None) -> float:
        """Round-trip a no-op through the service; returns seconds taken."""
        t0 = time.monotonic()
        deadline = self._deadline(timeout)
        with self._lock:
            self._check_open()
            self._call(self._acquire(deadline), P.OP_PING, 0, 0, deadline)
        return time.monotonic() - t0

    def _free_count(self) -> int:
        """Leased buffers FREE now, without reclaiming any (a hint: no lock needed)."""
        return int(np.count_nonzero(self._lease_states == A.FREE))

    def free_buffers(self) -> int:
        """Leased buffers free right now (diagnostics: a leak shows as fewer than ``max_batch``).

        Buffers of timed-out calls count once the service has given them back, and
        buffers of released batches once no view of them is alive."""
        with self._lock:
            self._reclaim_orphans()
            self._collect_lingering()
        return sum(1 for i in self._lease if self._arena.state(i) == A.FREE)
