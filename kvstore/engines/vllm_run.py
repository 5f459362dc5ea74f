"""Run prompts through a real vLLM (``LLM``) in this process and print what came out, as JSON.

For the connector's tests and ``scripts/bench/vllm_ttft.py`` (vLLM spawns workers, so it runs
as a script)::

    python -m kvstore.engines.vllm_run --model DIR --prompts prompts.json [--store NAME --server S] \\
        [--max-tokens 8] [--max-num-batched-tokens 2048] [--no-prefix-cache]

``prompts.json`` is a list of token-id lists (or of lists of them: groups sent one after the
other). Prints one JSON line: per prompt the generated token ids, their logprobs and the time
to first token (seconds, measured around a one-token generate of that prompt alone when
``--ttft``), and the engine start time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, cast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--store", help="kvstore store name (omit to run without the connector)")
    ap.add_argument("--server", help="kvstore server (service) to use on this machine")
    ap.add_argument("--page-tokens", type=int)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--ttft", action="store_true", help="time a 1-token generate of each prompt first")
    ap.add_argument("--repeat", type=int, default=1, help="run the prompt list this many times")
    ap.add_argument("--failure-policy", choices=["recompute", "fail"], help="kv_load_failure_policy to ask for")
    ap.add_argument("--kill-pid", type=int, help="SIGKILL this process before prompt --kill-before (a fault)")
    ap.add_argument("--kill-before", type=int, default=0)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {}
    if a.store:
        extra: dict[str, Any] = {"store": a.store}
        if a.server:
            extra["server"] = a.server
        if a.page_tokens:
            extra["page_tokens"] = a.page_tokens
        extra["mass_home"] = os.environ.get("MASS_HOME")
        kw["kv_transfer_config"] = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
                                    "kv_role": "kv_both", "kv_connector_extra_config": extra}
        if a.failure_policy:
            kw["kv_transfer_config"]["kv_load_failure_policy"] = a.failure_policy
    t0 = time.monotonic()
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=16384, enforce_eager=True, seed=0,
              max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=not a.no_prefix_cache, **kw)
    started = time.monotonic() - t0
    with open(a.prompts) as f:
        prompts = json.load(f)
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, logprobs=1)
    out: dict[str, Any] = {"start_s": round(started, 3), "runs": []}
    for _ in range(a.repeat):
        run = []
        for i, p in enumerate(prompts):
            if a.kill_pid and i == a.kill_before:
                os.kill(a.kill_pid, signal.SIGKILL)
            ttft = None
            if a.ttft:
                t1 = time.monotonic()
                llm.generate([cast(Any, {"prompt_token_ids": p})], SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)
                ttft = time.monotonic() - t1
            o = llm.generate([cast(Any, {"prompt_token_ids": p})], sp, use_tqdm=False)[0]
            c = o.outputs[0]
            lps = [float(next(iter(d.values())).logprob) if d else None for d in (c.logprobs or [])]
            run.append({"tokens": list(c.token_ids), "logprobs": lps, "finish": c.finish_reason,
                        "ttft_s": ttft, "cached_tokens": getattr(o, "num_cached_tokens", None)})
        out["runs"].append(run)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
