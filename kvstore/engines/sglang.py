"""SGLang HiCache storage backend: SGLang's L3 tier in a kvstore store (tested with SGLang 0.5.23).

Start SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore", "module_path": "kvstore.engines.sglang",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "store": "demo"}'

Extra config: ``store`` (required), ``server`` (which local service, if several run
here), ``mass_home`` (default ``MASS_HOME``), ``tenant``, ``timeout_s`` (per call, 30),
``model_id`` (the weights identity in every key; default SGLang's model name).

Pages. One SGLang page (``page_size`` tokens of every layer, K and V) is one kvstore
page: the store's page size must hold it (checked when the host pool is registered,
with the size needed in the error). ``batch_set_v1``/``batch_get_v1`` copy between the
host pool's memory (``get_page_buffer_meta``: the K and V pieces of each page) and the
store, without intermediate tensors; ``batch_exists`` is one local lookup with prefix
semantics.

Keys. SGLang's page hashes are chained over the prefix. The kvstore key is that hash
under a prefix naming the model, the rank fields that change what a page holds (TP
rank and size unless MLA, PP, context parallel, DCP), the host pool's class, layout,
dtype and per-page byte sizes: pages of incompatible layouts never share keys.

Tenants. SGLang's L3 keys do not carry the request's ``cache_salt`` (sglang#37160):
every request of one SGLang server shares the key space of the tenant this backend
connects as (``tenant`` in the extra config, granted from the SGLang process's Unix
user; see ``[tenants]``). Give servers whose users must not share KV different tenants.

Invalidation. SGLang's keys carry the model name, not a weights identity: after a weight
update under the same name, pages of the old weights would load. ``clear`` (SGLang's
``POST /hicache/storage-backend/clear``) moves this backend's keys to the next namespace in
O(1): no page saved before is loaded by this process again (the old pages stay until the
store reuses their space). The namespace is the count of clears, so every TP rank of the
server moves to the same one (MLA ranks share keys; random ones would make every later
lookup miss). It reaches this process only, and a restart counts from 0 again: give
``model_id`` a weights identity (``name@revision``) so that other SGLang servers and
restarts never share keys across weights.

Hybrid pools. SGLang hands hybrid models' extra host pools (sliding-window, Mamba, DSA
indexer sidecars) to ``register_mem_host_pool_v2`` and moves them with the v2 calls. This
backend stores full-attention KV pages only: it refuses such pools when they are
registered (SGLang's attach, at start), naming them, instead of answering v2 calls with
``NotImplementedError`` (which SGLang catches, never using the store, without a word).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from ..client import KVCacheClient
from ..errors import KVStoreError
from .pagefit import advice

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

log = logging.getLogger(__name__)

NAMESPACE = b"sglang-hicache\0"


class KVStoreHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over the local kvstore service (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not isinstance(extra.get("store"), str):
            raise ValueError('kvstore HiCache backend: the extra config must name the store: "store": "NAME"')
        self.config = storage_config
        self._store = extra["store"]
        self._server = extra.get("server")
        self._home = Path(extra["mass_home"]) if extra.get("mass_home") else None
        self._tenant = str(extra.get("tenant", ""))
        self._timeout = float(extra.get("timeout_s", 30.0))
        self._model_id = str(extra["model_id"]) if extra.get("model_id") else None
        self._clears = 0  # clear() calls: every rank of one server gets the same ones, so their keys agree
        self._attached = False  # the attach's pool registrations are over
        # SGLang's storage metrics (when it enables them): per batch, pages moved and GB/s, handed over
        # and cleared by get_stats (bounded, should nobody ask)
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._host_page_bytes = 0  # SGLang's bytes of one page (set when its host pool is registered)
        self._batches: dict[str, deque[tuple[int, float]]] = {"prefetch": deque(maxlen=100_000),
                                                              "backup": deque(maxlen=100_000)}
        self._local = threading.local()
        self._clients: list[KVCacheClient] = []
        self._clients_lock = threading.Lock()
        self.page_bytes = self._client().page_size  # fails at start, with kvstore's reason, if no service
        self._prefix = b""
        self.mem_pool_host: Any = None

    # ---- connections: one per calling thread (SGLang's prefetch and backup threads) ------------
    def _client(self) -> KVCacheClient:
        c: KVCacheClient | None = getattr(self._local, "client", None)
        if c is None:
            c = KVCacheClient.connect(self._store, server=self._server, home=self._home, timeout=self._timeout,
                                      tenant=self._tenant)
            self._local.client = c
            with self._clients_lock:
                self._clients.append(c)
        return c

    def _reset(self) -> None:
        c = getattr(self._local, "client", None)
        self._local.client = None
        if c is not None:
            try:
                c.close()
            except KVStoreError:
                pass

    # ---- host pool -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        tokens = int(mem_pool_host.page_size)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(tokens))
        need = int(sum(sizes))
        if need > self.page_bytes:
            raise ValueError(f"kvstore HiCache backend: one SGLang page ({tokens} tokens) is {need} bytes, but store "
                             f"{self._store!r} has {self.page_bytes}-byte pages: create a store with --page-size "
                             f">= {need} (a multiple of 4 KiB)")
        tip = advice(f"an SGLang page ({tokens} tokens)", need, self.page_bytes)
        if tip:
            log.warning("kvstore HiCache backend: %s", tip)
        self.tokens_per_page = tokens
        self._sizes = [int(s) for s in sizes]
        self._host_page_bytes = need
        self._set_prefix()

    def _set_prefix(self) -> None:
        cfg, pool = self.config, self.mem_pool_host
        ranks = [] if cfg.is_mla_model else [cfg.tp_rank, cfg.tp_size]
        fields: list[Any] = [
            self._model_id or cfg.model_name or "", bool(cfg.is_mla_model), ranks, cfg.pp_rank, cfg.pp_size,
            cfg.attn_cp_rank, cfg.attn_cp_size, getattr(cfg, "dcp_rank", 0), getattr(cfg, "dcp_size", 1),
            type(pool).__name__, str(pool.layout), str(pool.dtype), self.tokens_per_page, self._sizes]
        if self._clears:
            fields.append(self._clears)
        self._prefix = NAMESPACE + msgpack.packb(fields) + b"\0"

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if self._attached and host_pool is not self.mem_pool_host and str(host_pool_name) != "kv":
            raise ValueError(self._refusal([host_pool_name]))  # a sidecar added while running

    def on_host_pools_registered(self) -> None:
        """The attach's pools are all registered: refuse any the v1 calls cannot move (SGLang
        fails the attach with this error)."""
        extra = [name for name, pool in (getattr(self, "registered_pools", None) or {}).items()
                 if pool is not self.mem_pool_host and str(name) != "kv"]
        if extra:
            raise ValueError(self._refusal(extra))
        self._attached = True

    def _refusal(self, names: list[Any]) -> str:
        return (f"kvstore HiCache backend: this model's host pools include {sorted(str(n) for n in names)} "
                "(sliding-window, Mamba or indexer state of a hybrid model, or a speculative draft model's "
                "pool), which SGLang moves with "
                "batch_*_v2; kvstore stores full-attention KV pages only (batch_*_v1). Run this model "
                "without --hicache-storage-backend kvstore")

    def _keys(self, keys: list[str]) -> list[bytes]:
        if not self._prefix:
            raise RuntimeError("kvstore HiCache backend: no host pool registered yet")
        return [self._prefix + k.encode() for k in keys]

    def _pieces(self, host_indices: torch.Tensor, n: int) -> list[list[tuple[int, int]]]:
        """Per page: (address, bytes) of its pieces in the host pool."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices[:n * self.tokens_per_page])
        per = len(ptrs) // n
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(n)]

    # ---- zero-copy path (interface_v1) -----------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            return self._client().lookup(self._keys(keys))
        except KVStoreError as e:
            log.warning("kvstore HiCache backend: lookup failed: %s", e)
            self._reset()
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        targets = self._pieces(host_indices, len(keys))
        pkeys = self._keys(keys)
        try:
            c = self._client()
            t0 = time.perf_counter()
            # half a lease at a time, two in flight: the next half is filled while the last is
            # written (a whole lease filled, then waited for, left the device idle during each fill)
            step = max(1, c.max_batch // 2)
            pending: list[Any] = []
            done: list[Any] = []
            for s in range(0, len(keys), step):
                # one copy: from SGLang's host pool straight into the buffers the device is written from
                with c.reserve(min(step, len(keys) - s)) as res:
                    for j in range(len(res)):
                        base = np.frombuffer(res[j], np.uint8).ctypes.data
                        off = 0
                        for addr, size in targets[s + j]:
                            ctypes.memmove(base + off, addr, size)
                            off += size
                        ctypes.memset(base + off, 0, self.page_bytes - off)  # nothing of an earlier page
                    pending.append(res.commit_async(pkeys[s:s + len(res)]))
                if len(pending) == 2:
                    done.append(pending.pop(0).result())
            done += [p.result() for p in pending]
            stored = sum(r.stored for r in done)
            skipped = sum(r.skipped for r in done)
            dropped = sum(r.dropped for r in done)
            self._record("backup", stored, t0)  # pages written (a page already stored moves nothing)
            if dropped == 0 and stored + skipped == len(keys):
                return [True] * len(keys)
            return c.contains(pkeys)  # some were dropped: say which are there
        except KVStoreError as e:
            log.warning("kvstore HiCache backend: write-back failed: %s", e)
            self._reset()
            return [False] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        out = [False] * len(keys)
        targets = self._pieces(host_indices, len(keys))
        pkeys = self._keys(keys)
        t0 = time.perf_counter()
        try:
            c = self._client()
            for s, views in c.get_many(pkeys):  # pipelined: later pages are read while these are copied
                for j, v in enumerate(views):
                    if v is None:
                        continue
                    src = np.frombuffer(v, np.uint8).ctypes.data
                    off = 0
                    for addr, size in targets[s + j]:
                        ctypes.memmove(addr, src + off, size)
                        off += size
                    out[s + j] = True
        except KVStoreError as e:
            log.warning("kvstore HiCache backend: prefetch failed: %s", e)
            self._reset()
        self._record("prefetch", sum(out), t0)
        return out

    def _record(self, kind: str, pages: int, t0: float) -> None:
        if self._metrics and pages:
            dt = time.perf_counter() - t0
            # SGLang's bytes of a page, not the store's padded page
            self._batches[kind].append((pages, pages * self._host_page_bytes / dt / 1e9 if dt > 0 else 0.0))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call: pages and GB/s of every prefetch and
        backup batch of the zero-copy calls (None unless SGLang enabled storage metrics)."""
        if not self._metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # another SGLang layout: no metrics rather than an error in its flush
            return None

        m = StorageMetrics()
        for kind, pgs, bw in (("prefetch", m.prefetch_pgs, m.prefetch_bandwidth),
                              ("backup", m.backup_pgs, m.backup_bandwidth)):
            q = self._batches[kind]
            while q:
                n, gbps = q.popleft()
                pgs.append(n)
                bw.append(gbps)
        return m

    # ---- the older tensor-per-page interface --------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        pages = []
        for v in values or []:
            raw = v.contiguous().view(torch.uint8).numpy().reshape(-1)
            if raw.nbytes > self.page_bytes:
                log.warning("kvstore HiCache backend: a %d-byte value exceeds the store's page size", raw.nbytes)
                return False
            page = np.zeros(self.page_bytes, np.uint8)
            page[:raw.nbytes] = raw
            pages.append(page)
        try:
            r = self._client().put(self._keys(keys), pages, wait=True)
        except KVStoreError as e:
            log.warning("kvstore HiCache backend: set failed: %s", e)
            self._reset()
            return False
        return r.dropped == 0 and r.stored + r.skipped == len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        out: list[Any] = [None] * len(keys)
        targets = list(target_locations or [None] * len(keys))
        try:
            c = self._client()
            pkeys = self._keys(keys)
            for s, views in c.get_many(pkeys):  # pipelined, as batch_get_v1
                for j, v in enumerate(views):
                    if v is None:
                        continue
                    t = targets[s + j]
                    if t is None or not t.is_contiguous():
                        continue  # nowhere to put it in place (SGLang passes flat contiguous pages)
                    dst = t.view(torch.uint8).view(-1).numpy()  # the target itself, never a copy
                    dst[:] = np.frombuffer(v, np.uint8)[:dst.size]
                    out[s + j] = t
        except KVStoreError as e:
            log.warning("kvstore HiCache backend: get failed: %s", e)
            self._reset()
        return out

    def clear(self) -> None:
        """Invalidate every page this backend saved or could load, in O(1): its keys move to a
        fresh namespace (see the module docstring for its scope)."""
        self._clears += 1
        if self._prefix:
            self._set_prefix()
        log.info("kvstore HiCache backend: cleared; keys are under a fresh namespace")

    def close(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for c in clients:
            try:
                c.close()
            except KVStoreError:
                pass


__all__ = ["KVStoreHiCacheStorage"]
