"""What the vLLM connector does, without vLLM: page keys <-> paged KV blocks, loads, saves, load errors.

vLLM keeps K/V in fixed-size blocks of ``block_size`` tokens; a kvstore page is
``blocks_per_page`` whole blocks (``page_tokens = blocks_per_page * block_size``)
of every layer. Page layout (``KeyNamespace.layout == "lkthd"``), C order:
``[layer][k=0, v=1][token][kv_head][head_dim]`` — for each layer, K then V of
the page's tokens in the order vLLM's flash-attention cache holds them
(``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer), so a page
moves block by block with plain slice copies.

``SchedulerSide`` runs where vLLM schedules: how many prompt tokens can be
loaded, which blocks to load them into, which pages to save. ``WorkerSide``
runs in each worker: it copies pages between the client's shared-memory views
and the paged cache tensors and reports the blocks it could not fill (misses,
I/O errors, failed validation, a lost service) so that vLLM recomputes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from ..client import KVCacheClient
from ..keys import KeyNamespace, page_keys

log = structlog.get_logger(__name__)

LAYOUT = "lkthd"


@dataclass(frozen=True)
class PageTransfer:
    """Pages of one request and the vLLM blocks they map to (``blocks_per_page`` per page)."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    """Connector metadata of one engine step: what the workers load and save."""

    loads: list[PageTransfer] = field(default_factory=list)
    saves: list[PageTransfer] = field(default_factory=list)


class SchedulerSide:
    """Scheduler-side bookkeeping. Invariant: a load is planned only for pages that start
    exactly at the request's computed prefix, so no block vLLM already holds is written."""

    def __init__(self, ns: KeyNamespace, block_size: int, lookup: Callable[[list[bytes]], int]) -> None:
        if ns.page_tokens % block_size:
            raise ValueError(f"page_tokens ({ns.page_tokens}) must be a multiple of vLLM's block_size ({block_size})")
        self.ns = ns
        self.block_size = block_size
        self.bpp = ns.page_tokens // block_size
        self.lookup = lookup
        self._matched: dict[str, tuple[int, list[bytes]]] = {}  # req -> (first page, keys of loadable pages)
        self._plan = StepPlan()
        self._saved_pages: dict[str, int] = {}

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (0 on any error or misalignment)."""
        T = self.ns.page_tokens
        if num_computed_tokens % T:
            return 0  # loads start on a page boundary only
        usable = (len(prompt) - 1) // T * T  # vLLM must compute at least one prompt token
        if usable <= num_computed_tokens:
            return 0
        keys = page_keys(self.ns, list(prompt[:usable]))
        try:
            n = self.lookup(keys)
        except Exception as e:
            log.warning("kvstore lookup failed; computing", error=repr(e))
            return 0
        first = num_computed_tokens // T
        if n <= first:
            return 0
        self._matched[req_id] = (first, keys[first:n])
        return (n - first) * T

    def update_state_after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the request's blocks."""
        if num_external_tokens == 0 or req_id not in self._matched:
            return
        first, keys = self._matched.pop(req_id)
        pages = num_external_tokens // self.ns.page_tokens
        b0 = first * self.bpp
        blocks = tuple(block_ids[b0:b0 + pages * self.bpp])
        if len(blocks) < pages * self.bpp:
            log.warning("fewer blocks than pages to load; skipping the load", req=req_id)
            return
        self._plan.loads.append(PageTransfer(req_id, tuple(keys[:pages]), blocks))
        self._saved_pages[req_id] = first + pages  # already in the store

    def prompt_progress(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], computed_after_step: int) -> None:
        """Plan the save of the prompt's whole pages that are computed once this step has run."""
        T = self.ns.page_tokens
        done_pages = min(computed_after_step, len(prompt)) // T
        start = self._saved_pages.get(req_id, 0)
        if done_pages <= start:
            return
        keys = page_keys(self.ns, list(prompt[:done_pages * T]))[start:]
        blocks = tuple(block_ids[start * self.bpp:done_pages * self.bpp])
        if len(blocks) == len(keys) * self.bpp:
            self._plan.saves.append(PageTransfer(req_id, tuple(keys), blocks))
            self._saved_pages[req_id] = done_pages

    def request_finished(self, req_id: str) -> None:
        """Forget a request."""
        self._matched.pop(req_id, None)
        self._saved_pages.pop(req_id, None)

    def build_plan(self) -> StepPlan:
        """This step's plan; the next one starts empty."""
        plan, self._plan = self._plan, StepPlan()
        return plan


class WorkerSide:
    """Moves pages between a client and vLLM's paged KV tensors (one per layer,
    ``[2, num_blocks, block_size, kv_heads, head_dim]``)."""

    def __init__(self, client: KVCacheClient, ns: KeyNamespace, block_size: int,
                 kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.client = client
        self.ns = ns
        self.block_size = block_size
        self.bpp = ns.page_tokens // block_size
        self.names = list(kv_caches)
        self.caches = [kv_caches[n] for n in self.names]
        c0 = self.caches[0]
        if c0.dim() != 5 or c0.shape[0] != 2 or c0.shape[2] != block_size:
            raise ValueError(f"expected per-layer KV caches of shape [2, blocks, {block_size}, heads, dim], "
                             f"got {tuple(c0.shape)}")
        self.heads, self.dim = int(c0.shape[3]), int(c0.shape[4])
        self.dtype = c0.dtype
        self.page_shape = (len(self.caches), 2, self.bpp, block_size, self.heads, self.dim)
        self.page_elems = int(np.prod(self.page_shape))
        self.page_bytes = self.page_elems * c0.element_size()
        if self.page_bytes > client.page_size:
            raise ValueError(f"a page is {self.page_bytes} bytes, the store's pages are {client.page_size}: "
                             f"create the store with --page-size >= {self.page_bytes}")

    def load(self, t: PageTransfer) -> set[int]:
        """Fill the blocks of ``t`` from the store; returns the block ids that could not be filled."""
        done = 0
        try:
            while done < len(t.keys):
                batch = list(t.keys[done:done + self.client.max_batch])
                with self.client.get(batch) as pages, warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
                    for view in pages:
                        if view is None:
                            return set(t.block_ids[done * self.bpp:])
                        page = torch.frombuffer(view, dtype=self.dtype, count=self.page_elems).view(self.page_shape)
                        blocks = list(t.block_ids[done * self.bpp:(done + 1) * self.bpp])
                        idx = torch.tensor(blocks, device=self.caches[0].device)
                        for layer, cache in enumerate(self.caches):
                            cache[:, idx] = page[layer].to(cache.device, non_blocking=False)
                        done += 1
            return set()
        except Exception as e:
            log.warning("kvstore load failed; these blocks are recomputed", req=t.req_id, error=repr(e))
            return set(t.block_ids[done * self.bpp:])

    def save(self, t: PageTransfer) -> int:
        """Copy the pages of ``t`` out of the paged cache and put them; returns pages accepted (0 on error)."""
        try:
            n = 0
            for s in range(0, len(t.keys), self.client.max_batch):
                keys = list(t.keys[s:s + self.client.max_batch])
                bufs = []
                for p in range(s, s + len(keys)):
                    idx = torch.tensor(t.block_ids[p * self.bpp:(p + 1) * self.bpp], device=self.caches[0].device)
                    page = torch.stack([cache[:, idx] for cache in self.caches]).to("cpu").contiguous()
                    buf = np.zeros(self.client.page_size, dtype=np.uint8)
                    buf[:self.page_bytes] = page.view(torch.uint8).numpy().reshape(-1)
                    bufs.append(buf)
                r = self.client.put(keys, bufs)
                n += r.stored + r.queued + r.skipped
            return n
        except Exception as e:
            log.warning("kvstore save failed", req=t.req_id, error=repr(e))
            return 0
