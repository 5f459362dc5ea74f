"""Run inside SGLang's environment (.venv-sglang) by tests/engines/test_sglang_real.py.

Builds SGLang's own CPU KV pools (``MHATokenToKVPool`` and its host pool
``MHATokenToKVPoolHost``), loads the kvstore backend through SGLang's
``StorageBackendFactory`` ("dynamic"), registers the host pool as HiCache's controller
does, then either writes N random pages (``write``) or reads them back into a fresh
host pool (``read``). Prints one JSON line: what it did and the SHA-256 of every page
as the host pool holds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
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


def backend(a: argparse.Namespace, pool: MHATokenToKVPoolHost, model: str = "tiny-llama") -> object:
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first", model_name=model,
        extra_config={"backend_name": "kvstore", "module_path": "kvstore.engines.sglang",
                      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "store": a.store,
                      "server": a.server, "mass_home": a.home})
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)  # what HiCacheController does with the backend it is given
    return b


def digests(pool: MHATokenToKVPoolHost, indices: torch.Tensor, n: int) -> list[str]:
    return [hashlib.sha256(pool.get_data_page(int(indices[i * PAGE]), flat=True).contiguous().view(torch.uint8)
                           .numpy().tobytes()).hexdigest() for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "read"])
    ap.add_argument("--store", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--layout", default="page_first")
    a = ap.parse_args()
    keys = [hashlib.sha256(f"page-{i}".encode()).hexdigest() for i in range(a.pages)]
    pool = host_pool(a.layout)
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
    else:
        pool.kv_buffer.zero_()
        half = a.pages // 2
        out["exists"] = b.batch_exists(keys)
        out["exists_with_gap"] = b.batch_exists(keys[:half] + [hashlib.sha256(b"never").hexdigest()] + keys[half:])
        out["got"] = b.batch_get_v1(keys, idx)
        other = backend(a, host_pool("layer_first"))  # another layout: another key space
        out["exists_other_layout"] = other.batch_exists(keys)
        other_model = backend(a, host_pool(a.layout), model="another-model")
        out["exists_other_model"] = other_model.batch_exists(keys)
    out["digests"] = digests(pool, idx, a.pages)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
