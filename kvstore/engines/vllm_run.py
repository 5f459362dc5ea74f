"""Run prompts through a real vLLM (``LLM``) in this process and print what came out, as JSON.

For the connector's tests and ``scripts/bench/vllm_ttft.py`` (vLLM spawns workers, so it runs
as a script)::

    python -m kvstore.engines.vllm_run --model DIR --prompts prompts.json [--store NAME --server S] \\
        [--max-tokens 8] [--max-num-batched-tokens 2048] [--no-prefix-cache] \\
        [--pause-before K --pause-file PATH] [--update-weights-before K]

``prompts.json`` is a list of token-id lists (or of lists of them: groups sent one after the
other). Prints one JSON line: per prompt the generated token ids, their logprobs and the time
to first token (seconds, measured around a one-token generate of that prompt alone when
``--ttft``), the engine start time, whether vLLM's hybrid KV cache manager runs and the KV
cache's block count.

``--pause-before K`` stops before prompt K (first run only): it creates ``PATH.ready`` and
waits (at most 10 minutes) until ``PATH`` exists, so that a test can act on the store (or wait
for it) while this vLLM still holds its prefix cache. Given again, it stops there too: the
``n``-th pause (from 0) uses ``PATH`` for the first, ``PATH.n`` for later ones. ``--update-weights-before K`` changes the weights in
place before prompt K (every parameter times 1.5, as an RL step would change them) and then
calls ``reset_prefix_cache(reset_connector=True)``, vLLM's call after a weight update.

``--in-process`` runs vLLM's engine core and its worker in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the same scheduler, worker and connector code, both
connector roles, without the two process spawns (each imports vLLM again: on two CPU cores
a run takes 13 s instead of 30). Without it vLLM runs as users run it, one process for the
engine core and one per worker, the connector's metadata and results crossing between them.
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
    ap.add_argument("--pause-before", type=int, action="append", default=[],
                    help="wait for --pause-file before this prompt (repeatable)")
    ap.add_argument("--pause-file")
    ap.add_argument("--update-weights-before", type=int, help="update the weights in place before this prompt")
    ap.add_argument("--in-process", action="store_true", help="vLLM's engine core and worker in this process")
    ap.add_argument("--no-hybrid-manager", action="store_true",
                    help="turn vLLM's hybrid KV cache manager off (as vLLM does for a connector without SupportsHMA)")
    a = ap.parse_args()
    if a.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vLLM builds the engine
    if a.pause_before and not a.pause_file:
        ap.error("--pause-before needs --pause-file")
    if a.update_weights_before is not None:
        # apply_model ships a function to the workers, which vLLM allows only when told to
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
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
    if a.no_hybrid_manager:
        kw["disable_hybrid_kv_cache_manager"] = True
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=16384, enforce_eager=True, seed=0,
              max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=not a.no_prefix_cache, **kw)
    started = time.monotonic() - t0
    vc = llm.llm_engine.vllm_config
    with open(a.prompts) as f:
        prompts = json.load(f)
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, logprobs=1)
    # whether vLLM's hybrid KV cache manager runs (a connector without SupportsHMA turns it off),
    # and the KV cache's blocks
    out: dict[str, Any] = {"start_s": round(started, 3), "runs": [],
                           "hybrid_manager": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
                           "kv_blocks": vc.cache_config.num_gpu_blocks}
    for _ in range(a.repeat):
        run = []
        for i, p in enumerate(prompts):
            if a.kill_pid and i == a.kill_before:
                os.kill(a.kill_pid, signal.SIGKILL)
            if not out["runs"] and i in a.pause_before:
                n = sorted(a.pause_before).index(i)
                _pause(a.pause_file if n == 0 else f"{a.pause_file}.{n}")
            if not out["runs"] and i == a.update_weights_before:
                # by its module's name: run with -m, this file is __main__, which workers cannot import
                from kvstore.engines import vllm_run
                llm.apply_model(vllm_run._scale_weights)
                if not llm.reset_prefix_cache(reset_connector=True):
                    raise RuntimeError("reset_prefix_cache(reset_connector=True) failed")
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


def _pause(path: str) -> None:
    with open(path + ".ready", "w"):
        pass
    deadline = time.monotonic() + 600
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within 10 minutes")
        time.sleep(0.1)


def _scale_weights(model: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)


if __name__ == "__main__":
    sys.exit(main())
