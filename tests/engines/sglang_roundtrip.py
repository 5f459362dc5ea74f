"""Run inside SGLang's environment (.venv-sglang) by tests/engines/test_sglang_real.py.

Builds SGLang's own CPU KV pools (``MHATokenToKVPool`` and its host pool
``MHATokenToKVPoolHost``), loads the kvstore backend through SGLang's
``StorageBackendFactory`` ("dynamic"), registers the host pool as HiCache's controller
does, then either writes N random pages (``write``), then clears (SGLang's
``/hicache/storage-backend/clear``) and looks them up again, or reads them back into a
fresh host pool (``read``), or registers a hybrid model's extra pool the way SGLang's
``HybridCacheController.attach_storage_backend`` does (``hybrid``). Prints one JSON line:
what it did and the SHA-256 of every page as the host pool holds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE, HEADS, LAYERS, DIM = 16, 2, 4, 64


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    kv = MHATokenToKVPool(size=1024, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM,
                          layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
                          end_layer=LAYERS - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
                                device_capacity_tokens=kv.size, start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)


def backend(a: argparse.Namespace, pool: MHATokenToKVPoolHost, model: str = "tiny-llama", attach: bool = True,
            **extra: object) -> Any:
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=True, is_page_first_layout=pool.layout != "layer_first", model_name=model,
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.engines.sglang",
                      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "store": a.store,
                      "server": a.server, "mass_home": a.home, **({"tenant": a.tenant} if a.tenant else {}),
                      **extra})
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)  # what HiCacheController does with the backend it is given
    if attach:
        b.on_host_pools_registered()  # ... and then, once its pools are registered
    return b


def host_metrics(stats: Any) -> dict[str, Any]:
    """What the backend's get_stats handed SGLang, and SGLang's own collector taking it in (its
    Prometheus histograms: sample counts and sums)."""
    from prometheus_client import REGISTRY
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    global _collector
    if _collector is None:
        _collector = StorageMetricsCollector(labels={"storage_backend": "kvstore"})
    _collector.log_storage_metrics(stats)
    seen = {}
    for fam in REGISTRY.collect():
        for smp in fam.samples:
            if smp.name.startswith(("sglang:prefetch_pgs", "sglang:backup_pgs", "sglang:prefetch_bandwidth",
                                    "sglang:backup_bandwidth")) and smp.name.endswith(("_count", "_sum")):
                seen[smp.name] = smp.value
    return {"prefetch_pgs": stats.prefetch_pgs, "backup_pgs": stats.backup_pgs,
            "bandwidth_positive": all(x > 0 for x in stats.prefetch_bandwidth + stats.backup_bandwidth),
            "collector": seen}


_collector: Any = None


def digests(pool: MHATokenToKVPoolHost, indices: torch.Tensor, n: int) -> list[str]:
    return [hashlib.sha256(pool.get_data_page(int(indices[i * PAGE]), flat=True).contiguous().view(torch.uint8)
                           .numpy().tobytes()).hexdigest() for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "read", "hybrid"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--tenant", default="")
    a = ap.parse_args()
    keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(a.pages)]
    pool = host_pool(a.layout)
    if a.mode == "hybrid":
        # HybridCacheController: super().attach_storage_backend (factory, register_mem_pool_host), then
        # register_mem_host_pool_v2 for each host pool entry, then on_host_pools_registered
        b = backend(a, pool, attach=False)
        b.register_mem_host_pool_v2(pool, PoolName.KV)
        b.register_mem_host_pool_v2(host_pool(a.layout), PoolName.SWA)
        try:
            b.on_host_pools_registered()
            print(json.dumps({"refused": None}))
        except ValueError as e:
            print(json.dumps({"refused": str(e)}))
        return
    b = backend(a, pool)
    out: dict[str, object] = {"backend": type(b).__name__}
    idx = pool.alloc(a.pages * PAGE)
    assert idx is not None
    if a.mode == "write":
        g = torch.Generator().manual_seed(7)
        pool.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv_buffer.view(torch.uint8).shape,
                                                             dtype=torch.uint8, generator=g))
        out["exists_before"] = b.batch_exists(keys)
        out["set"] = b.batch_set_v1(keys, idx)
        out["exists_after"] = b.batch_exists(keys)
        out["backup_metrics"] = host_metrics(b.get_stats())
        out["exists_other_model_id"] = backend(a, host_pool(a.layout), model_id="tiny-llama@rev2").batch_exists(keys)
        b.clear()
        out["exists_after_clear"] = b.batch_exists(keys)
        out["set_after_clear"] = b.batch_set_v1(keys[:2], idx)
        out["exists_after_clear_and_set"] = b.batch_exists(keys)
        peer = backend(a, host_pool(a.layout))  # another rank of the same server: it gets the same clear
        peer.clear()
        out["exists_peer_after_one_clear"] = peer.batch_exists(keys)
    else:
        pool.kv_buffer.zero_()
        half = a.pages // 2
        out["exists"] = b.batch_exists(keys)
        out["exists_with_gap"] = b.batch_exists(keys[:half] + [hashlib.sha256(b"never").hexdigest()] + keys[half:])
        out["got"] = b.batch_get_v1(keys, idx)
        out["prefetch_metrics"] = host_metrics(b.get_stats())
        other = backend(a, host_pool("layer_first"))  # another layout: another key space
        out["exists_other_layout"] = other.batch_exists(keys)
        other_model = backend(a, host_pool(a.layout), model="another-model")
        out["exists_other_model"] = other_model.batch_exists(keys)
    out["digests"] = digests(pool, idx, a.pages)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
