#!/usr/bin/env python3
"""Time to first token, cold versus prefix served by kvstore, with a random-weight Llama on this CPU.

    .venv/bin/python scripts/bench/ttft.py --json docs/bench/ttft.json

The model (Llama architecture, grouped-query attention, seeded random weights,
no download) is sized so that a 4,096-token prefill takes over a second here.
For each shared-prefix length (default 1,024 / 4,096 / 8,192 tokens) plus a
32-token new question it measures, median of ``--repeat`` runs:

* cold: prefill of the whole prompt, then the first token (argmax);
* warm: the prefix's K/V loaded through the client library from the local
  service, prefill of the question only, first token;
* warm, other server: the prefix was saved through server A and is loaded
  through server B of the same store (replicated locations, shared device).

Each warm first token is checked against the cold one. Two services run on
file-backed devices in a temporary MASS_HOME and are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


import torch
import transformers

from kvstore import KVCacheClient
from kvstore.engines.transformers import KVStoreCache, prefill
from kvstore.testing import ServiceProcess, free_port_pair, make_store, script_args, write_record

PAGE_TOKENS = 64
QUESTION = 32


def model_for_bench() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
    return transformers.LlamaForCausalLM(cfg).eval()




def first_token(model: Any, ids: Any, kv: KVStoreCache | None) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    logits, _, n = prefill(model, ids, kv)
    tok = int(logits[0, -1].argmax())
    return time.perf_counter() - t0, tok, n


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--shared", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = model_for_bench()
    cfg = model.config
    page_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * PAGE_TOKENS * (cfg.hidden_size // cfg.num_attention_heads) * 4
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-ttft-", dir="/var/tmp"))
    svcs: list[ServiceProcess] = []
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
                               "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                                         "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                                         "dtype": "float32"},
                               "page_tokens": PAGE_TOKENS, "runs": []}
    try:
        pages_needed = sum(a.shared) // PAGE_TOKENS + 64
        dev = tmp / "dev.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * pages_needed * (4096 + page_bytes))
        make_store(tmp, "ttft", [str(dev)], page_bytes, [f"a=127.0.0.1:{free_port_pair()}",
                                                        f"b=127.0.0.1:{free_port_pair()}"])
        svcs = [ServiceProcess(tmp, "ttft", "a").start(), ServiceProcess(tmp, "ttft", "b").start()]
        with KVCacheClient.connect("ttft", home=tmp, server="a") as ca, \
                KVCacheClient.connect("ttft", home=tmp, server="b") as cb:
            kva = KVStoreCache(ca, model, page_tokens=PAGE_TOKENS, model_id="bench-llama@seed0")
            kvb = KVStoreCache(cb, model, page_tokens=PAGE_TOKENS, model_id="bench-llama@seed0")
            results["kv_bytes_per_token"] = kva.bytes_per_token
            for shared in a.shared:
                g = torch.Generator().manual_seed(shared)
                doc = torch.randint(0, 4096, (1, shared), generator=g)
                cold, warm, other = [], [], []
                for r in range(a.repeat):
                    q = torch.randint(0, 4096, (1, QUESTION), generator=g)
                    ids = torch.cat([doc, q], dim=1)
                    t, tok_cold, n = first_token(model, ids, None)
                    cold.append(t)
                    if r == 0:  # save the shared document's pages through server a
                        _, cache, _ = prefill(model, doc)
                        kva.save(doc, cache, wait=True)
                        deadline = time.monotonic() + 30
                        while kvb.lookup(doc) < shared and time.monotonic() < deadline:
                            time.sleep(0.01)
                    t, tok, n = first_token(model, ids, kva)
                    assert n == shared and tok == tok_cold, (n, tok, tok_cold)
                    warm.append(t)
                    t, tok, n = first_token(model, ids, kvb)
                    assert n == shared and tok == tok_cold, (n, tok, tok_cold)
                    other.append(t)
                row = {"shared_tokens": shared, "question_tokens": QUESTION,
                       "cold_s": statistics.median(cold), "warm_s": statistics.median(warm),
                       "warm_other_server_s": statistics.median(other),
                       "kv_bytes_loaded": shared * kva.bytes_per_token}
                row["warm_over_cold"] = row["warm_s"] / row["cold_s"]
                row["warm_other_over_cold"] = row["warm_other_server_s"] / row["cold_s"]
                results["runs"].append(row)
                print(f"{shared:>6} shared + {QUESTION} new: cold {row['cold_s']:.3f} s, warm {row['warm_s']:.3f} s "
                      f"({row['warm_over_cold']:.3f}x), warm from server B {row['warm_other_server_s']:.3f} s "
                      f"({row['warm_other_over_cold']:.3f}x); {row['kv_bytes_loaded'] / 2**20:.0f} MiB of KV loaded")
        print(f"KV bytes per token: {results['kv_bytes_per_token']}")
    finally:
        for s in svcs:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    write_record(a.json, results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
