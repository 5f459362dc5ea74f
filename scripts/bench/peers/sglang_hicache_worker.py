"""Run inside SGLang's environment (.venv-sglang) by scripts/bench/sglang_hicache.py.

One backend, one round: builds SGLang's CPU KV pool and host pool, fills the host pool with
random bytes, backs ``--pages`` pages up and prefetches them back into the zeroed pool, in
batches of SGLang's ``STORAGE_BATCH_SIZE``, with the calls SGLang's ``HiCacheController``
makes: for a backend with the zero-copy interface (kvstore) ``batch_set_v1`` /
``batch_get_v1`` on host indices (``_page_set_zero_copy``, ``_page_get_zero_copy``); for
one without (``HiCacheFile``) a page tensor per page out of the host pool and
``batch_set``, then ``batch_get`` into dummy flat pages and ``set_from_flat_data_page``
(``_generic_page_set``, ``_generic_page_get``). Every byte is compared afterwards (outside
the timed parts). Prints one JSON line of seconds and counts.

For ``file``, the backup is timed to the end of ``batch_set`` (page cache) and, separately,
to the end of an ``fsync`` of every file (durable); the prefetch runs twice: from the device
(every file's pages dropped from the page cache first, ``posix_fadvise(DONTNEED)``) and from
the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("backend", choices=["kvstore", "file"])
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-tokens", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--store", default="")
    ap.add_argument("--home", default="")
    ap.add_argument("--dir", default="")
    a = ap.parse_args()
    page = a.page_tokens
    tokens = a.pages * page
    kv = MHATokenToKVPool(size=tokens, page_size=page, dtype=torch.float16, head_num=a.heads, head_dim=a.head_dim,
                          layer_num=a.layers, device="cpu", enable_memory_saver=False, start_layer=0,
                          end_layer=a.layers - 1)
    pool = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, page, "page_first",
                                pin_memory=False, device_capacity_tokens=kv.size, start_layer=kv.start_layer,
                                end_layer=kv.end_layer, write_back_staging=kv.hicache_write_back_staging)
    extra: dict[str, object] = {"file_storage_path": a.dir} if a.backend == "file" else {
        "backend_name": "kvstore", "module_path": "kvstore.engines.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "store": a.store, "mass_home": a.home}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench-model", extra_config=extra)
    b = StorageBackendFactory.create_backend("dynamic" if a.backend == "kvstore" else "file", cfg, pool)
    b.register_mem_pool_host(pool)
    if hasattr(b, "on_host_pools_registered"):
        b.on_host_pools_registered()
    idx = pool.alloc(tokens)
    assert idx is not None
    raw = pool.kv_buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(a.round)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def pages_now() -> list[torch.Tensor]:
        # as bytes: random bytes as fp16 hold NaNs, which never compare equal
        return [pool.get_data_page(int(idx[i * page]), flat=True).contiguous().view(torch.uint8).clone()
                for i in range(a.pages)]

    ref = pages_now()
    keys = [f"r{a.round}-page-{i}" for i in range(a.pages)]
    v1 = a.backend == "kvstore"
    out: dict[str, object] = {"backend": type(b).__name__, "page_bytes": int(pool.get_data_page(int(idx[0]),
                                                                                                 flat=True).numel()
                                                                              * pool.dtype.itemsize)}

    def batches() -> list[tuple[list[str], torch.Tensor]]:
        return [(keys[i:i + STORAGE_BATCH_SIZE], idx[i * page:(i + STORAGE_BATCH_SIZE) * page])
                for i in range(0, a.pages, STORAGE_BATCH_SIZE)]

    t0 = time.perf_counter()
    ok = True
    for ks, hi in batches():
        if v1:
            ok &= all(b.batch_set_v1(ks, hi))
        else:
            ok &= bool(b.batch_set(ks, [pool.get_data_page(int(hi[i * page])) for i in range(len(ks))]))
    out["backup_s"] = time.perf_counter() - t0
    out["backup_ok"] = ok
    files: list[str] = []
    if not v1:
        files = [os.path.join(b.file_path, f"{b._get_suffixed_key(k)}.bin") for k in keys]
        t1 = time.perf_counter()
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        out["backup_durable_s"] = out["backup_s"] + time.perf_counter() - t1  # type: ignore[operator]

    def prefetch(label: str) -> None:
        raw.zero_()
        t = time.perf_counter()
        got = 0
        for ks, hi in batches():
            if v1:
                res = b.batch_get_v1(ks, hi)
                got += sum(1 for r in res if r)
            else:
                data = b.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
                for i, d in enumerate(data or []):
                    if d is not None:
                        pool.set_from_flat_data_page(int(hi[i * page]), d)
                        got += 1
        out[f"{label}_s"] = time.perf_counter() - t
        out[f"{label}_pages"] = got
        bad = [i for i, (x, y) in enumerate(zip(pages_now(), ref)) if not torch.equal(x, y)]
        out[f"{label}_equal"] = not bad
        if bad:
            out[f"{label}_bad"] = bad[:20]

    if not v1:
        for f in files:  # from the device: none of these pages in the page cache
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    prefetch("prefetch")
    if not v1:
        prefetch("prefetch_cached")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
