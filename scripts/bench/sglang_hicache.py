#!/usr/bin/env python3
"""kvstore as SGLang's HiCache storage backend, against SGLang's own ``HiCacheFile``, through
the calls SGLang's ``HiCacheController`` makes.

    .venv/bin/python scripts/bench/sglang_hicache.py --rounds 3 --json docs/bench/sglang_hicache.json

Each round runs ``peers/sglang_hicache_worker.py`` in .venv-sglang once per backend (kvstore:
a fresh store on a file under ``--dir``, page size = SGLang's page; HiCacheFile: a fresh
directory on the same file system): ``--pages`` pages of SGLang's CPU host pool
(``MHATokenToKVPoolHost``, page-first layout, fp16; the default shape is 64 tokens x 8 KV heads
x 128 x 3 layers = 768 KiB a page) backed up and prefetched back in SGLang's storage batches,
every byte compared. Reports medians (GB/s of SGLang's page bytes) and kvstore's ratios:
prefetch against HiCacheFile reading from the device (its files dropped from the page cache
first) and from the page cache; backup against HiCacheFile's ``batch_set`` alone (it leaves the
pages in the page cache) and with an ``fsync`` of every file (durable, as kvstore's O_DIRECT
writes are once ``batch_set_v1`` returns).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from kvstore.testing import ServiceProcess, make_store, script_args, write_record

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
WORKER = Path(__file__).parent / "peers" / "sglang_hicache_worker.py"


def run(backend: str, a, work: Path, r: int) -> dict:  # type: ignore[no-untyped-def]
    shape = ["--pages", str(a.pages), "--page-tokens", str(a.page_tokens), "--heads", str(a.heads),
             "--head-dim", str(a.head_dim), "--layers", str(a.layers), "--round", str(r)]
    page_bytes = a.page_tokens * a.heads * a.head_dim * a.layers * 2 * 2
    env = dict(os.environ, PYTHONWARNINGS="ignore", SGLANG_LOG_LEVEL="error")
    if backend == "kvstore":
        home = work / f"mass-{r}"
        dev = work / "kv.img"
        dev.unlink(missing_ok=True)
        with open(dev, "wb") as f:
            f.truncate((4 << 20) + a.pages * 5 // 4 * (4096 + (page_bytes + 4095) // 4096 * 4096))
        make_store(home, "sgb", [str(dev)], (page_bytes + 4095) // 4096 * 4096, force=True)
        with ServiceProcess(home, "sgb"):
            p = subprocess.run([str(PYTHON), str(WORKER), "kvstore", *shape, "--store", "sgb", "--home", str(home)],
                               capture_output=True, text=True, timeout=1200, env=dict(env, MASS_HOME=str(home)))
        shutil.rmtree(home, ignore_errors=True)
        dev.unlink(missing_ok=True)
    else:
        d = work / "hicache"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        p = subprocess.run([str(PYTHON), str(WORKER), "file", *shape, "--dir", str(d)], capture_output=True, text=True,
                           timeout=1200, env=env)
        shutil.rmtree(d, ignore_errors=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"{backend} worker failed:\n{(p.stdout + p.stderr)[-3000:]}")
    out = json.loads(lines[-1])
    gb = a.pages * out["page_bytes"] / 1e9
    for k in [k for k in out if k.endswith("_s")]:
        out[k.replace("_s", "_gbps")] = gb / out[k]
    for k in [k for k in out if k.endswith("_equal") or k == "backup_ok"]:
        if not out[k]:
            raise SystemExit(f"{backend}: {k} is false (round {r}): {out}")
    return out


def main() -> None:
    ap = script_args(__doc__, raw=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="file system of the store's device and the files")
    a = ap.parse_args()
    if not PYTHON.exists():
        raise SystemExit(f"{PYTHON} missing: run scripts/setup")
    work = Path(tempfile.mkdtemp(prefix="kvbench-sglang-", dir=a.dir))
    runs: dict[str, list[dict]] = {"kvstore": [], "file": []}
    try:
        for r in range(a.rounds):  # interleaved
            for b in runs:
                runs[b].append(run(b, a, work, r))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {b: {k: statistics.median(x[k] for x in v) for k in v[0] if k.endswith("_gbps")} for b, v in runs.items()}
    kv, f = med["kvstore"], med["file"]
    ratios = {"prefetch_vs_file_device": kv["prefetch_gbps"] / f["prefetch_gbps"],
              "prefetch_vs_file_page_cache": kv["prefetch_gbps"] / f["prefetch_cached_gbps"],
              "backup_vs_file_page_cache": kv["backup_gbps"] / f["backup_gbps"],
              "backup_vs_file_durable": kv["backup_gbps"] / f["backup_durable_gbps"]}
    page_kib = runs["kvstore"][0]["page_bytes"] >> 10
    print(f"{a.pages} pages of {page_kib} KiB, medians of {a.rounds} (GB/s):")
    print(f"  kvstore      backup {kv['backup_gbps']:.2f}   prefetch {kv['prefetch_gbps']:.2f}")
    print(f"  HiCacheFile  backup {f['backup_gbps']:.2f} (page cache) {f['backup_durable_gbps']:.2f} (fsync'd)   "
          f"prefetch {f['prefetch_gbps']:.2f} (device) {f['prefetch_cached_gbps']:.2f} (page cache)")
    for k, v in ratios.items():
        print(f"  kvstore / HiCacheFile {k:28s} {v:.2f}x")
    write_record(a.json, {"page_bytes": runs["kvstore"][0]["page_bytes"], "runs": runs, "median": med,
                          "kvstore_ratio": ratios}, a)


if __name__ == "__main__":
    main()
