#!/usr/bin/env python3
"""kvstore side by side with what users run instead, on one machine, in one run.

    .venv/bin/python scripts/bench/compare.py --json docs/bench/compare.json

Systems (each verified: every loaded byte is compared with what was saved):

* ``fio``: libaio + O_DIRECT on the same device file (the device's limit);
* ``kvstore``: the client library against a cache service on that device;
* ``redis``: a redis-server started here on 127.0.0.1 (persistence off),
  pipelined SET/GET with redis-py, as LMCache's remote backends do;
* ``file-buffered`` / ``file-direct``: one file per page on the device's file
  system, buffered and O_DIRECT (LMCache's local disk backend, SGLang's and
  llm-d's file tiers); buffered loads are reported twice: served by the page
  cache, and cold (dropped with ``posix_fadvise(DONTNEED)`` after a sync);
* ``mooncake``: Mooncake Store (``mooncake-transfer-engine-non-cuda``):
  ``mooncake_master`` and a storage process on 127.0.0.1, TCP transport,
  ``P2PHANDSHAKE`` metadata, ``MC_TCP_BIND_ADDRESS=127.0.0.1``, clients with
  registered buffers and ``batch_put_from``/``batch_get_into`` (the served
  mode: the data lives in another process).

``--target shm-loop`` puts kvstore's device (and fio's reference) on a memory-backed loop
device instead of a file on ``--dir`` (the setting of issue 26's Mooncake anchors: the device
is then as fast as memory, as Redis's and Mooncake's pages in RAM are); the file-per-page
systems stay on ``--dir``'s file system, so compare them only in the default ``disk-file``.

Peers are installed by this script into their own virtual environment
(``--peers-venv``, from ``scripts/bench/compare-requirements.txt``); Redis
comes from Debian's ``redis-server`` (installed with apt-get when missing and
root). A system that cannot run is reported with the reason.

For each page size and each client count, clients are processes saving and
then loading disjoint parts of ``--size`` bytes of pages in batches; they all
set up first and start their timed part together (a barrier); GB/s is the bytes
actually saved, or loaded with the right content, over the slowest client's time
(a page a system did not save or return counts as missing, in its own column,
never as bytes). Every system loads its pages in the same random order, and fio's
reference is random read, so no side reads sequentially while the other does not. Single-page load p50/p99 come from
200 loads with one client. Peak memory: the largest resident set of the
system's server processes plus its largest client.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

from kvstore._units import parse_size
from kvstore.config import ServiceConfig
from kvstore.testing import ServiceProcess, free_port, make_store, script_args, write_record

WORKER = str(REPO / "scripts" / "bench" / "peers" / "worker.py")

sys.path.insert(0, str(REPO / "scripts" / "bench"))
from throughput import make_target  # noqa: E402



def hwm_kib(pids: list[int]) -> int:
    """Sum of peak resident sets (VmHWM) of live processes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def peers_venv(path: Path) -> tuple[str | None, str]:
    """(python of the peers' venv, or None, and why not)."""
    py = path / "bin" / "python"
    req = REPO / "scripts" / "bench" / "compare-requirements.txt"
    stamp = path / ".installed"
    if py.exists() and stamp.exists() and stamp.read_text() == req.read_text():
        return str(py), ""
    r = subprocess.run([sys.executable, "-m", "venv", str(path)], capture_output=True, text=True)
    if r.returncode:
        return None, f"venv failed: {r.stderr.strip()[-300:]}"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(req)], capture_output=True, text=True)
    if r.returncode:
        return None, f"pip install failed: {r.stderr.strip()[-500:]}"
    stamp.write_text(req.read_text())
    return str(py), ""


def run_clients(py: str, system: str, op: str, base: int, n: int, ps: int, clients: int, batch: int,
                args: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    per = n // clients
    procs = [subprocess.Popen([py, WORKER, system, op, str(base + c * per), str(per), str(ps), str(batch),
                               json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for c in range(clients)]
    if op != "clear":  # a barrier: every client is connected and set up before any starts its timed part
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                p.kill()
                raise RuntimeError(f"{system} {op} client did not start: {line} {p.stderr.read()[-800:] if p.stderr else ''}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"{system} {op} client failed: {e.strip()[-800:]}")
        outs.append(json.loads(o.strip().splitlines()[-1]))
    if op == "clear":
        return {}
    secs = max(o["seconds"] for o in outs)
    lat = sorted(x for o in outs for x in o["lat_us"])
    return {"gbps": sum(o["bytes"] for o in outs) / secs / 1e9, "wrong": sum(o["wrong"] for o in outs),
            "missing": sum(o["missing"] for o in outs), "client_rss_kib": max(o["max_rss_kib"] for o in outs),
            "p50_us": statistics.median(lat) if lat else None,
            "p99_us": lat[max(0, int(len(lat) * 0.99) - 1)] if lat else None}


def fio(dev: str, rw: str, bs: int, qd: int, size: int, jobs: int) -> float:
    cmd = ["fio", "--name=b", f"--filename={dev}", "--ioengine=libaio", "--direct=1", f"--rw={rw}", f"--bs={bs}",
           f"--iodepth={qd}", f"--size={size // jobs // bs * bs}", f"--numjobs={jobs}", "--offset_increment="
           f"{size // jobs // bs * bs}", "--offset=1M", "--group_reporting", "--output-format=json", "--norandommap"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    part = out["jobs"][0]["write" if "write" in rw else "read"]
    return float(part["bw_bytes"]) / 1e9


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--page-size", action="append", help="default: 256KiB and 4MiB")
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--systems", nargs="+",
                    default=["fio", "kvstore", "redis", "file-buffered", "file-direct", "mooncake"])
    ap.add_argument("--dir", default="/var/tmp", help="file system of the device file and the page files")
    ap.add_argument("--peers-venv", default="/var/tmp/kvstore-bench-peers")
    ap.add_argument("--target", choices=["disk-file", "shm-loop"], default="disk-file",
                    help="kvstore's and fio's device: a file on --dir, or a memory-backed loop device")
    a = ap.parse_args()
    sizes = [parse_size(x) for x in (a.page_size or ["256KiB", "4MiB"])]
    total = parse_size(a.size)
    work = Path(tempfile.mkdtemp(prefix="kvbench-cmp-", dir=a.dir))
    unavailable: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    peer_py = None
    if {"redis", "mooncake"} & set(a.systems):
        peer_py, why = peers_venv(Path(a.peers_venv))
        if peer_py is None:
            unavailable["redis"] = unavailable["mooncake"] = why
    if "redis" in a.systems and "redis" not in unavailable and shutil.which("redis-server") is None:
        if os.geteuid() == 0 and shutil.which("apt-get"):
            subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], capture_output=True)
        if shutil.which("redis-server") is None:
            unavailable["redis"] = "redis-server is not installed (apt-get install redis-server)"
    procs: list[subprocess.Popen[Any]] = []
    cleanup: list[str] = []
    try:
        for ps in sizes:
            n = total // ps
            nbytes = (2 << 20) + (n + 64) * (4096 + ps)
            for cmd in cleanup:  # the last page size's device
                subprocess.run(cmd, shell=True, check=False)
            dev, cleanup = make_target(a.target, nbytes, work)
            # precondition the device (first-touch allocation) for fio and kvstore alike
            subprocess.run(["fio", "--name=pre", f"--filename={dev}", "--ioengine=libaio", "--direct=1", "--rw=write",
                            "--bs=1M", "--iodepth=8", f"--size={nbytes - (1 << 20)}", "--offset=1M"],
                           capture_output=True, check=True)
            fio_ref: dict[int, tuple[float, float]] = {}
            for c in a.clients:
                if "fio" in a.systems:
                    w = fio(str(dev), "write", 4096 + ps, 4, n * (4096 + ps), c)
                    r = fio(str(dev), "randread", 4096 + ps, 32, n * (4096 + ps), c)
                    fio_ref[c] = (w, r)
                    rows.append({"system": "fio", "page_size": ps, "clients": c, "save_gbps": w, "load_gbps": r})
            if "kvstore" in a.systems:
                home = work / "mass"
                home.mkdir(exist_ok=True)
                make_store(home, "cmp", [str(dev)], ps, service=ServiceConfig(client_buffers=64, max_clients=8),
                           force=True)
                with ServiceProcess(home, "cmp") as svc:
                    args = {"repo": str(REPO), "home": str(home), "store": "cmp"}
                    for c in a.clients:
                        base = c * 10 * n
                        s = run_clients(sys.executable, "kvstore", "save", base, n, ps, c, 64, args)
                        ld = run_clients(sys.executable, "kvstore", "load", base, n, ps, c, 64,
                                         {**args, "latency": 200 if c == 1 else 0})
                        rss = hwm_kib([svc.pid, *children(svc.pid)])
                        rows.append({"system": "kvstore", "page_size": ps, "clients": c, "save_gbps": s["gbps"],
                                     "load_gbps": ld["gbps"], "p50_us": ld["p50_us"], "p99_us": ld["p99_us"],
                                     "wrong": s["wrong"] + ld["wrong"], "missing": s["missing"] + ld["missing"],
                                     "peak_rss_mib": (rss + max(s["client_rss_kib"], ld["client_rss_kib"])) / 1024})
            for system in ("file-buffered", "file-direct"):
                if system not in a.systems:
                    continue
                for c in a.clients:
                    d = work / f"files-{system}-{c}"
                    d.mkdir()
                    args = {"dir": str(d), "latency": 200 if c == 1 else 0}
                    s = run_clients(sys.executable, system, "save", 0, n, ps, c, 1, args)
                    row = {"system": system, "page_size": ps, "clients": c, "save_gbps": s["gbps"]}
                    if system == "file-buffered":
                        ld = run_clients(sys.executable, system, "load", 0, n, ps, c, 1, args)
                        row.update({"load_cached_gbps": ld["gbps"], "p50_cached_us": ld["p50_us"],
                                    "p99_cached_us": ld["p99_us"]})
                    os.sync()
                    for f in d.iterdir():  # cold: drop the files from the page cache
                        fd = os.open(f, os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)
                    ld = run_clients(sys.executable, system, "load", 0, n, ps, c, 1, {**args, "cold": True})
                    row.update({"load_gbps": ld["gbps"], "p50_us": ld["p50_us"], "p99_us": ld["p99_us"],
                                "wrong": s["wrong"] + ld["wrong"], "missing": s["missing"] + ld["missing"],
                                "peak_rss_mib": max(s["client_rss_kib"], ld["client_rss_kib"]) / 1024})
                    rows.append(row)
                    shutil.rmtree(d)
            if "redis" in a.systems and "redis" not in unavailable and peer_py:
                port = free_port()
                rs = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                       "--appendonly", "no", "--protected-mode", "yes", "--dir", str(work)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(rs)
                time.sleep(0.5)
                args = {"port": port, "latency": 0}
                batch = max(1, (16 << 20) // ps)  # pipelines of ~16 MiB
                for c in a.clients:
                    run_clients(peer_py, "redis", "clear", 0, 1, ps, 1, 1, args)
                    base = c * 10 * n  # fresh keys every round, as for kvstore
                    s = run_clients(peer_py, "redis", "save", base, n, ps, c, batch, args)
                    ld = run_clients(peer_py, "redis", "load", base, n, ps, c, batch,
                                     {**args, "latency": 200 if c == 1 else 0})
                    rows.append({"system": "redis", "page_size": ps, "clients": c, "save_gbps": s["gbps"],
                                 "load_gbps": ld["gbps"], "p50_us": ld["p50_us"], "p99_us": ld["p99_us"],
                                 "wrong": s["wrong"] + ld["wrong"], "missing": s["missing"] + ld["missing"],
                                 "peak_rss_mib": (hwm_kib([rs.pid]) + max(s["client_rss_kib"], ld["client_rss_kib"])) / 1024})
                rs.terminate()
                rs.wait(10)
            if "mooncake" in a.systems and "mooncake" not in unavailable and peer_py:
                try:
                    rows += run_mooncake(peer_py, work, ps, n, a.clients)
                except Exception as e:
                    unavailable["mooncake"] = f"{type(e).__name__}: {e}"[:600]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for cmd in cleanup:
            subprocess.run(cmd, shell=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        ref = next((x for x in rows if x["system"] == "fio" and x["page_size"] == r["page_size"]
                    and x["clients"] == r["clients"]), None)
        kv = next((x for x in rows if x["system"] == "kvstore" and x["page_size"] == r["page_size"]
                   and x["clients"] == r["clients"]), None)
        if ref:
            r["load_vs_fio"] = r["load_gbps"] / ref["load_gbps"]
            r["save_vs_fio"] = r["save_gbps"] / ref["save_gbps"]
        if kv:
            r["load_vs_kvstore"] = r["load_gbps"] / kv["load_gbps"]
    print(f"{'system':<14}{'page':>7}{'cl':>4}{'save GB/s':>11}{'load GB/s':>11}{'cached':>9}{'p50 us':>9}"
          f"{'p99 us':>9}{'RSS MiB':>9}{'load/fio':>9}{'load/kv':>9}{'wrong':>7}{'missing':>9}")
    for r in rows:
        def f(k: str, fmt: str = "{:.2f}") -> str:
            v = r.get(k)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"
        print(f"{r['system']:<14}{r['page_size'] >> 10:>6}K{r['clients']:>4}{f('save_gbps'):>11}{f('load_gbps'):>11}"
              f"{f('load_cached_gbps'):>9}{f('p50_us', '{:.0f}'):>9}{f('p99_us', '{:.0f}'):>9}"
              f"{f('peak_rss_mib', '{:.0f}'):>9}{f('load_vs_fio'):>9}{f('load_vs_kvstore'):>9}{f('wrong', '{:d}'):>7}"
              f"{f('missing', '{:d}'):>9}")
    for s, why in unavailable.items():
        print(f"{s}: not measured: {why}")
    write_record(a.json, {"size": total, "target": a.target, "rows": rows, "unavailable": unavailable}, a)
    bad = sum(r.get("wrong", 0) for r in rows)
    return 1 if bad else 0


def run_mooncake(py: str, work: Path, ps: int, n: int, clients: list[int]) -> list[dict[str, Any]]:
    binary = Path(py).parent / "mooncake_master"
    port, mport = free_port(), free_port()
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    master = subprocess.Popen([str(binary), "-rpc_address=127.0.0.1", f"-rpc_port={port}",
                               "-metrics_host=127.0.0.1", f"-metrics_port={mport}"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seg = int(n * ps * 1.3) + (64 << 20)
    storage_code = ("import sys,time,signal\nfrom mooncake.store import MooncakeDistributedStore\n"
                    "s=MooncakeDistributedStore()\n"
                    f"rc=s.setup('127.0.0.1','P2PHANDSHAKE',{seg},16<<20,'tcp','','127.0.0.1:{port}')\n"
                    "print('ready' if rc==0 else f'setup failed {rc}', flush=True)\n"
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nwhile True: time.sleep(1)\n")
    storage = subprocess.Popen([py, "-c", storage_code], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    rows = []
    try:
        time.sleep(0.5)
        line = storage.stdout.readline().strip() if storage.stdout else ""
        if line != "ready":
            raise RuntimeError(f"storage process: {line or 'exited'}")
        args = {"port": port, "latency": 0}
        batch = max(1, (16 << 20) // ps)
        for c in clients:
            run_clients(py, "mooncake", "clear", 0, 1, ps, 1, 1, args, env)
            base = c * 10 * n  # fresh keys every round: a put of an existing key is not a save
            s = run_clients(py, "mooncake", "save", base, n, ps, c, batch, args, env)
            ld = run_clients(py, "mooncake", "load", base, n, ps, c, batch, {**args, "latency": 200 if c == 1 else 0},
                             env)
            rows.append({"system": "mooncake", "page_size": ps, "clients": c, "save_gbps": s["gbps"],
                         "load_gbps": ld["gbps"], "p50_us": ld["p50_us"], "p99_us": ld["p99_us"],
                         "wrong": s["wrong"] + ld["wrong"], "missing": ld["missing"] + s["missing"],
                         "peak_rss_mib": (hwm_kib([master.pid, storage.pid])
                                          + max(s["client_rss_kib"], ld["client_rss_kib"])) / 1024})
    finally:
        for p in (storage, master):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


if __name__ == "__main__":
    sys.exit(main())
