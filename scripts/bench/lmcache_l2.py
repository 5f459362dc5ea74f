#!/usr/bin/env python3
"""kvstore as LMCache's L2, against LMCache's own file-system adapter, in LMCache's own harness.

    .venv/bin/python scripts/bench/lmcache_l2.py --rounds 3 --json docs/bench/lmcache_l2.json

Alternates, ``--rounds`` times, ``lmcache bench l2 --no-skip-verify`` (from .venv-lmcache)
with kvstore's plugin adapter (a fresh store on a file device under ``--dir``, 256 KiB pages)
and with LMCache's ``fs`` adapter (a directory under the same ``--dir``): 32 keys x 4 in
flight x 5 rounds of 256 KB objects. Reports median store and load throughput of each and
the ratios. Caveat printed with the figures: the fs adapter writes and reads through the
page cache (its loads come from memory), kvstore with O_DIRECT from the device.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from kvstore.testing import ServiceProcess, make_store, script_args, write_record

LMCACHE = ROOT / ".venv-lmcache" / "bin" / "lmcache"


def bench(spec: dict[str, object], out: Path, home: Path) -> dict[str, float]:
    env = dict(os.environ, MASS_HOME=str(home), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
               LMCACHE_DISABLE_BANNER="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([str(LMCACHE), "bench", "l2", "--l2-adapter", json.dumps(spec), "--no-skip-verify",
                        "--data-size-kb", "256", "--num-keys", "32", "--in-flight", "4", "--rounds", "5",
                        "--format", "json", "--output", str(out)], env=env, capture_output=True, text=True,
                       timeout=600, cwd="/")
    if r.returncode or "verified OK" not in r.stdout + r.stderr:
        raise SystemExit(f"lmcache bench l2 failed ({spec['type']}):\n{(r.stdout + r.stderr)[-3000:]}")
    m = json.loads(out.read_text())["metrics"]
    ops = {o["operation"]: o for k, o in m.items() if k.startswith("op_")}
    for op in ("Store", "Load"):
        if ops[op]["total_success"] != ops[op]["total_keys"]:
            raise SystemExit(f"{spec['type']}: {op} succeeded for {ops[op]['total_success']}/{ops[op]['total_keys']}")
    return {"store_mbps": ops["Store"]["throughput_avg_mbps"], "load_mbps": ops["Load"]["throughput_avg_mbps"]}


def main() -> None:
    ap = script_args(__doc__, raw=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the device file and fs directory go")
    a = ap.parse_args()
    if not LMCACHE.exists():
        raise SystemExit(f"{LMCACHE} missing: run scripts/setup")
    work = Path(tempfile.mkdtemp(prefix="kvbench-lmcache-", dir=a.dir))
    runs: dict[str, list[dict[str, float]]] = {"kvstore": [], "fs": []}
    try:
        dev = work / "dev.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 1024 * (4096 + (256 << 10)))
        for r in range(a.rounds):
            home = work / f"mass{r}"
            make_store(home, "lb", [str(dev)], 256 << 10, force=True)
            with ServiceProcess(home, "lb"):
                runs["kvstore"].append(bench({"type": "plugin", "module_path": "kvstore.engines.lmcache",
                                              "class_name": "KVStoreL2Adapter",
                                              "adapter_params": {"store": "lb", "mass_home": str(home)}},
                                             work / "kv.json", home))
            fs = work / "fs"
            shutil.rmtree(fs, ignore_errors=True)
            fs.mkdir()
            runs["fs"].append(bench({"type": "fs", "base_path": str(fs)}, work / "fs.json", home))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("store_mbps", "load_mbps")} for k, v in runs.items()}
    res = {"runs": runs, "median": med,
           "store_ratio": med["kvstore"]["store_mbps"] / med["fs"]["store_mbps"],
           "load_ratio": med["kvstore"]["load_mbps"] / med["fs"]["load_mbps"],
           "note": "fs adapter: page cache (loads from memory); kvstore: O_DIRECT on a file device, same filesystem"}
    for k in ("kvstore", "fs"):
        print(f"{k:8s} store {med[k]['store_mbps']:7.0f} MB/s  load {med[k]['load_mbps']:7.0f} MB/s  (medians of "
              f"{a.rounds})")
    print(f"kvstore / fs: store {res['store_ratio']:.2f}x, load {res['load_ratio']:.2f}x ({res['note']})")
    write_record(a.json, res, a)


if __name__ == "__main__":
    main()
