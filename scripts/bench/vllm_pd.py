#!/usr/bin/env python3
"""Prefill/decode disaggregation through the store, timed: the decode server's time to first token
for a prompt the prefill server just stored, against the same server computing a prompt cold.

    .venv/bin/python scripts/bench/vllm_pd.py --lengths 1024 2048 3040 --repeat 3 --json docs/bench/vllm_pd.json

One store with servers a and b on a file device in a temporary MASS_HOME, a random-weight Llama built
here (no downloads), two vLLM OpenAI servers (a: ``kv_producer``, b: ``kv_consumer``) and
``examples/pd_proxy.py`` in front of them. For each length and repetition, alternating: *cold*, a new
prompt sent straight to the decode server with ``max_tokens: 1`` (it computes the whole prompt);
*P/D*, another new prompt through the proxy with ``max_tokens: 1``: the proxy's decode leg
(``X-Decode-Seconds``: request to answer of the decode server, which loads the prompt's pages,
waiting for those not there yet since the proxy sends it the moment the prefill answers) is the
figure, its ratio to cold the target (<= 0.2). Also reported: the prefill leg, the pages the decoder
loaded and the prompt tokens it took from the store (vLLM's /metrics). Medians; prints a table and
writes JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstore.testing import script_args, write_record

ROOT = Path(__file__).resolve().parents[2]


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
        return out, dict(r.headers), time.perf_counter() - t0


def metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:kvstore_", "vllm:prompt_tokens_cached_by_source_total")):
            name, value = line.rsplit(" ", 1)
            if "source=" in name:
                name = "disk_tokens" if 'source="disk"' in name else "other"
            out[name.split("{")[0] if "{" in name else name] = out.get(name, 0.0) + float(value)
    return out


def up(url: str, proc: subprocess.Popen[bytes], log: Path, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-4000:]}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up in {limit} s:\n{log.read_text()[-4000:]}")


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3040])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-tokens", type=int, default=256)
    a = ap.parse_args()

    from kvstore.testing import ServiceProcess, free_port, free_port_pair, make_store, make_tiny_llama

    page = a.page_tokens * a.layers * 2 * a.kv_heads * a.head_dim * 2  # bf16 K and V of every layer
    pages = 2 * a.repeat * sum(-(-n // a.page_tokens) for n in a.lengths) + 64
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-pd-"))
    svcs: list[ServiceProcess] = []
    procs: list[subprocess.Popen[bytes]] = []
    rows: list[dict[str, Any]] = []
    try:
        dev = tmp / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * pages * (4096 + page))
        make_store(tmp, "bench", [str(dev)], page, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
        model = make_tiny_llama(tmp / "model", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                                head_dim=a.head_dim, intermediate=4 * a.hidden)
        svcs = [ServiceProcess(tmp, "bench", s).start() for s in ("a", "b")]
        # (TMPDIR: vLLM leaves its IPC sockets and rendezvous files there; the run's directory goes at the end)
        env = {**os.environ, "MASS_HOME": str(tmp), "TMPDIR": str(tmp), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "0-1"), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
        ports = {}
        for server, role in (("a", "kv_producer"), ("b", "kv_consumer")):
            ports[server] = port = free_port()
            cfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
                   "kv_role": role, "kv_connector_extra_config": {"store": "bench", "server": server,
                                                                   "page_tokens": a.page_tokens}}
            log = tmp / f"{server}.log"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
                 "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max(a.lengths) + 64),
                 "--enforce-eager", "--kv-transfer-config", json.dumps(cfg)],
                env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))
            up(f"http://127.0.0.1:{port}", procs[-1], log)
        pport = free_port()
        plog = tmp / "proxy.log"
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--prefill",
                                       f"http://127.0.0.1:{ports['a']}", "--decode", f"http://127.0.0.1:{ports['b']}",
                                       "--port", str(pport)], stdout=open(plog, "w"), stderr=subprocess.STDOUT))
        up(f"http://127.0.0.1:{pport}", procs[-1], plog, 30)
        decode, proxy = f"http://127.0.0.1:{ports['b']}/v1/completions", f"http://127.0.0.1:{pport}/v1/completions"
        rng = random.Random(11)

        def body(n: int) -> dict[str, Any]:
            return {"model": str(model), "prompt": [rng.randrange(3, 1000) for _ in range(n)], "max_tokens": 1,
                    "temperature": 0}

        for warm in (decode, proxy):  # the engines' first requests (compilation, allocation) are not timed
            post(warm, body(300))
        for n in a.lengths:
            for rep in range(a.repeat):
                _, _, cold = post(decode, body(n))
                before = metrics(ports["b"])
                _, headers, total = post(proxy, body(n))
                m = metrics(ports["b"])
                rows.append({"length": n, "rep": rep, "cold_s": cold, "pd_decode_s": float(headers["X-Decode-Seconds"]),
                             "pd_prefill_s": float(headers["X-Prefill-Seconds"]), "pd_total_s": total,
                             "pages_loaded": m.get("vllm:kvstore_load_pages_total", 0)
                             - before.get("vllm:kvstore_load_pages_total", 0),
                             "disk_tokens": m.get("disk_tokens", 0) - before.get("disk_tokens", 0)})
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for s in svcs:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    table = []
    print(f"{'prompt':>7} {'cold':>8} {'P/D decode':>11} {'decode/cold':>12} {'prefill leg':>12} {'pages':>6} "
          f"{'tokens from store':>18}")
    for n in a.lengths:
        xs = [r for r in rows if r["length"] == n]
        cold = statistics.median(r["cold_s"] for r in xs)
        dec = statistics.median(r["pd_decode_s"] for r in xs)
        row = {"length": n, "cold_s": round(cold, 4), "pd_decode_s": round(dec, 4), "decode_over_cold": round(dec / cold, 4),
               "pd_prefill_s": round(statistics.median(r["pd_prefill_s"] for r in xs), 4),
               "pages_loaded": [r["pages_loaded"] for r in xs], "disk_tokens": [r["disk_tokens"] for r in xs],
               "cold_all": [round(r["cold_s"], 4) for r in xs], "pd_decode_all": [round(r["pd_decode_s"], 4) for r in xs]}
        table.append(row)
        print(f"{n:>7} {cold:>7.3f}s {dec:>10.3f}s {dec / cold:>12.3f} {row['pd_prefill_s']:>11.3f}s "
              f"{int(statistics.median(row['pages_loaded'])):>6} {int(statistics.median(row['disk_tokens'])):>18}")
    rep_ = {"model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                      "head_dim": a.head_dim}, "page_tokens": a.page_tokens, "page_bytes": page, "repeat": a.repeat,
            "rows": table}
    write_record(a.json, rep_, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
