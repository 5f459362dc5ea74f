"""The vLLM connector's logic against simulated paged KV caches (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore import KVCacheClient  # noqa: E402
from kvstore.engines.vllm_mapping import LAYOUT, SchedulerSide, WorkerSide  # noqa: E402
from kvstore.keys import KeyNamespace  # noqa: E402
from kvstore.testing import make_store, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

LAYERS, HEADS, DIM, BS, BPP = 3, 2, 32, 8, 2
PAGE_TOKENS = BS * BPP
PAGE_BYTES = LAYERS * 2 * PAGE_TOKENS * HEADS * DIM * 2  # float16
NS = KeyNamespace("sim-model@1", "float16", LAYERS, HEADS, DIM, PAGE_TOKENS, layout=LAYOUT)


def caches(num_blocks: int = 64, seed: int | None = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {f"layer.{i}": (torch.randn((2, num_blocks, BS, HEADS, DIM), generator=g).half() if g
                           else torch.zeros((2, num_blocks, BS, HEADS, DIM), dtype=torch.float16))
            for i in range(LAYERS)}




@pytest.fixture
def store(home: Path, file_devices: Any, services: Any) -> Path:
    devs = file_devices.make(1, (1 << 20) + 200 * (4096 + PAGE_BYTES))
    make_store(home, "vllm", devs, PAGE_BYTES)
    services(home, "vllm")
    return home


def test_save_on_one_instance_load_into_another(store: Path) -> None:
    prompt = list(range(1000, 1000 + 5 * PAGE_TOKENS + 3))  # 5 whole pages and a partial one
    with KVCacheClient.connect("vllm", home=store) as c:
        # instance A computes the prompt into blocks 10.. and saves the pages when prefill completes
        a_caches = caches(seed=1)
        a_blocks = list(range(10, 10 + len(prompt) // BS + 1))
        sa = SchedulerSide(NS, BS, c.lookup)
        assert sa.num_new_matched_tokens("r1", prompt, 0) == 0
        sa.prompt_progress("r1", prompt, a_blocks, len(prompt))
        plan = sa.build_plan()
        assert len(plan.saves) == 1 and len(plan.saves[0].keys) == 5
        wa = WorkerSide(c, NS, BS, a_caches)
        assert wa.save(plan.saves[0]) == 5
        # instance B (other blocks, empty cache) loads them
        b_caches = caches()
        b_blocks = list(range(40, 40 + len(prompt) // BS + 1))
        sb = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: sb.num_new_matched_tokens("r9", prompt, 0) == 5 * PAGE_TOKENS)  # writes are async
        assert sb.num_new_matched_tokens("r9", prompt, 8) == 0  # not on a page boundary: compute
        assert sb.num_new_matched_tokens("r9", prompt, PAGE_TOKENS) == 4 * PAGE_TOKENS
        sb.update_state_after_alloc("r9", b_blocks, 4 * PAGE_TOKENS)
        plan = sb.build_plan()
        assert [len(t.keys) for t in plan.loads] == [4]
        assert WorkerSide(c, NS, BS, b_caches).load(plan.loads[0]) == set()
        for name in a_caches:
            # pages 1..4 = blocks 2..9 of the request
            assert torch.equal(b_caches[name][:, b_blocks[2:10]], a_caches[name][:, a_blocks[2:10]])
            assert not b_caches[name][:, b_blocks[:2]].any()  # page 0 was not planned: untouched


def test_missing_pages_are_reported_as_load_errors(store: Path) -> None:
    prompt = list(range(3 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        a = caches(seed=2)
        blocks = list(range(6 + 1))
        s = SchedulerSide(NS, BS, c.lookup)
        s.prompt_progress("r", prompt, blocks, len(prompt))
        WorkerSide(c, NS, BS, a).save(s.build_plan().saves[0])
        s2 = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: s2.num_new_matched_tokens("q", prompt, 0) == 3 * PAGE_TOKENS)
        s2.update_state_after_alloc("q", list(range(20, 27)), 3 * PAGE_TOKENS)
        plan = s2.build_plan()
    # the connection is gone before the worker loads: every planned block is a load error, nothing raises
    w = WorkerSide(c, NS, BS, caches())
    assert w.load(plan.loads[0]) == set(range(20, 26))


def test_geometry_errors_are_clear(store: Path) -> None:
    with KVCacheClient.connect("vllm", home=store) as c:
        with pytest.raises(ValueError, match="multiple of vLLM's block_size"):
            SchedulerSide(NS, 5, c.lookup)
        big = {"l": torch.zeros((2, 4, BS, 64, 64), dtype=torch.float32)}
        with pytest.raises(ValueError, match="--page-size >="):
            WorkerSide(c, NS, BS, big)
