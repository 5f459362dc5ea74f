"""The vLLM connector's planning and copying logic, fast, on caches shaped as vLLM 0.32 registers them
([blocks, heads, tokens, C] per layer, also with non-contiguous strides). The proof inside vLLM itself
is tests/engines/test_vllm_real.py; these pin down the cases that are slow to reach there."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog.testing

torch = pytest.importorskip("torch")

from kvstore import KVCacheClient  # noqa: E402
from kvstore.engines.vllm_mapping import NULL_BLOCK, PageTransfer, SchedulerSide, WorkerSide, layout_of  # noqa: E402
from kvstore.keys import KeyNamespace  # noqa: E402
from kvstore.testing import make_store, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

LAYERS, HEADS, C, BS, BPP = 3, 2, 64, 8, 2
PAGE_TOKENS = BS * BPP
PAGE_BYTES = LAYERS * BPP * HEADS * BS * C * 2  # bfloat16
NS = KeyNamespace("sim-model@1", "bfloat16", LAYERS, HEADS, C // 2, PAGE_TOKENS, layout="sim")


def caches(num_blocks: int = 64, seed: int | None = None, head_major: bool = False) -> dict[str, Any]:
    """Per-layer [B, H, N, C] views; ``head_major`` gives them the strides of an LHBNC layout."""
    out = {}
    for i in range(LAYERS):
        g = torch.Generator().manual_seed(seed + i) if seed is not None else None
        phys = (HEADS, num_blocks, BS, C) if head_major else (num_blocks, HEADS, BS, C)
        t = torch.randn(phys, generator=g).bfloat16() if g else torch.zeros(phys, dtype=torch.bfloat16)
        out[f"layer.{i}"] = t.permute(1, 0, 2, 3) if head_major else t
    return out


def worker(c: KVCacheClient, kv: dict[str, Any]) -> WorkerSide:
    return WorkerSide(c, layout_of(kv, "SIM", BS), BS, BPP, kv)


@pytest.fixture
def store(home: Path, file_devices: Any, services: Any) -> Path:
    devs = file_devices.make(1, (1 << 20) + 200 * (4096 + PAGE_BYTES))
    make_store(home, "vllm", devs, PAGE_BYTES)
    services(home, "vllm")
    return home


@pytest.mark.parametrize("head_major", [False, True])
def test_chunked_prefill_saves_every_page_and_another_instance_loads_from_mid_page(store: Path,
                                                                                   head_major: bool) -> None:
    prompt = list(range(1000, 1000 + 5 * PAGE_TOKENS + 3))  # 5 whole pages and a partial one
    with KVCacheClient.connect("vllm", home=store) as c:
        a_kv = caches(seed=1, head_major=head_major)
        blocks = list(range(10, 10 + len(prompt) // BS + 1))
        sa = SchedulerSide(NS, BS, c.lookup)
        assert sa.num_new_matched_tokens("r1", prompt, 0) == 0
        # prefill in chunks of 24 tokens; blocks arrive as the request grows
        saved = []
        before = 0
        for step, end in enumerate(range(24, len(prompt) + 24, 24)):
            nb = blocks[:(min(end, len(prompt)) + BS - 1) // BS]
            if step == 0:
                sa.schedule("r1", prompt, nb, True, before, min(end, len(prompt)))
            else:
                sa.schedule("r1", None, nb[len(prev):], False, before, min(end, len(prompt)))
            prev, before = nb, min(end, len(prompt))
            saved += sa.build_plan().saves
        assert sum(len(t.keys) for t in saved) == 5      # every whole page, each once
        wa = worker(c, a_kv)
        assert sum(wa.save(t) for t in saved) == 5
        st = wa.stats.take()
        assert st is not None and (st["save_pages"], st["save_bytes"], st["save_failed_pages"]) == (5, 5 * PAGE_BYTES, 0)
        assert st["save_s"] > 0 and st["load_pages"] == 0 and wa.stats.take() is None  # an interval resets
        assert sa.stats.take() == {**dict.fromkeys(sa.stats._data, 0), "lookups": 1, "miss_pages": 5,
                                   "miss_tokens": 5 * PAGE_TOKENS}
        # instance B holds the request's first block already (vLLM's own prefix cache): half a page
        b_kv = caches(head_major=head_major)
        b_blocks = list(range(40, 40 + len(prompt) // BS + 1))
        sb = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: sb.num_new_matched_tokens("r9", prompt, BS) == 5 * PAGE_TOKENS - BS)
        sb.stats.take()  # the lookups while the writes landed; once more, counted
        assert sb.num_new_matched_tokens("r9", prompt, BS) == 5 * PAGE_TOKENS - BS
        st = sb.stats.take()
        assert st is not None and (st["lookups"], st["hit_pages"], st["hit_tokens"], st["miss_pages"]) == \
            (1, 5, 5 * PAGE_TOKENS, 0)
        sb.update_state_after_alloc("r9", b_blocks, 5 * PAGE_TOKENS - BS)
        (load,) = sb.build_plan().loads
        assert load.first[0] == 1 and load.block_ids[0] == (b_blocks[1],)  # page 0: only its 2nd block
        marker = torch.full((HEADS, BS, C), 7.0, dtype=torch.bfloat16)
        for t in b_kv.values():
            t[b_blocks[0]] = marker                           # what vLLM already held
        wb = worker(c, b_kv)
        assert wb.load(load) == set()
        st = wb.stats.take()
        assert st is not None and (st["load_pages"], st["load_bytes"], st["load_failed_pages"]) == (5, 5 * PAGE_BYTES, 0)
        for name in a_kv:
            assert torch.equal(b_kv[name][b_blocks[1:10]], a_kv[name][blocks[1:10]])
            assert torch.equal(b_kv[name][b_blocks[0]], marker)  # untouched
        # the loaded pages count as stored: B saves none of them again
        sb.schedule("r9", prompt, b_blocks, True, 5 * PAGE_TOKENS, len(prompt))
        assert sb.build_plan().saves == []


def test_resumed_request_replaces_its_blocks(store: Path) -> None:
    prompt = list(range(3 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        s = SchedulerSide(NS, BS, c.lookup)
        s.schedule("r", prompt, [1, 2], True, 0, PAGE_TOKENS)           # page 0 done
        assert [t.block_ids for t in s.build_plan().saves] == [((1, 2),)]
        s.schedule("r", None, [7, 8, 9, 10, 11, 12, 13], True, PAGE_TOKENS, len(prompt))  # preempted, resumed elsewhere
        (t,) = s.build_plan().saves
        assert t.block_ids == ((9, 10), (11, 12))                  # pages 1 and 2, in the new blocks


def test_missing_pages_are_reported_as_load_errors(store: Path) -> None:
    prompt = list(range(3 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        a = caches(seed=2)
        s = SchedulerSide(NS, BS, c.lookup)
        s.schedule("r", prompt, list(range(1, 8)), True, 0, len(prompt))
        worker(c, a).save(s.build_plan().saves[0])
        s2 = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: s2.num_new_matched_tokens("q", prompt, 0) == 3 * PAGE_TOKENS)
        s2.update_state_after_alloc("q", list(range(20, 27)), 3 * PAGE_TOKENS)
        plan = s2.build_plan()
        w = worker(c, caches())
    # the connection is gone before the worker loads: every planned block is a load error, nothing raises
    assert w.load(plan.loads[0]) == set(range(20, 26))
    st = w.stats.take()
    assert st is not None and (st["load_pages"], st["load_failed_pages"]) == (0, 3)


def test_cache_salt_separates_keys(store: Path) -> None:
    prompt = list(range(2 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        s = SchedulerSide(NS, BS, c.lookup)
        s.note_request("salted", "user-1")
        s.schedule("salted", prompt, list(range(1, 6)), True, 0, len(prompt))
        s.schedule("plain", prompt, list(range(6, 11)), True, 0, len(prompt))
        a, b = s.build_plan().saves
        assert set(a.keys).isdisjoint(b.keys)


def test_layouts_it_cannot_move_are_refused_clearly(store: Path) -> None:
    with KVCacheClient.connect("vllm", home=store) as c:
        with pytest.raises(ValueError, match="multiple of vLLM's block_size"):
            SchedulerSide(NS, 5, c.lookup)
        with pytest.raises(ValueError, match=r"shape \(2, 4, 8, 2, 32\).*\[blocks, heads, tokens, C\]"):
            layout_of({"l": torch.zeros((2, 4, BS, 2, 32))}, "X", BS)
        with pytest.raises(ValueError, match="differ in dtype"):
            layout_of({"a": torch.zeros((4, 2, BS, 8)), "b": torch.zeros((4, 2, BS, 8), dtype=torch.float16)}, "X", BS)
        big = {"l": torch.zeros((4, 64, BS, 64), dtype=torch.float32)}
        with pytest.raises(ValueError, match="--page-size >="):
            WorkerSide(c, layout_of(big, "X", BS), BS, BPP, big)
        # pages far smaller than the store's: accepted, with the page size that fits, once
        small = {"l": torch.zeros((4, 1, BS, 8), dtype=torch.bfloat16)}
        with structlog.testing.capture_logs() as logs:
            WorkerSide(c, layout_of(small, "X", BS), BS, BPP, small)
            worker(c, caches())  # the simulation's pages fill the store's exactly: nothing to say
        tips = [e["advice"] for e in logs if e["event"] == "kvstore page size does not fit the engine's pages"]
        assert len(tips) == 1 and f"of 256 bytes uses 2% of a {PAGE_BYTES}-byte page" in tips[0], tips
        assert "--page-size 4096" in tips[0], tips


def test_async_saves_report_done_only_when_saved_and_wait_for_preempted(store: Path) -> None:
    from kvstore.engines.vllm_mapping import AsyncSaver

    prompt = list(range(4 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c, KVCacheClient.connect("vllm", home=store) as c2:
        kv = caches(seed=3)
        s = SchedulerSide(NS, BS, c.lookup)
        s.schedule("r", prompt, list(range(1, 10)), True, 0, len(prompt))
        s.preempted({"r", "other"})
        plan = s.build_plan()
        assert plan.preempted == {"r"}                      # only requests with saves are waited for
        saver = AsyncSaver(worker(c2, kv))
        saver.submit(plan.saves[0])
        assert saver.wait({"r"}, timeout=30) and saver.done("r")
        saver.close()
        assert s.request_finished("r") is True and s.request_finished("never-saved") is False
        s2 = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: s2.num_new_matched_tokens("q", prompt, 0) == 4 * PAGE_TOKENS)


def test_async_loads_report_errors_no_later_than_the_request(store: Path) -> None:
    from kvstore.engines.vllm_mapping import AsyncLoader

    prompt = list(range(3 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c, KVCacheClient.connect("vllm", home=store) as c2:
        a = caches(seed=4)
        s = SchedulerSide(NS, BS, c.lookup)
        s.schedule("r", prompt, list(range(1, 8)), True, 0, len(prompt))
        worker(c, a).save(s.build_plan().saves[0])
        s2 = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: s2.num_new_matched_tokens("q", prompt, 0) == 3 * PAGE_TOKENS)
        s2.update_state_after_alloc("q", list(range(20, 27)), 3 * PAGE_TOKENS)
        assert s2.num_new_matched_tokens("z", prompt, 0) == 3 * PAGE_TOKENS
        s2.update_state_after_alloc("z", [30, 31], 3 * PAGE_TOKENS)  # blocks that cannot hold the load
        plan = s2.build_plan()
        assert plan.failed == {"z": (30, 31)}                      # vLLM waits for z: it must hear of it
        b = caches()
        loader = AsyncLoader(worker(c2, b))
        loader.submit(plan.loads[0])
        for req, blocks in plan.failed.items():
            loader.fail(req, blocks)
        done: set[str] = set()
        assert wait_for(lambda: done.update(loader.take_done()[0]) or done == {"q", "z"}, 30), done
        assert loader.take_errors() == {30, 31}                    # z recomputes
        for name in a:
            assert torch.equal(b[name][20:26], a[name][1:7])
        loader.close()
    # a load whose service is gone: its blocks are errors, reported with (or before) the request
    broken = AsyncLoader(worker(c2, caches()))
    broken.submit(plan.loads[0])
    got: set[str] = set()
    assert wait_for(lambda: got.update(broken.take_done()[0]) or "q" in got, 30)
    assert broken.take_errors() == set(range(20, 26))
    broken.close()


def test_a_saved_page_carries_nothing_of_the_buffer_it_was_filled_in(home: Path, file_devices: Any,
                                                                     services: Any) -> None:
    """Saves fill leased buffers in place (``reserve``), and buffers are reused: with pages larger
    than vLLM's blocks need, the rest of the page must be zeros, not what an earlier page (maybe
    another tenant's) left in the buffer."""
    ps = PAGE_BYTES + 4096
    devs = file_devices.make(1, (1 << 20) + 64 * (4096 + ps))
    make_store(home, "tail", devs, ps)
    services(home, "tail")
    with KVCacheClient.connect("tail", home=home) as c:
        with c.reserve(c.max_batch) as dirty:  # every buffer of the lease full of 0xFF, never committed
            for v in dirty:
                v[:] = b"\xff" * ps
        kv = caches(seed=3)
        w = worker(c, kv)
        assert w.save(PageTransfer("r1", (b"page-a",), ((4, 5),), (0,))) == 1
        assert wait_for(lambda: c.lookup([b"page-a"]) == 1)
        with c.get([b"page-a"]) as got:
            page = bytes(got[0])
        assert page[PAGE_BYTES:] == bytes(4096)
        assert page[:PAGE_BYTES] == bytes(w.page_bytes_of((4, 5)).numpy()[:PAGE_BYTES])
        assert any(page[:PAGE_BYTES])  # the blocks were random: a page of zeros would prove nothing


def test_a_save_longer_than_the_lease_lands_whole_in_half_lease_chunks(home: Path, file_devices: Any,
                                                                        services: Any) -> None:
    """A save is filled half a lease at a time while the half before is written: a prompt of 11
    pages through a lease of 8 buffers (chunks of 4, 4 and 3, the last ones reserved while
    writes of the ones before are still queued) lands whole, each page where another instance
    loads it from. Both instances' blocks are scattered, as vLLM's free list hands them out
    after a while: each page's blocks are not consecutive rows of the cache, on either side."""
    from kvstore.config import ServiceConfig

    devs = file_devices.make(1, (1 << 20) + 64 * (4096 + PAGE_BYTES))
    make_store(home, "lease", devs, PAGE_BYTES, service=ServiceConfig(client_buffers=8))
    services(home, "lease")
    prompt = list(range(500, 500 + 11 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("lease", home=home) as c:
        assert c.max_batch == 8
        a_kv = caches(seed=11)
        blocks = [int(b) for b in torch.randperm(63, generator=torch.Generator().manual_seed(1))[:11 * BPP + 1] + 1]
        sa = SchedulerSide(NS, BS, c.lookup)
        sa.schedule("r", prompt, blocks, True, 0, len(prompt))
        (t,) = sa.build_plan().saves
        wa = worker(c, a_kv)
        assert wa.save(t) == 11
        sb = SchedulerSide(NS, BS, c.lookup)
        assert wait_for(lambda: sb.num_new_matched_tokens("q", prompt, 0) == 11 * PAGE_TOKENS)
        scattered = [int(b) + 1 for b in torch.randperm(63, generator=torch.Generator().manual_seed(2))]
        b_blocks = [40, 41] + [b for b in scattered if b not in (40, 41)][:11 * BPP - 1]  # page 0: one run
        sb.update_state_after_alloc("q", b_blocks, 11 * PAGE_TOKENS)
        b_kv = caches()
        assert worker(c, b_kv).load(sb.build_plan().loads[0]) == set()
        for name in a_kv:
            assert torch.equal(b_kv[name][b_blocks[:22]], a_kv[name][blocks[:22]])
        # a save whose last chunk fails (a block list no page holds) after the first was
        # committed: it returns the pages committed, which are there, and counts the one it lost
        wa.stats.take()
        part = PageTransfer("p", tuple(b"part%d" % i for i in range(5)),
                            tuple((2 * i + 1, 2 * i + 2) for i in range(4)) + ((1, 2, 3),), (0,) * 5)
        assert wa.save(part) == 4
        st = wa.stats.take()
        assert st is not None and (st["save_pages"], st["save_failed_pages"]) == (4, 1), st
        assert wait_for(lambda: c.lookup([b"part%d" % i for i in range(5)]) == 4)


def test_loads_of_several_requests_read_as_one_stream_each_answered_for_its_own_pages(
        home: Path, file_devices: Any, services: Any) -> None:
    """A step's loads (and those queued behind a busy loader) are read as one stream of pages,
    with batches that cross from one request's pages to the next (a lease of 8: batches of 2).
    Each transfer still gets its own answer: a miss fails its own request from that page on, a
    block list no page holds fails its own request, an empty transfer is answered, and the
    requests around them load whole, each block where it belongs."""
    from kvstore.config import ServiceConfig
    from kvstore.engines.vllm_mapping import AsyncLoader

    devs = file_devices.make(1, (1 << 20) + 64 * (4096 + PAGE_BYTES))
    make_store(home, "stream", devs, PAGE_BYTES, service=ServiceConfig(client_buffers=8))
    services(home, "stream")
    with KVCacheClient.connect("stream", home=home) as c:
        src = caches(seed=21)
        keys = {r: tuple(b"m/%s/%d" % (r.encode(), p) for p in range(3)) for r in "abf"}
        home_blocks = {"a": 1, "b": 7, "f": 13}  # each request's pages, 2 blocks each, in the source
        w = worker(c, src)
        for r, k in keys.items():
            b0 = home_blocks[r]
            assert w.save(PageTransfer(r, k, tuple((b0 + 2 * p, b0 + 2 * p + 1) for p in range(3)), (0,) * 3)) == 3
        assert wait_for(lambda: c.lookup([k for ks in keys.values() for k in ks]) == 9)

        def plan(base: int) -> list[PageTransfer]:  # into blocks base.. of another cache
            return [
                PageTransfer("a", keys["a"], ((base, base + 1), (base + 2, base + 3), (base + 4, base + 5)), (0,) * 3),
                PageTransfer("b", (keys["b"][0], b"never-saved", keys["b"][2]),
                             ((base + 6, base + 7), (base + 8, base + 9), (base + 10, base + 11)), (0,) * 3),
                PageTransfer("c", keys["a"][:2], ((base + 12, base + 13, base + 14), (base + 15, base + 16)), (0,) * 2),
                PageTransfer("e", (), (), ()),
                PageTransfer("f", keys["f"], ((base + 17, base + 18), (base + 19, base + 20), (base + 21, base + 22)),
                             (0,) * 3),
            ]

        def check(dst: dict[str, Any], base: int) -> None:
            for n in src:
                assert torch.equal(dst[n][base:base + 6], src[n][1:7])           # a, whole
                assert torch.equal(dst[n][base + 6:base + 8], src[n][7:9])       # b's page before the miss
                assert not dst[n][base + 8:base + 17].any()                      # b after it, c: not written
                assert torch.equal(dst[n][base + 17:base + 23], src[n][13:19])   # f, whole

        want = [set(), set(range(8, 12)), set(range(12, 17)), set(), set()]
        dst = caches(num_blocks=64)
        assert list(worker(c, dst).load_many(plan(0))) == want
        check(dst, 0)
        # through the asynchronous loader: all five queued at once, answered per request
        dst2 = caches(num_blocks=64)
        loader = AsyncLoader(worker(c, dst2))
        loader.submit_all(plan(30))
        done: set[str] = set()
        failed: set[str] = set()

        def taken() -> bool:
            d, f = loader.take_done()
            done.update(d)
            failed.update(f)
            return done == {"a", "b", "c", "e", "f"}

        assert wait_for(taken, 30), done
        assert failed == {"b", "c"} and loader.take_errors() == set(range(38, 47))
        check(dst2, 30)
        # idle, the loader holds none of the lease (a finished stream gives its last batch back)
        assert wait_for(lambda: c.free_buffers() == c.max_batch, 10), c.free_buffers()
        # a transfer of a KV cache group this cache does not have fails alone; the thread lives on
        loader.submit_all([replace(plan(30)[0], req_id="g", group=5), replace(plan(30)[4], req_id="h")])
        done.clear()
        assert wait_for(lambda: done.update(loader.take_done()[0]) or done == {"g", "h"}, 30), done
        assert loader.take_errors() == set(range(30, 36)) and loader.thread.is_alive()
        loader.close()


def test_block_lists_a_page_cannot_hold_are_refused_not_truncated_or_wrapped(store: Path) -> None:
    """More blocks than a page holds, or a block id the cache does not have, is refused: saved,
    it would be cut to the page's first blocks (``index_select`` spills into the next layer's
    part); loaded, a negative id would write the cache's last block (``narrow`` counts from the
    end). A refused load reports its blocks as failed and writes nothing."""
    with KVCacheClient.connect("vllm", home=store) as c:
        kv = caches(seed=12)
        w = worker(c, kv)
        with pytest.raises(ValueError, match="3 cache blocks for a page of 2"):
            w.page_bytes_of((5, 6, 7))
        with pytest.raises(ValueError, match="out of range"):
            w.page_bytes_of((5, 64))
        assert w.save(PageTransfer("r1", (b"three",), ((5, 6, 7),), (0,))) == 0
        assert w.save(PageTransfer("r1", (b"two",), ((5, 6),), (0,))) == 1
        assert wait_for(lambda: c.lookup([b"two"]) == 1)
        dst = caches()
        wd = worker(c, dst)
        for blocks, first in (((-1,), 1), ((63, 64), 0), ((3,), -1)):
            assert wd.load(PageTransfer("r2", (b"two",), (blocks,), (first,))) == set(blocks)
            assert not any(t.any() for t in dst.values())
        assert wd.load(PageTransfer("r2", (b"two",), ((9,),), (1,))) == set()
        assert all(torch.equal(dst[n][9], kv[n][6]) for n in kv)


def test_no_page_with_a_null_block_or_a_freed_window_block_is_saved(store: Path) -> None:
    """An all-sliding-window model (window of 2 pages): vLLM's prefix cache hands a request its
    out-of-window blocks as the null block (0), and frees blocks as the window moves on. Neither
    may become a page: a null block's bytes are not the page's KV, a freed block may already be
    another request's."""
    prompt = list(range(5000, 5000 + 6 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        s = SchedulerSide(NS, BS, c.lookup, sliding_window=2 * PAGE_TOKENS)
        assert s.num_new_matched_tokens("hit", prompt, 4 * PAGE_TOKENS) == 0   # the store holds none of it
        # vLLM's own prefix cache covered 4 pages, the first 2 of them as null blocks
        blocks = [0] * (2 * BPP) + list(range(1, 4 * BPP + 2))
        s.schedule("hit", prompt, blocks, True, 4 * PAGE_TOKENS, len(prompt))
        (t,) = s.build_plan().saves
        assert all(0 not in b for b in t.block_ids)
        assert len(t.keys) == 4 and s.skipped_saves == 2      # pages 2..5 saved, 0 and 1 are placeholders
        assert (s.stats.take() or {}).get("save_skipped_pages") == 2
        # chunked prefill of a new request: after 5 pages computed, blocks wholly before token
        # 5 * PAGE_TOKENS - window + 1 may be freed: pages 1 and 2 (completed late) are not saved
        s2 = SchedulerSide(NS, BS, c.lookup, sliding_window=2 * PAGE_TOKENS)
        s2.schedule("chunked", prompt, list(range(10, 10 + 4)), True, 0, 2 * PAGE_TOKENS - 1)
        first = s2.build_plan().saves
        assert [len(t.keys) for t in first] == [1]            # page 0 done in the first chunk
        s2.schedule("chunked", None, list(range(14, 14 + 10)), False, 5 * PAGE_TOKENS, len(prompt))
        (late,) = s2.build_plan().saves
        saved_pages = {s2._keys("chunked", prompt[:6 * PAGE_TOKENS]).index(k) for k in late.keys}
        assert saved_pages == {3, 4, 5} and s2.skipped_saves == 2


def test_loads_never_read_a_page_only_null_blocks_would_receive(store: Path) -> None:
    prompt = list(range(7000, 7000 + 5 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        a = SchedulerSide(NS, BS, c.lookup)
        a.schedule("r", prompt, list(range(1, 12)), True, 0, len(prompt))
        worker(c, caches(seed=5)).save(a.build_plan().saves[0])
        b = SchedulerSide(NS, BS, c.lookup, sliding_window=2 * PAGE_TOKENS)
        assert wait_for(lambda: b.num_new_matched_tokens("q", prompt, 0) == 5 * PAGE_TOKENS)
        # vLLM pads the skipped part of the external tokens with null blocks: 2.5 pages here
        blocks = [0] * (2 * BPP + 1) + list(range(30, 30 + 2 * BPP + 1))
        b.update_state_after_alloc("q", blocks, 5 * PAGE_TOKENS)
        (t,) = b.build_plan().loads
        assert len(t.keys) == 3 and all(0 not in blk for blk in t.block_ids)  # pages 2..4, not 0 and 1
        assert t.first[0] == 1 and t.block_ids[0] == (30,)                  # page 2: its second block only
        assert b.num_new_matched_tokens("z", prompt, 0) == 5 * PAGE_TOKENS
        b.update_state_after_alloc("z", [0, 0, 40], 5 * PAGE_TOKENS)        # cannot hold the load
        assert b.build_plan().failed == {"z": (40,)}                        # the null block is no error


def test_pages_the_store_holds_are_not_copied_again(store: Path) -> None:
    """vLLM's prefix cache covers a prompt whose pages the store holds: nothing is saved; pages
    it covers that the store lacks (evicted) are saved again, from vLLM's real blocks."""
    prompt = list(range(9000, 9000 + 4 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        a = SchedulerSide(NS, BS, c.lookup)
        a.schedule("r", prompt[:2 * PAGE_TOKENS], list(range(1, 5)), True, 0, 2 * PAGE_TOKENS)
        worker(c, caches(seed=6)).save(a.build_plan().saves[0])
        assert wait_for(lambda: c.lookup(a._keys("x", prompt[:2 * PAGE_TOKENS])) == 2)
        s = SchedulerSide(NS, BS, c.lookup)
        assert s.num_new_matched_tokens("again", prompt, 4 * PAGE_TOKENS) == 0  # vLLM holds it all
        s.schedule("again", prompt, list(range(1, 10)), True, 4 * PAGE_TOKENS, len(prompt))
        (t,) = s.build_plan().saves
        assert t.block_ids == ((5, 6), (7, 8))                # pages 2 and 3 only


def test_a_reset_moves_every_key_and_drops_requests_in_flight(store: Path) -> None:
    prompt = list(range(11000, 11000 + 3 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        s = SchedulerSide(NS, BS, c.lookup)
        s.schedule("old", prompt, list(range(1, 3)), True, 0, PAGE_TOKENS)
        worker(c, caches(seed=7)).save(s.build_plan().saves[0])
        old = s._keys("x", prompt)
        assert wait_for(lambda: s.num_new_matched_tokens("q", prompt, 0) == PAGE_TOKENS)
        s.reset()
        assert set(s._keys("x", prompt)).isdisjoint(old)
        assert s.num_new_matched_tokens("q2", prompt, 0) == 0           # the old page is never loaded
        s.schedule("old", None, list(range(3, 9)), False, PAGE_TOKENS, len(prompt))
        assert s.build_plan().saves == []                               # started before the reset
        s.schedule("new", prompt, list(range(10, 17)), True, 0, len(prompt))
        (t,) = s.build_plan().saves
        assert len(t.keys) == 3 and set(t.keys).isdisjoint(old)
        # q was looked up (its load of old pages planned) before the reset and is scheduled only after it,
        # as a new request with its prompt: what it holds may be of the old weights, so nothing is saved
        s.schedule("q", prompt, list(range(20, 27)), True, 0, len(prompt))
        assert s.build_plan().saves == []
        assert s.request_finished("q") is False
        s.schedule("q", prompt, list(range(20, 27)), True, 0, len(prompt))  # the id used again, after it ended
        assert len(s.build_plan().saves) == 1


def test_kv_roles_and_tensor_parallel_ranks(store: Path) -> None:
    prompt = list(range(13000, 13000 + 2 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        consumer = SchedulerSide(NS, BS, c.lookup, save=False)
        consumer.schedule("r", prompt, list(range(1, 6)), True, 0, len(prompt))
        assert consumer.build_plan().saves == []
        producer = SchedulerSide(NS, BS, c.lookup, load=False)
        producer.schedule("r", prompt, list(range(1, 6)), True, 0, len(prompt))
        (t,) = producer.build_plan().saves
        kv0, kv1 = caches(seed=8), caches(seed=9)
        assert worker(c, kv0).save(t) == 2
        assert WorkerSide(c, layout_of(kv1, "SIM", BS), BS, BPP, kv1, tp_rank=1).save(t) == 2
        assert wait_for(lambda: consumer.num_new_matched_tokens("q", prompt, 0) == 2 * PAGE_TOKENS)
        assert producer.num_new_matched_tokens("q", prompt, 0) == 0     # a producer never loads
        consumer.update_state_after_alloc("q", list(range(20, 25)), 2 * PAGE_TOKENS)
        (load,) = consumer.build_plan().loads
        got0, got1 = caches(), caches()
        assert worker(c, got0).load(load) == set()
        assert WorkerSide(c, layout_of(got1, "SIM", BS), BS, BPP, got1, tp_rank=1).load(load) == set()
        for name in kv0:  # each rank got its own heads back, not rank 0's
            assert torch.equal(got0[name][20:24], kv0[name][1:5])
            assert torch.equal(got1[name][20:24], kv1[name][1:5])


def test_prefill_decode_handoff_moves_the_prompt_up_to_its_last_block_partial_page_included(store: Path) -> None:
    """P/D: the producer saves every page of the prompt, its partial last page too, and names them in
    kv_transfer_params; the consumer waits (bounded) for them and loads the prompt into its blocks up to
    the block holding the last token (vLLM computes that one), the producer's bytes block for block."""
    prompt = list(range(20000, 20000 + 3 * PAGE_TOKENS + BS + 3))  # 3 whole pages, a tail of 1 block + 3 tokens
    L = len(prompt)
    now = [0.0]
    with KVCacheClient.connect("vllm", home=store) as c:
        kv = caches(seed=11)
        p = SchedulerSide(NS, BS, c.lookup, load=False)                       # kv_producer
        p.note_request("pre", None, {"do_remote_decode": True, "do_remote_prefill": False})
        blocks = list(range(1, 1 + -(-L // BS)))                              # 8 blocks: 3 pages + 2 tail blocks
        p.schedule("pre", prompt, blocks, True, 0, L)
        (t,) = p.build_plan().saves
        assert len(t.keys) == 4 and t.block_ids[-1] == (7, 8)                 # the tail page has 2 blocks
        params = p.transfer_params("pre")
        assert params is not None and params["kvstore_pages"] == 4 and params["do_remote_prefill"] is True
        assert params["kvstore_tokens"] == L
        assert p.request_finished("pre") is True
        # the consumer is asked before the pages are written: it waits (None), within pd_wait_s
        d = SchedulerSide(NS, BS, c.lookup, save=False, pd_wait_s=5.0, clock=lambda: now[0])
        d.note_request("dec", None, params)
        assert d.num_new_matched_tokens("dec", prompt, 0) is None
        w = worker(c, kv)
        assert w.save(t) == 4
        # the tail page: its two blocks in each layer's part, zeros where a whole page has more blocks
        page = w.page_bytes_of((7, 8))
        for (off, end, shape), t_ in zip(w.parts[0], kv.values()):
            assert end - off == int(np.prod(shape)) * 2
            part = page[off:end].view(torch.bfloat16).view(shape)
            assert torch.equal(part[:2], t_[[7, 8]]) and part[2:].count_nonzero() == 0
        # up to the block of the last token (vLLM computes that block, as after its own prefix cache's hits)
        end = (L - 1) // BS * BS
        assert end == 3 * PAGE_TOKENS + BS
        assert wait_for(lambda: d.num_new_matched_tokens("dec", prompt, 0) == end)
        b_blocks = list(range(30, 30 + -(-L // BS)))
        d.update_state_after_alloc("dec", b_blocks, end)
        (load,) = d.build_plan().loads
        assert load.block_ids[-1] == (b_blocks[6],)                          # the tail page's first block
        b_kv = caches()
        assert worker(c, b_kv).load(load) == set()
        for name in kv:
            assert torch.equal(b_kv[name][b_blocks[:7]], kv[name][blocks[:7]])  # every block but the last
        # a tail page is not a whole page: the same tokens followed by more never load it as one
        longer = prompt + list(range(PAGE_TOKENS))
        assert SchedulerSide(NS, BS, c.lookup).num_new_matched_tokens("x", longer, 0) == 3 * PAGE_TOKENS
        # announced pages that never arrive: after pd_wait_s, the ordinary match (what is there)
        other = list(range(40000, 40000 + 2 * PAGE_TOKENS + 5))
        d.note_request("late", None, {"do_remote_prefill": True, "kvstore_pages": 3,
                                      "kvstore_last_key": d._prompt_keys("late", other)[-1].hex()})
        assert d.num_new_matched_tokens("late", other, 0) is None
        now[0] += 5.1
        assert d.num_new_matched_tokens("late", other, 0) == 0
        # a producer whose keys are not ours (another model_id): no wait, the ordinary match
        d.note_request("foreign", None, {"do_remote_prefill": True, "kvstore_pages": 4, "kvstore_last_key": "00" * 32})
        assert d.num_new_matched_tokens("foreign", prompt, 0) == 3 * PAGE_TOKENS


def test_prefill_decode_edges_wait_for_nothing_they_will_not_load(store: Path) -> None:
    """A decoder never waits for pages it would not load (a prompt within one block); a producer that
    skipped a page announces only the pages before it; a tail page holding no block the decoder loads
    is not saved."""
    with KVCacheClient.connect("vllm", home=store) as c:
        d = SchedulerSide(NS, BS, c.lookup, save=False, clock=lambda: 0.0)
        short = list(range(50000, 50000 + BS))                     # the last token's block is the only one
        d.note_request("s", None, {"do_remote_prefill": True, "kvstore_pages": 1,
                                   "kvstore_last_key": d._prompt_keys("s", short)[-1].hex()})
        assert d.num_new_matched_tokens("s", short, 0) == 0     # at once, no wait (None would be a wait)
        # a producer whose page 1 held a null block announces page 0 only
        p = SchedulerSide(NS, BS, c.lookup, load=False)
        prompt = list(range(60000, 60000 + 3 * PAGE_TOKENS + BS + 1))
        p.note_request("g", None, {"do_remote_decode": True})
        p.schedule("g", prompt, [1, 2, NULL_BLOCK, 4, 5, 6, 7, 8], True, 0, len(prompt))
        params = p.transfer_params("g")
        assert params is not None and params["kvstore_pages"] == 1
        assert params["kvstore_last_key"] == p._keys("g", prompt[:PAGE_TOKENS])[0].hex()
        # a tail of fewer tokens than a block: the decoder computes that block, so no tail page is saved
        q = list(range(70000, 70000 + 2 * PAGE_TOKENS + 3))
        p.note_request("t", None, {"do_remote_decode": True})
        p.schedule("t", q, list(range(10, 15)), True, 0, len(q))
        (t,) = [x for x in p.build_plan().saves if x.req_id == "t"]
        assert len(t.keys) == 2 and p.transfer_params("t")["kvstore_pages"] == 2  # type: ignore[index]


def test_lora_adapters_get_key_spaces_of_their_own_and_opaque_inputs_are_never_stored(store: Path) -> None:
    prompt = list(range(80000, 80000 + 2 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        s = SchedulerSide(NS, BS, c.lookup)
        s.note_request("base", None)
        s.note_request("l1", None, lora="sql-adapter\0/adapters/sql")
        s.note_request("l2", None, lora="chat-adapter\0/adapters/chat")
        s.note_request("mm", None, opaque=True)
        for i, r in enumerate(("base", "l1", "l2", "mm")):
            s.schedule(r, prompt, list(range(1 + 5 * i, 6 + 5 * i)), True, 0, len(prompt))
        saves = {t.req_id: set(t.keys) for t in s.build_plan().saves}
        assert set(saves) == {"base", "l1", "l2"}                  # the multimodal request saves nothing
        assert saves["base"].isdisjoint(saves["l1"]) and saves["l1"].isdisjoint(saves["l2"])
        assert s.num_new_matched_tokens("mm", prompt, 0) == 0      # ... and loads nothing


def test_hybrid_groups_save_and_load_their_own_layers_and_a_hit_needs_each_window(store: Path) -> None:
    """vLLM's hybrid manager: a sliding-window group (window of 2 pages, layer 0) and a full-attention
    group (layers 1 and 2), each with its own block ids. Every group's part of a page is a page of
    its own; a hit needs every full-attention page and the sliding group's window only, which is
    all a load reads (vLLM puts null blocks before the window); a group's missing window is a miss."""
    from kvstore.engines.vllm_mapping import Group, group_key

    groups = (Group(2 * PAGE_TOKENS), Group())
    layers = [["layer.0"], ["layer.1", "layer.2"]]
    prompt = list(range(90000, 90000 + 5 * PAGE_TOKENS + 1))
    with KVCacheClient.connect("vllm", home=store) as c:
        src = caches(seed=21)
        wa = WorkerSide(c, layout_of(src, "SIM", BS), BS, BPP, src, groups=layers)
        assert wa.group_bytes == [PAGE_BYTES // 3, 2 * PAGE_BYTES // 3]
        a = SchedulerSide(NS, BS, c.lookup, contains=c.contains, groups=groups)
        blocks_a = [list(range(1, 12)), list(range(20, 31))]
        a.schedule("r", prompt, blocks_a, True, 0, len(prompt))
        saves = a.build_plan().saves
        assert [(t.group, len(t.keys)) for t in saves] == [(0, 5), (1, 5)]
        assert not set(saves[0].keys) & set(saves[1].keys)
        base = a._keys("r", prompt[:5 * PAGE_TOKENS])
        assert list(saves[1].keys) == [group_key(k, 1, 2) for k in base]
        assert all(wa.save(t) == 5 for t in saves)
        # another engine: the sliding group's blocks before the window (token 80 - 32 + 1) are null
        dst = caches()
        wb = WorkerSide(c, layout_of(dst, "SIM", BS), BS, BPP, dst, groups=layers)
        b = SchedulerSide(NS, BS, c.lookup, contains=c.contains, groups=groups)
        assert wait_for(lambda: b.num_new_matched_tokens("q", prompt, 0) == 5 * PAGE_TOKENS)
        skipped = (5 * PAGE_TOKENS - 2 * PAGE_TOKENS + 1) // BS
        blocks_b = [[0] * skipped + list(range(40, 40 + 10 - skipped)), list(range(50, 60))]
        b.update_state_after_alloc("q", blocks_b, 5 * PAGE_TOKENS)
        loads = b.build_plan().loads
        assert [(t.group, len(t.keys)) for t in loads] == [(0, 2), (1, 5)]   # the window: pages 3 and 4
        assert all(0 not in blk for t in loads for blk in t.block_ids)
        for t in loads:
            assert wb.load(t) == set()
        for g, names in enumerate(layers):
            pairs = [(x, y) for x, y in zip(blocks_a[g], blocks_b[g]) if y != 0]
            for name in names:
                for x, y in pairs:
                    assert torch.equal(dst[name][y], src[name][x]), (name, x, y)
        # nothing else was written: other layers' blocks and the null block stay zero
        assert not dst["layer.0"][50:60].any() and not dst["layer.1"][40:48].any() and not dst["layer.0"][0].any()
        # the full group's pages alone are no hit: the sliding group's window is missing
        other = list(range(95000, 95000 + 5 * PAGE_TOKENS + 1))
        a.schedule("o", other, blocks_a, True, 0, len(other))
        full_only = [t for t in a.build_plan().saves if t.group == 1]
        assert wa.save(full_only[0]) == 5
        assert wait_for(lambda: c.lookup(list(full_only[0].keys)) == 5)
        assert b.num_new_matched_tokens("o2", other, 0) == 0


def test_state_groups_save_only_handed_off_boundaries_and_load_the_hits_end(store: Path) -> None:
    """A Mamba hybrid (vLLM's "align" mode): a state group (layer ``mamba.0``, registered as vLLM
    does, one int8 block-major tensor with padded blocks) and a full-attention group. A state
    page is one block, saved only where vLLM hands off a block as a page end's state, never
    from block-table positions; a hit needs the state page at its end, loaded into the block
    vLLM allocated for that boundary, also on top of a hit in vLLM's own prefix cache."""
    from kvstore.engines.vllm_mapping import Group, group_key

    nbytes, pad = 1000, 1536
    groups = (Group(state=True, state_label="sim"), Group())
    layers = [["mamba.0"], ["layer.1", "layer.2"]]
    prompt = list(range(70000, 70000 + 5 * PAGE_TOKENS + 1))

    def kv(seed: int | None) -> dict[str, Any]:
        out = caches(seed=seed)
        del out["layer.0"]
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        buf = (torch.randint(-128, 127, (64, 1, 1, pad), generator=g, dtype=torch.int8) if g is not None
               else torch.zeros((64, 1, 1, pad), dtype=torch.int8))
        return {"mamba.0": buf[..., :nbytes], **out}

    with KVCacheClient.connect("vllm", home=store) as c:
        src = kv(31)
        layout = layout_of(src, "SIM", BS, ["mamba.0"])
        assert layout.state_layers == (("mamba.0", nbytes),) and ":S[1000]" in layout.name
        wa = WorkerSide(c, layout, BS, BPP, src, groups=layers)
        assert wa.group_bytes == [nbytes, 2 * PAGE_BYTES // 3]
        a = SchedulerSide(NS, BS, c.lookup, contains=c.contains, groups=groups)
        blocks_a = [[0] * 9 + [7, 8], list(range(20, 31))]  # the state group's table: nulls and scratch
        a.schedule("r", prompt, blocks_a, True, 0, len(prompt))
        plan = a.build_plan().saves
        assert [(t.group, len(t.keys)) for t in plan] == [(1, 5)]  # no state page from positions
        # hand-offs: page ends 2 and 5 of the state group; not a page end, another group, the null block
        a.boundary_states({"r": [(0, 7, 2 * PAGE_TOKENS), (0, 8, 5 * PAGE_TOKENS), (0, 9, 5 * PAGE_TOKENS - 3),
                                 (1, 21, PAGE_TOKENS), (0, 0, 3 * PAGE_TOKENS)], "unknown": [(0, 5, PAGE_TOKENS)]})
        a.boundary_states({"r": [(0, 8, 5 * PAGE_TOKENS)]})  # handed off again: saved once
        states = a.build_plan().saves
        base = a._keys("r", prompt[:5 * PAGE_TOKENS])
        assert [(t.group, t.keys, t.block_ids) for t in states] == [
            (0, (group_key(base[1], 0, 2),), ((7,),)), (0, (group_key(base[4], 0, 2),), ((8,),))]
        assert all(wa.save(t) == len(t.keys) for t in plan + states)
        # another engine: its table for the hit's state is nulls, then the boundary's block (44)
        dst = kv(None)
        wb = WorkerSide(c, layout_of(dst, "SIM", BS, ["mamba.0"]), BS, BPP, dst, groups=layers)
        b = SchedulerSide(NS, BS, c.lookup, contains=c.contains, groups=groups)
        assert wait_for(lambda: b.num_new_matched_tokens("q", prompt, 0) == 5 * PAGE_TOKENS)
        # on top of vLLM's own hit of one page: the rest, and the state at the hit's end
        assert b.num_new_matched_tokens("local", prompt, PAGE_TOKENS) == 4 * PAGE_TOKENS
        b.update_state_after_alloc("local", [[0] * 9 + [45], list(range(70, 80))], 4 * PAGE_TOKENS)
        local = b.build_plan().loads
        assert [(t.group, len(t.keys), t.block_ids[-1]) for t in local] == [(0, 1, (45,)), (1, 4, (78, 79))]
        b.update_state_after_alloc("q", [[0] * 9 + [44], list(range(50, 60))], 5 * PAGE_TOKENS)
        loads = b.build_plan().loads
        assert [(t.group, t.keys, t.block_ids) for t in loads if t.group == 0] == [
            (0, (group_key(base[4], 0, 2),), ((44,),))]
        for t in loads:
            assert wb.load(t) == set()
        assert torch.equal(dst["mamba.0"][44], src["mamba.0"][8])
        others = [i for i in range(64) if i != 44]
        assert not dst["mamba.0"][others].any()  # no other state block written, padding untouched
        assert not torch.as_strided(dst["mamba.0"], (64, pad), (pad, 1))[:, nbytes:].any()
        for name in layers[1]:
            assert all(torch.equal(dst[name][y], src[name][x]) for x, y in zip(range(20, 30), range(50, 60)))
        # the hit's end has no state page but an earlier page end has: the hit ends there
        shorter = prompt[:4 * PAGE_TOKENS + 1]
        assert b.num_new_matched_tokens("s", shorter, 0) == 2 * PAGE_TOKENS
        # the boundary's block is null: nothing is read, the request is recomputed
        assert b.num_new_matched_tokens("n", prompt, 0) == 5 * PAGE_TOKENS
        b.update_state_after_alloc("n", [[0] * 10, list(range(50, 60))], 5 * PAGE_TOKENS)
        plan_n = b.build_plan()
        assert not plan_n.loads and set(plan_n.failed["n"]) == set(range(50, 60))
