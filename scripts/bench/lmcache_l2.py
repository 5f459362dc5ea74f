#!/usr/bin/env python3
"""kvstore as LMCache's L2, against LMCache's own storage adapters, in LMCache's own harness.

    .venv/bin/python scripts/bench/lmcache_l2.py --rounds 3 --json docs/bench/lmcache_l2.json

For each object size (``--sizes-kb``, default 256 and 2048) and ``--rounds`` times, alternates
``lmcache bench l2 --no-skip-verify`` (from .venv-lmcache; 32 keys x 4 in flight x 5 rounds: 640 objects)
over four adapters, each on a fresh file under ``--dir`` (one file system for all), with L1 buffers
4096-aligned for all (``--l1-align-bytes 4096``, which LMCache asks for with O_DIRECT backends):

* ``kvstore``: kvstore's plugin adapter, a fresh store whose page size is the object size
  (``--client-buffers``: its page buffers per connection);
* ``fs_native_odirect``: LMCache's C++ file adapter with ``use_odirect: true``;
* ``raw_block``: LMCache's raw-block adapter on a pre-sized file (O_DIRECT, its default);
* ``fs``: LMCache's Python file adapter (through the page cache: its loads come from memory).

Reports the median store and load throughput of each and kvstore's ratio to each, and the
median of the harness's own p50 lookup-and-lock round (4 tasks of 32 keys in flight). With
``--qd1`` each run is one object in flight, one key, 20 rounds (``--qd1-rounds``) instead: the p50 store, load
and lookup round of a single object (queue depth 1). What
``--no-skip-verify`` checks is weak (the last round only, one byte pattern per key index):
correctness is shown by tests/engines/lmcache_verify_keys.py, not by this benchmark.
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

from kvstore.config import ServiceConfig
from kvstore.testing import ServiceProcess, make_store, script_args, write_record

LMCACHE = ROOT / ".venv-lmcache" / "bin" / "lmcache"
ADAPTERS = ("kvstore", "fs_native_odirect", "raw_block", "fs")
KEYS, IN_FLIGHT, ROUNDS = 32, 4, 5  # per bench run: KEYS x IN_FLIGHT objects a round, each a fresh key


SHAPE = {"keys": KEYS, "in_flight": IN_FLIGHT, "rounds": ROUNDS}  # --qd1: 1 key, 1 in flight, 20 rounds


def bench(spec: dict[str, object], out: Path, home: Path, size_kb: int) -> dict[str, float]:
    env = dict(os.environ, MASS_HOME=str(home), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
               LMCACHE_DISABLE_BANNER="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([str(LMCACHE), "bench", "l2", "--l2-adapter", json.dumps(spec), "--no-skip-verify",
                        "--data-size-kb", str(size_kb), "--num-keys", str(SHAPE["keys"]), "--in-flight",
                        str(SHAPE["in_flight"]), "--rounds", str(SHAPE["rounds"]), "--l1-align-bytes", "4096", "--format", "json", "--output", str(out)], env=env, capture_output=True,
                       text=True, timeout=900, cwd="/")
    if r.returncode or "verified OK" not in r.stdout + r.stderr:
        raise SystemExit(f"lmcache bench l2 failed ({spec['type']}):\n{(r.stdout + r.stderr)[-3000:]}")
    m = json.loads(out.read_text())["metrics"]
    ops = {o["operation"]: o for k, o in m.items() if k.startswith("op_")}
    for op in ("Store", "Load"):
        if ops[op]["total_success"] != ops[op]["total_keys"]:
            raise SystemExit(f"{spec['type']}: {op} succeeded for {ops[op]['total_success']}/{ops[op]['total_keys']}")
    return {"store_mbps": ops["Store"]["throughput_avg_mbps"], "load_mbps": ops["Load"]["throughput_avg_mbps"],
            "store_p50_ms": ops["Store"]["duration_p50_ms"], "load_p50_ms": ops["Load"]["duration_p50_ms"],
            "lookup_p50_ms": ops["Lookup"]["duration_p50_ms"]}


def sparse(path: Path, size: int) -> Path:
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


CLIENT_BUFFERS = 64  # kvstore's lease per connection (service.client_buffers): --client-buffers


def one(adapter: str, work: Path, size_kb: int, r: int) -> dict[str, float]:
    """One bench run of ``adapter`` on fresh files under ``work``."""
    obj = size_kb << 10
    objects = SHAPE["keys"] * SHAPE["in_flight"] * SHAPE["rounds"]  # all stay loadable: room for all, and a quarter
    home = work / f"mass-{size_kb}-{r}"
    if adapter == "kvstore":
        dev = sparse(work / "kv.img", (1 << 20) + objects * 5 // 4 * (4096 + obj))
        make_store(home, "lb", [str(dev)], obj, force=True, service=ServiceConfig(client_buffers=CLIENT_BUFFERS,
                                                                                    max_clients=min(16, 1024 // CLIENT_BUFFERS)))
        with ServiceProcess(home, "lb"):
            return bench({"type": "plugin", "module_path": "kvstore.engines.lmcache", "class_name": "KVStoreL2Adapter",
                          "adapter_params": {"store": "lb", "mass_home": str(home)}}, work / "out.json", home, size_kb)
    if adapter == "raw_block":
        meta = 16 << 20
        slot = 4096 + obj
        dev = sparse(work / "raw.img", meta + objects * 5 // 4 * slot)
        return bench({"type": "raw_block", "device_path": str(dev), "slot_bytes": slot, "meta_total_bytes": meta},
                     work / "out.json", home, size_kb)
    d = work / adapter
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    spec: dict[str, object] = {"type": "fs", "base_path": str(d)} if adapter == "fs" else \
        {"type": "fs_native", "base_path": str(d), "use_odirect": True}
    return bench(spec, work / "out.json", home, size_kb)


def main() -> None:
    ap = script_args(__doc__, raw=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes-kb", type=int, nargs="+", default=[256, 2048], help="object sizes (KiB)")
    ap.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the device files and directories go")
    ap.add_argument("--qd1", action="store_true", help="one object in flight, one key, 20 rounds: latencies")
    ap.add_argument("--qd1-rounds", type=int, default=20,
                    help="rounds of a --qd1 run (the first few carry each process's warm-up: 300 shows the "
                         "steady state)")
    ap.add_argument("--client-buffers", type=int, default=64,
                    help="kvstore's page buffers per connection (service.client_buffers; its default: 64)")
    a = ap.parse_args()
    global CLIENT_BUFFERS
    CLIENT_BUFFERS = a.client_buffers
    if a.qd1:
        if a.qd1_rounds < 1:
            raise SystemExit(f"--qd1-rounds must be at least 1, got {a.qd1_rounds}")
        SHAPE.update(keys=1, in_flight=1, rounds=a.qd1_rounds)
    if not LMCACHE.exists():
        raise SystemExit(f"{LMCACHE} missing: run scripts/setup")
    if "raw_block" in a.adapters and subprocess.run([str(LMCACHE.parent / "python"), "-c",
                                                     "import lmcache_rust_raw_block_io"], capture_output=True).returncode:
        raise SystemExit("LMCache's raw_block adapter needs its Rust extension, which scripts/setup does not install "
                         "(the tests do not use it): .venv-lmcache/bin/pip install --pre lmcache-rust-raw-block-io "
                         "(or leave raw_block out: --adapters kvstore fs_native_odirect fs)")
    work = Path(tempfile.mkdtemp(prefix="kvbench-lmcache-", dir=a.dir))
    res: dict[str, object] = {}
    try:
        for size in a.sizes_kb:
            runs: dict[str, list[dict[str, float]]] = {k: [] for k in a.adapters}
            for r in range(a.rounds):  # interleaved: each round runs every adapter once
                for k in a.adapters:
                    runs[k].append(one(k, work, size, r))
            fields = ("store_mbps", "load_mbps", "store_p50_ms", "load_p50_ms", "lookup_p50_ms")
            med = {k: {m: statistics.median(x[m] for x in v) for m in fields} for k, v in runs.items()}
            ratios = {k: {m: med["kvstore"][m] / med[k][m] for m in fields}
                      for k in a.adapters if k != "kvstore" and "kvstore" in med}
            res[f"{size}KiB"] = {"shape": dict(SHAPE), "runs": runs, "median": med, "kvstore_ratio": ratios}
            print(f"{size} KiB objects, {SHAPE['keys']} keys x {SHAPE['in_flight']} in flight, medians of {a.rounds}:")
            for k in a.adapters:
                m = med[k]
                print(f"  {k:18s} store {m['store_mbps']:7.0f} MB/s  load {m['load_mbps']:7.0f} MB/s   p50 round: "
                      f"store {m['store_p50_ms']:.2f} ms  load {m['load_p50_ms']:.2f} ms  lookup {m['lookup_p50_ms']:.3f} ms")
            for k, q in ratios.items():
                print(f"  kvstore / {k:18s} store {q['store_mbps']:.2f}x  load {q['load_mbps']:.2f}x   p50 round: "
                      f"store {q['store_p50_ms']:.2f}x  load {q['load_p50_ms']:.2f}x  lookup {q['lookup_p50_ms']:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["note"] = ("fs: page cache (its loads come from memory); fs_native_odirect, raw_block and kvstore: O_DIRECT "
                   "on files of the same file system")
    write_record(a.json, res, a)


if __name__ == "__main__":
    main()
