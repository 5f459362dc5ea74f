"""LMCache L2 adapter: LMCache's multiprocess server keeps its L2 tier in a kvstore store.

Load it through LMCache's plugin adapter (tested with LMCache 0.5.6)::

    lmcache server ... --l2-adapter '{"type": "plugin", "module_path": "kvstore.engines.lmcache",
        "class_name": "KVStoreL2Adapter", "adapter_params": {"store": "demo"}}'

``adapter_params``: ``store`` (required), ``server`` (which local service, if several
run here), ``mass_home`` (default: ``MASS_HOME``), ``tenant`` (a tenant this process's
user is mapped to, see ``[tenants]``), ``timeout_s`` (per kvstore call, default 30).

Keys. An LMCache object (``ObjectKey``: model, KV rank, object group, cache salt,
chunk hash) of ``size`` bytes is stored as ``ceil(size / page_size)`` pages under
``b"lmcache-l2\\0" + msgpack([model, rank, group, salt, chunk_hash, size, layout]) + page
index``, in the connection's tenant key space, ``layout`` being the object's tensors'
shapes and dtypes (LMCache's multiprocess server describes an object group's format by
exactly these). So a load into a buffer of another layout, or of the same size in another
dtype, can never match: it is a miss, never other bytes. A lookup takes the layout from
LMCache's description of the object group, or, when that is absent or empty (LMCache's
own benchmark passes a placeholder), from the objects of that group this process stored
or loaded; a lookup answer that is wrong because of it only makes a load miss.

Locks. ``submit_lookup_and_lock_task`` pins the found pages that this server holds
(kvstore pins: never evicted while pinned), counted per object so that nested locks
work; ``submit_unlock`` unpins at the last unlock, and ``close`` unpins what is left.
The lookup is answered from the shared index and the pins are posted without waiting
for the service (``pin(wait=False)``): a lookup costs no round trip. The service pins
at its next turn, before it takes the unpin of a later unlock; a pin the tenant's pin
quota refuses is not reported (the page may then be evicted before it is loaded: a
miss, never other bytes).
Pages held in other servers' areas cannot be pinned from here: their owners keep them
through the retire grace and hit hints, and a load of one retired meanwhile is a miss.

Tasks run on two threads, each with its own kvstore connection: stores on one, loads on
the other, so loads never queue behind stores. Store tasks queued behind each other go to
the devices as one put (``STORE_GROUP_PAGES``), so that the writes stream on between tasks;
each task completes with its own pages' outcome. Load tasks queued behind each other are read
as one pipelined stream (``get_many``, ``LOAD_GROUP_PAGES``), each completing as soon as its own
pages are copied. Lookups and unlocks use a third connection
in the caller's thread: a lookup is answered from the shared index and its pins are
posted without waiting, so it completes before ``submit_lookup_and_lock_task`` returns,
with no thread hop. The read lane opens that connection, at the first lookup (which it
answers): a stalled service never holds LMCache's thread in a handshake, and no call on
that connection waits for the service longer than ``LOOKUP_WAIT_S``. Completion is signalled through three event fds as LMCache's controllers expect. A
task that fails (the service restarting, a timeout) completes as failed; the threads live
on and reconnect for the next task.

Status. ``report_status`` (LMCache's status API) adds counters since start: objects and
bytes stored and loaded, failed stores and loads, lookups and their hits, and the
seconds spent storing and loading.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import msgpack

from ..client import KVCacheClient
from ..errors import KVStoreError, Timeout
from .pagefit import advice

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

log = logging.getLogger(__name__)

NAMESPACE = b"lmcache-l2\0"
#: Tasks waiting per thread; a submit beyond it completes at once as failed (never blocks LMCache).
QUEUE_DEPTH = 1024
#: A store task and those queued behind it go to the devices as one put of up to this many pages.
STORE_GROUP_PAGES = 256
#: Load tasks queued behind each other are read as one stream of up to this many pages.
LOAD_GROUP_PAGES = 256
#: Longest a lookup or unlock may wait for the service (a stall): past it, a lookup finds nothing
#: (a miss), a lock pins nothing (a hint), an unlock goes to the read lane.
LOOKUP_WAIT_S = 0.05


#: An object's layout as it goes into its keys: (size in bytes, ((shape, dtype), ...)).
Layout = tuple[int, tuple[tuple[tuple[int, ...], str], ...]]


def _layout(shapes: Any, dtypes: Any) -> Layout:
    parts = tuple((tuple(int(d) for d in sh), str(dt)) for sh, dt in zip(shapes or (), dtypes or ()))
    size = 0
    for (sh, _), dt in zip(parts, dtypes or ()):
        n = 1
        for d in sh:
            n *= d
        size += n * dt.itemsize
    return size, parts


def desc_layout(desc: Any) -> Layout:
    """The layout a ``MemoryLayoutDesc`` describes (size 0: it describes nothing)."""
    return _layout(getattr(desc, "shapes", None), getattr(desc, "dtypes", None))


def object_layout(obj: Any) -> Layout:
    """The layout of a ``MemoryObj`` (its metadata's tensors; size: what LMCache says it holds)."""
    m = obj.metadata
    shapes = m.shapes if getattr(m, "shapes", None) is not None else [m.shape]
    dtypes = m.dtypes if getattr(m, "dtypes", None) is not None else [m.dtype]
    return int(obj.get_size()), _layout(shapes, dtypes)[1]


def page_keys(key: Any, layout: Layout, page_size: int) -> list[bytes]:
    """The kvstore page keys of LMCache object ``key`` of ``layout``: the layout (size, shapes,
    dtypes) is part of them, so an object of another layout never matches. The key's msgpack
    array is ``[model, rank, group, salt, chunk hash, size, layout]``, then the page index."""
    return page_keys_many([key], [layout], page_size)[0]


def page_keys_many(keys: Sequence[Any], layouts: Sequence[Layout | None], page_size: int) -> list[list[bytes]]:
    """``page_keys`` of many objects (no keys for a layout of None). A run of objects of one
    layout (the same tuple, as a lookup's are) packs its tail and page indices once, and one
    msgpack packer serves them all: a 32-key lookup spent most of its time making keys."""
    pack = msgpack.Packer().pack  # (what msgpack.packb makes anew for every call)
    out: list[list[bytes]] = []
    last: Layout | None = None
    tail = b""
    pages: list[bytes] = []
    for key, lay in zip(keys, layouts):
        if lay is None:
            out.append([])
            continue
        if lay is not last:
            last, tail = lay, layout_tail(lay)
            pages = [i.to_bytes(4, "little") for i in range(max(1, -(-lay[0] // page_size)))]
        head = pack([key.model_name, int(key.kv_rank), int(key.object_group_id), key.cache_salt,
                     bytes(key.chunk_hash)])
        # the 7-element array's header, then the five fields packed above (without their own
        # 5-element header), then size and layout: byte for byte what packing all seven gives
        base = NAMESPACE + b"\x97" + head[1:] + tail
        out.append([base + p for p in pages])
    return out


def layout_tail(layout: Layout) -> bytes:
    """The last two fields of an object's key array (``page_keys``): its size and layout, packed."""
    size, parts = layout
    tail: bytes = msgpack.packb(int(size)) + msgpack.packb([[list(sh), dt] for sh, dt in parts])
    return tail


class _Lane(threading.Thread):
    """One thread with its own kvstore connection, running submitted tasks in order."""

    def __init__(self, name: str, connect: Callable[[], KVCacheClient]) -> None:
        super().__init__(name=name, daemon=True)
        self._connect = connect
        self._client: KVCacheClient | None = None
        self.tasks: queue.Queue[Callable[[Callable[[], KVCacheClient]], None] | None] = queue.Queue(QUEUE_DEPTH)

    def client(self) -> KVCacheClient:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def run(self) -> None:
        while True:
            task = self.tasks.get()
            if task is None:
                break
            try:
                task(self.client)  # connecting is part of the task: a service that is down fails it
            except Exception:  # the task has completed itself as failed; reconnect for the next
                log.exception("kvstore L2 adapter task failed")
                self._drop()
        self._drop()

    def _drop(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except KVStoreError:
                pass
            self._client = None


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over a local kvstore service (see the module docstring)."""

    def __init__(self, params: dict[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        if not isinstance(params, dict) or not isinstance(params.get("store"), str):
            raise ValueError('kvstore L2 adapter: adapter_params must name the store: {"store": "NAME"}')
        unknown = set(params) - {"store", "server", "mass_home", "tenant", "timeout_s"}
        if unknown:
            raise ValueError(f"kvstore L2 adapter: unknown adapter_params {sorted(unknown)}")
        self._params = dict(params)
        timeout = float(params.get("timeout_s", 30.0))

        def connect(wait: float = timeout) -> KVCacheClient:
            home = params.get("mass_home")
            return KVCacheClient.connect(params["store"], server=params.get("server"),
                                         home=Path(home) if home else None, timeout=wait,
                                         tenant=params.get("tenant", ""))

        probe = connect()  # fail at start, with kvstore's reason, if the service is not there
        self.page_size = probe.page_size
        probe.close()
        self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, Any] = {}
        self._lookups: dict[int, Any] = {}
        self._loads: dict[int, Any] = {}
        self._locks: dict[Any, tuple[int, list[bytes]]] = {}  # object -> (lock count, pinned page keys)
        self._layouts: dict[int, Layout] = {}  # object group -> layout seen in stores and loads
        self._advised: set[int] = set()  # object sizes whose page fit was logged
        # counters since start, in report_status (LMCache's status API: `lmcache server`'s /info)
        self._stats = dict.fromkeys(("stored_objects", "stored_bytes", "store_failed_objects", "store_s",
                                     "lookup_objects", "lookup_hits", "loaded_objects", "loaded_bytes",
                                     "load_failed_objects", "load_s"), 0.0)
        self._connect = connect
        self._queued_stores: collections.deque[tuple[int, list[Any], list[Any]]] = collections.deque()
        self._queued_loads: collections.deque[tuple[int, list[Any], list[Any]]] = collections.deque()
        self._writer = _Lane("kvstore-l2-store", connect)
        self._reader = _Lane("kvstore-l2-read", connect)
        # lookups and unlocks: a connection of their own, used in the caller's thread (pins and
        # the unpins that undo them on one connection: its requests are taken in order)
        self._lk = threading.Lock()
        self._lk_client: KVCacheClient | None = None
        self._owed_unpins: list[bytes] = []  # unpins not posted yet (``_unpin``)
        self._closed = False

        self._writer.start()
        self._reader.start()

    # ---- event fds -------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return int(self._efd["store"].fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._efd["lookup"].fileno())

    def get_load_event_fd(self) -> int:
        return int(self._efd["load"].fileno())

    def _done(self, kind: str, table: dict[int, Any], task_id: int, result: Any) -> None:
        with self._lock:
            table[task_id] = result
        self._efd[kind].notify()

    def _submit(self, lane: _Lane, kind: str, table: dict[int, Any], failed: Callable[[], Any],
                body: Callable[[KVCacheClient], Any], objects: int) -> int:
        task_id = next(self._ids)

        def task(client: Callable[[], KVCacheClient]) -> None:
            try:
                result = body(client())
            except Exception:
                self._count_failed(kind, objects)
                self._done(kind, table, task_id, failed())
                raise
            self._done(kind, table, task_id, result)

        try:
            lane.tasks.put_nowait(task)
        except queue.Full:
            log.warning("kvstore L2 adapter: %d tasks queued; failing a %s task", QUEUE_DEPTH, kind)
            self._count_failed(kind, objects)
            self._done(kind, table, task_id, failed())
        return task_id

    def _count_failed(self, kind: str, objects: int) -> None:
        """A task that raised or was refused: all its objects failed."""
        if kind == "store":
            self._count(store_failed_objects=objects)
        elif kind == "load":
            self._count(load_failed_objects=objects)

    # ---- store -----------------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._enqueue("store", keys, objects)

    def _enqueue(self, kind: str, keys: list[Any], objects: list[Any]) -> int:
        """A store or load task: queued, then a token on its lane that takes whatever is queued
        of its kind by then as one group (``_store_queued``, ``_load_queued``)."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        for k, o in zip(keys, objects):
            self._layouts[int(k.object_group_id)] = object_layout(o)
        task_id = next(self._ids)
        store = kind == "store"
        queued = self._queued_stores if store else self._queued_loads
        with self._lock:
            queued.append((task_id, keys, objects))
        try:
            (self._writer if store else self._reader).tasks.put_nowait(
                self._store_queued if store else self._load_queued)
        except queue.Full:
            log.warning("kvstore L2 adapter: %d tasks queued; failing a %s task", QUEUE_DEPTH, kind)
            with self._lock:  # (taken back if no lane task got to it yet)
                mine = [t for t in queued if t[0] == task_id]
                for t in mine:
                    queued.remove(t)
            if mine:
                self._fail(kind, task_id, len(keys))
        return task_id

    def _fail(self, kind: str, task_id: int, objects: int) -> None:
        """Complete store or load task ``task_id`` as failed (all its ``objects``)."""
        self._count_failed(kind, objects)
        if kind == "store":
            self._done("store", self._stores, task_id, L2StoreResult(False, 0))
        else:
            self._done("load", self._loads, task_id, Bitmap(objects))

    def _take_group(self, queued: collections.deque[tuple[int, list[Any], list[Any]]],
                    pages_max: int) -> list[tuple[int, list[Any], list[Any]]]:
        """The tasks queued by now, up to ``pages_max`` pages (the first in any case)."""
        group: list[tuple[int, list[Any], list[Any]]] = []
        pages = 0
        with self._lock:
            while queued and (not group or pages < pages_max):
                t = queued.popleft()
                group.append(t)
                pages += self._pages_in(t[2])
        return group

    def _store_queued(self, client: Callable[[], KVCacheClient]) -> None:
        """(On the store lane.) The store tasks queued by now, as one put (their pages stream to
        the devices with no pause between tasks, where a put per task drained the device queue
        at each task's end), up to ``STORE_GROUP_PAGES`` pages; each task completes with its
        own pages' outcome. The lane's later tokens find nothing left and return."""
        group = self._take_group(self._queued_stores, STORE_GROUP_PAGES)
        if not group:
            return
        try:
            c = client()
            results = self._store(c, [t[1] for t in group], [t[2] for t in group])
        except Exception:
            for task_id, keys, _objects in group:
                self._fail("store", task_id, len(keys))
            raise
        for (task_id, _keys, _objects), r in zip(group, results):
            self._done("store", self._stores, task_id, r)

    def _pages_in(self, objects: Sequence[Any]) -> int:
        """Pages a task's objects take, to size a group (taken from the queue before anything can
        fail a task on its own: an object that cannot say its size counts one page, and fails its
        own task when it is read)."""
        n = 0
        for o in objects:
            try:
                n += max(1, -(-int(o.get_size()) // self.page_size))
            except Exception:
                n += 1
        return n

    def _count(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._stats[k] += v

    def _store(self, c: KVCacheClient, tasks_keys: Sequence[Sequence[Any]],
               tasks_objects: Sequence[Sequence[Any]]) -> list[Any]:
        """Store the objects of several tasks in one put; each task's ``L2StoreResult`` (a task
        whose objects cannot be read fails alone)."""
        t0 = time.perf_counter()
        pkeys: list[bytes] = []
        pages: list[Any] = []
        spans: list[tuple[int, int] | None] = []  # each task's pages in the put (None: failed before it)
        for keys, objects in zip(tasks_keys, tasks_objects):
            first = len(pkeys)
            try:
                tk, tp = self._pages_of(keys, objects)
            except Exception:
                log.exception("kvstore L2 adapter: a store task's objects could not be read")
                spans.append(None)
                continue
            pkeys += tk
            pages += tp
            spans.append((first, len(pkeys)))
        r = c.put(pkeys, pages, wait=True) if pkeys else None  # stored or skipped (already there), or dropped
        # with wait=True a page is stored, skipped or dropped; anything else fails the whole put
        whole = r is not None and r.stored + r.skipped + r.dropped == len(pkeys)
        out = []
        for span, keys, objects in zip(spans, tasks_keys, tasks_objects):
            ok = span is not None and whole and r is not None and not any(span[0] <= i < span[1] for i in r.dropped_at)
            sizes = [int(o.get_size()) for o in objects] if ok else [0]
            if ok:
                try:
                    self._notify_keys_stored(list(keys), sizes)
                except Exception:
                    log.exception("kvstore L2 adapter: notifying LMCache of stored keys failed")
            self._count(stored_objects=len(keys) if ok else 0, stored_bytes=sum(sizes) if ok else 0,
                        store_failed_objects=0 if ok else len(keys))
            out.append(L2StoreResult(ok, sum(sizes) if ok else 0))
        self._count(store_s=time.perf_counter() - t0)
        return out

    def _pages_of(self, keys: Sequence[Any], objects: Sequence[Any]) -> tuple[list[bytes], list[Any]]:
        """The page keys and page views of a store task's objects."""
        ps = self.page_size
        pkeys: list[bytes] = []
        pages: list[Any] = []
        layouts = [object_layout(o) for o in objects]
        for obj, layout, obj_keys in zip(objects, layouts, page_keys_many(keys, layouts, ps)):
            size = layout[0]
            if size not in self._advised:  # once per object size: what the store's page size costs it
                self._advised.add(size)
                tip = advice("an LMCache object", size, ps)
                if tip:
                    log.warning("kvstore L2 adapter: %s", tip)
            data = memoryview(obj.byte_array).cast("B")[:size]
            for i, pk in enumerate(obj_keys):
                piece = data[i * ps:(i + 1) * ps]
                if len(piece) < ps:  # the object's last page: padded (its size is in the key)
                    padded = bytearray(ps)
                    padded[:len(piece)] = piece
                    piece = memoryview(padded)
                pkeys.append(pk)
                pages.append(piece)
        return pkeys, pages

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        with self._lock:  # emptied in place: tasks still running hold this same dict
            done = dict(self._stores)
            self._stores.clear()
        return done

    # ---- lookup and lock -------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: dict[int, Any]) -> int:
        layouts: list[Layout | None] = []
        by_group: dict[int, Layout | None] = {}  # one layout per object group: worked out once a call
        for k in keys:
            g = int(k.object_group_id)
            if g not in by_group:
                lay = desc_layout(group_layout_descs.get(g)) if group_layout_descs else (0, ())
                by_group[g] = lay if lay[0] else self._layouts.get(g)
            layouts.append(by_group[g])
        with self._lk:
            c = self._lk_client
            if c is not None:  # in this thread, no hop: answered from the shared index, pins posted
                try:
                    found = self._lookup_and_lock(c, keys, layouts)
                except Timeout:  # the index is being rebuilt and the service stalls: misses
                    found = Bitmap(len(keys))
                except KVStoreError:  # the service is gone (its pins with it)
                    self._drop_lookup_client()
                    found = None
                if found is not None:
                    task_id = next(self._ids)
                    self._done("lookup", self._lookups, task_id, found)
                    return task_id
        # no lookups' connection yet (or it failed): the read lane opens one (a handshake may wait
        # for the service, which LMCache's thread must not) and answers this lookup on it
        return self._submit(self._reader, "lookup", self._lookups, lambda: Bitmap(len(keys)),
                            lambda _c: self._lookup_on_lane(keys, layouts), len(keys))

    def _lookup_client(self) -> KVCacheClient:
        """(On the read lane.) The lookups' connection, opened if there is none."""
        with self._lk:
            c = self._lk_client
        if c is not None:
            return c
        new: KVCacheClient | None = self._connect()  # outside the lock: LMCache's thread may want it
        with self._lk:
            if self._lk_client is None and not self._closed:
                self._lk_client, new = new, None
            c = self._lk_client
        if new is not None:
            new.close()
        if c is None:
            raise KVStoreError("the adapter is closed")
        return c

    def _drop_lookup_client(self) -> None:
        """(Holding ``_lk``.) The lookups' connection failed: close it; the next lookup opens another."""
        c, self._lk_client = self._lk_client, None
        if c is not None:
            try:
                c.close()
            except KVStoreError:
                pass

    def _lookup_on_lane(self, keys: Sequence[Any], layouts: Sequence[Layout | None]) -> Any:
        """(On the read lane.) A lookup before the lookups' connection was open, on it."""
        self._lookup_client()
        with self._lk:
            if self._lk_client is None:
                raise KVStoreError("the lookups' connection closed")
            try:
                return self._lookup_and_lock(self._lk_client, keys, layouts)
            except Timeout:
                return Bitmap(len(keys))
            except KVStoreError:
                self._drop_lookup_client()
                raise

    def _lookup_and_lock(self, c: KVCacheClient, keys: Sequence[Any], layouts: Sequence[Layout | None]) -> Any:
        """(Holding ``_lk``.) Never waits for the service longer than ``LOOKUP_WAIT_S``."""
        timeout = LOOKUP_WAIT_S
        found = Bitmap(len(keys))
        per = page_keys_many(keys, layouts, self.page_size)
        flat = [pk for ks in per for pk in ks]
        have = c.contains(flat, timeout=timeout) if flat else []
        hits: list[tuple[Any, list[bytes]]] = []
        to_pin: list[bytes] = []
        with self._lock:  # (this call's keys only: an engine may hold many locks meanwhile)
            locked = {k for k in keys if k in self._locks}
        at = 0
        for i, (k, ks) in enumerate(zip(keys, per)):
            n = len(ks)
            at += n
            if not (n and all(have[at - n:at])):
                continue
            found.set(i)
            if k not in locked:  # (a key twice in one call is pinned once)
                locked.add(k)
                to_pin += ks
            hits.append((k, ks))
        pinned = True
        if to_pin:  # posted, not waited for: the lookup answers from the shared index with no round trip
            self._flush_unpins(c)  # unpins owed first: they are older than these pins
            try:  # pages in other servers' areas are not pinned here (see the docstring)
                c.pin(to_pin, wait=False, timeout=timeout)
            except Timeout:  # every request slot still the service's (a stall): a lock is only a hint
                log.warning("kvstore L2 adapter: the service is slow; %d pages not pinned", len(to_pin))
                pinned = False
        # counted once the pins are posted (or known not to be): an error above counts nothing, and
        # a lock whose pins were not posted unpins nothing at its unlock
        with self._lock:
            for k, ks in hits:
                n, held = self._locks.get(k, (0, ks if pinned else []))
                self._locks[k] = (n + 1, held)
        self._count(lookup_objects=len(keys), lookup_hits=len(hits))
        return found

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        # under the lookups' lock, as a lookup runs from its look at the locks held to its count:
        # an unlock releasing an object between the two made the lookup count a lock it did not
        # pin again, its pages unpinned (found by an outside review; a miss later, never bytes)
        with self._lk:
            release: list[bytes] = []
            with self._lock:
                for k in keys:
                    if k not in self._locks:
                        continue
                    n, pinned = self._locks[k]
                    if n <= 1:
                        del self._locks[k]
                        release += pinned
                    else:
                        self._locks[k] = (n - 1, pinned)
            if release:
                self._unpin(release)

    def _unpin(self, pkeys: list[bytes]) -> None:
        """(Holding ``_lk``.) Posted on the lookups' connection, after the pins it undoes (its
        requests are taken in order: an unpin on another connection could overtake them and
        leave them pinned for good), without waiting. Never waits for the service longer than
        ``LOOKUP_WAIT_S``: while that connection is not open or the service does not take
        requests, the unpins wait in ``_owed_unpins``, posted first by the next lookup or unlock
        on the connection (or by ``close``). If the service went away, its pins went with it (a
        restart starts with none)."""
        self._owed_unpins.extend(pkeys)
        if self._lk_client is not None:
            self._flush_unpins(self._lk_client)

    def _flush_unpins(self, c: KVCacheClient) -> None:
        """(Holding ``_lk``.) Post the unpins owed on ``c`` (kept for later if the service does not
        take them within ``LOOKUP_WAIT_S``; dropped if it is gone: its pins are gone too)."""
        while self._owed_unpins:
            # a request's worth at a time, forgotten once posted: an unpin posted twice (a later
            # part timed out, the whole list kept) could release a pin a new lock took meanwhile
            part = self._owed_unpins[:c.max_batch]
            try:
                c.unpin(part, wait=False, timeout=LOOKUP_WAIT_S)
            except Timeout:
                return
            except KVStoreError:
                self._drop_lookup_client()
                self._owed_unpins.clear()
                return
            del self._owed_unpins[:len(part)]

    # ---- load ------------------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._enqueue("load", keys, objects)

    def _load_queued(self, client: Callable[[], KVCacheClient]) -> None:
        """(On the read lane.) The load tasks queued by now, read as one pipelined stream (a
        ``get_many`` per task drained the device queue at each task's end while its last pages
        were copied), up to ``LOAD_GROUP_PAGES`` pages; each task completes as soon as its own
        pages are in, before the pages of the tasks behind it are copied. The lane's later
        tokens find nothing left and return."""
        group = self._take_group(self._queued_loads, LOAD_GROUP_PAGES)
        if not group:
            return
        done = 0  # tasks of the group completed
        try:
            for loaded in self._load(client(), [t[1] for t in group], [t[2] for t in group]):
                self._done("load", self._loads, group[done][0], loaded)
                done += 1
        except Exception:
            for task_id, keys, _objects in group[done:]:
                self._fail("load", task_id, len(keys))
            raise

    def _load(self, c: KVCacheClient, tasks_keys: Sequence[Sequence[Any]],
              tasks_objects: Sequence[Sequence[Any]]) -> Iterator[Any]:
        """Read the objects of several load tasks as one stream of pages; yields each task's
        ``Bitmap`` in order, as soon as its last page is copied."""
        t0 = time.perf_counter()
        ps = self.page_size
        # every page of every object of every task
        wanted: list[tuple[int, int, int, bytes]] = []  # (task, object, page, key)
        dsts: list[list[tuple[memoryview, int]]] = []
        ends: list[int] = []  # each task's pages end here in ``wanted``
        missing: set[tuple[int, int]] = set()  # (task, object) not loaded
        for t, (keys, objects) in enumerate(zip(tasks_keys, tasks_objects)):
            td: list[tuple[memoryview, int]] = []
            tw: list[tuple[int, int, int, bytes]] = []
            try:
                layouts = [object_layout(o) for o in objects]
                td = [(memoryview(o.byte_array).cast("B")[:lay[0]], lay[0]) for o, lay in zip(objects, layouts)]
                tw = [(t, i, p, k) for i, ks in enumerate(page_keys_many(keys, layouts, ps)) for p, k in enumerate(ks)]
            except Exception:  # a task whose objects cannot be read fails alone, reading nothing
                log.exception("kvstore L2 adapter: a load task's objects could not be read")
                td, tw = [], []
                missing.update((t, i) for i in range(len(keys)))
            wanted += tw
            dsts.append(td)
            ends.append(len(wanted))
        nxt = 0  # the next task to complete

        def finished(t: int) -> Any:
            keys = tasks_keys[t]
            loaded = Bitmap(len(keys))
            accessed = []
            for i, key in enumerate(keys):
                if (t, i) not in missing:  # a partly filled buffer is reported failed: LMCache recomputes it
                    loaded.set(i)
                    accessed.append(key)
            if accessed:
                try:
                    self._notify_keys_accessed(accessed)
                except Exception:
                    log.exception("kvstore L2 adapter: notifying LMCache of loaded keys failed")
            self._count(loaded_objects=len(accessed), load_failed_objects=len(keys) - len(accessed),
                        loaded_bytes=sum(size for i, (_, size) in enumerate(dsts[t]) if (t, i) not in missing),
                        load_s=time.perf_counter() - t0)
            return loaded

        while nxt < len(ends) and ends[nxt] == 0:  # tasks of no objects
            yield finished(nxt)
            nxt += 1
        # pipelined: the next pages are read while these are copied into LMCache's buffers
        with closing(c.get_many([k for *_, k in wanted])) as batches:
            for s, views in batches:
                for (t, i, p, _), v in zip(wanted[s:s + len(views)], views):
                    if v is None or (t, i) in missing:
                        missing.add((t, i))
                        continue
                    dst, size = dsts[t][i]
                    off = p * ps
                    n = min(ps, size - off)
                    try:
                        dst[off:off + n] = v[:n]
                    except Exception:  # (a buffer LMCache handed over that cannot take it) this object fails
                        log.exception("kvstore L2 adapter: a loaded page could not be copied out")
                        missing.add((t, i))
                end = s + len(views)
                while nxt < len(ends) and ends[nxt] <= end:
                    yield finished(nxt)
                    nxt += 1
                    t0 = time.perf_counter()

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loads.pop(task_id, None)

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        # the lanes first: lookups still queued on the read lane take their locks before the
        # locks left are unpinned (with the service stalled, a full queue cannot take the stop
        # marker: the lanes are daemons, and close goes on without them)
        self._closed = True
        for lane in (self._writer, self._reader):
            try:
                lane.tasks.put(None, timeout=30)
            except queue.Full:
                log.warning("kvstore L2 adapter: %s still has a full queue; closing without it", lane.name)
        for lane in (self._writer, self._reader):
            lane.join(30)
        with self._lock:
            left = [pk for _, pinned in self._locks.values() for pk in pinned]
            self._locks.clear()
        with self._lk:
            self._owed_unpins.extend(left)
            if self._owed_unpins and self._lk_client is None:
                try:
                    self._lk_client = self._connect(1.0)
                except KVStoreError:
                    pass
            if self._lk_client is not None:
                self._flush_unpins(self._lk_client)
            if self._lk_client is not None:
                try:
                    self._lk_client.ping(timeout=1.0)  # the unpins posted are taken before the connection goes
                except KVStoreError:
                    pass
            if self._owed_unpins:
                log.warning("kvstore L2 adapter: closing with %d pages still pinned (the service did not take "
                            "their unpins; they last until it restarts)", len(self._owed_unpins))
            self._drop_lookup_client()
        for e in self._efd.values():
            e.close()

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            locked = len(self._locks)
            stats = {k: (round(v, 4) if k.endswith("_s") else int(v)) for k, v in self._stats.items()}
        return {"is_healthy": self._writer.is_alive() and self._reader.is_alive(), "type": "KVStoreL2Adapter",
                "store": self._params["store"], "page_size": self.page_size, "locked_objects": locked,
                "store_queue": self._writer.tasks.qsize(), "read_queue": self._reader.tasks.qsize(), **stats}


__all__ = ["KVStoreL2Adapter", "desc_layout", "layout_tail", "object_layout", "page_keys", "page_keys_many"]
