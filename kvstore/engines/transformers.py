"""Prefix reuse for Hugging Face causal LMs: save a prompt's K/V pages, rebuild the cache, compute the rest.

    from kvstore import KVCacheClient
    from kvstore.engines.transformers import KVStoreCache, generate_with_store

    with KVCacheClient.connect("demo") as client:
        kv = KVStoreCache(client, model, page_tokens=16, model_id="my-model@rev")
        out = generate_with_store(model, input_ids, kv, max_new_tokens=32)

Page layout (one page = ``page_tokens`` tokens of every layer), in the model's
dtype, C order: ``[layer][k=0, v=1][kv_head][token][head_dim]``, zero-padded
to the store's page size. Loading copies each page once, from the client's
shared-memory view straight into the cache tensors.

Limits: batch size 1; models whose cache is a standard ``DynamicCache`` of
full-attention layers (sliding-window and hybrid caches are not keyed).
Saving and loading are best effort: any error, miss or failed validation
means "recompute these tokens", never an exception out of ``load``/``save``.
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch
from transformers import DynamicCache

from ..client import KVCacheClient, PutResult
from ..keys import KeyNamespace, page_keys

log = structlog.get_logger(__name__)


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _cache_kwarg(model: Any) -> str:
    """The name ``forward``/``generate`` take a cache under (``cache`` in transformers 5)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


class KVStoreCache:
    """Saves and loads one model's prompt K/V pages through a ``KVCacheClient``.

    Invariant: a page holds exactly the K/V the model computed for its tokens
    given every token before them (the key chains the whole prefix).
    """

    def __init__(self, client: KVCacheClient, model: Any, *, page_tokens: int, model_id: str,
                 adapter_id: str = "", tenant: str = "") -> None:
        """Args:
            client: a connected client of the store.
            model: a ``PreTrainedModel`` causal LM.
            page_tokens: tokens per page.
            model_id: model name and revision (weights that differ must have different ids).
            adapter_id: adapter applied, if any.
            tenant: tenant namespace.

        Raises:
            ValueError: a page of this model does not fit the store's page size.
        """
        cfg = _text_config(model)
        self.client = client
        self.model = model
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.dtype = model.dtype
        self.page_tokens = page_tokens
        self.ns = KeyNamespace(model_id, str(self.dtype).removeprefix("torch."), self.layers, self.kv_heads,
                               self.head_dim, page_tokens, adapter_id=adapter_id, tenant=tenant, layout="lkhtd")
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.page_bytes = self.layers * 2 * self.kv_heads * page_tokens * self.head_dim * itemsize
        if self.page_bytes > client.page_size:
            raise ValueError(
                f"a page of {page_tokens} tokens of this model is {self.page_bytes} bytes but the store's pages are "
                f"{client.page_size}: create the store with --page-size >= {self.page_bytes} or use fewer page_tokens")
        self.cache_kw = _cache_kwarg(model)

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token (all layers)."""
        return self.page_bytes // self.page_tokens

    def keys(self, input_ids: Any) -> list[bytes]:
        """Page keys of the prompt's whole pages."""
        return page_keys(self.ns, _ids(input_ids))

    def lookup(self, input_ids: Any) -> int:
        """Leading prompt tokens the store holds (a multiple of ``page_tokens``); 0 on any error."""
        try:
            return self.client.lookup(self.keys(input_ids)) * self.page_tokens
        except Exception as e:
            log.warning("kv lookup failed; recomputing", error=repr(e))
            return 0

    def load(self, input_ids: Any, *, max_tokens: int | None = None) -> tuple[Any, int]:
        """Rebuild a cache for the longest stored prefix of the prompt.

        Returns ``(cache, tokens)``: a ``DynamicCache`` holding the first ``tokens``
        tokens, or ``(None, 0)`` when nothing usable is stored. Misses, I/O and
        validation failures, or a lost service all mean fewer (or no) tokens.
        """
        ids = _ids(input_ids)
        limit = len(ids) if max_tokens is None else min(max_tokens, len(ids))
        keys = page_keys(self.ns, ids[:limit])
        try:
            n = self.client.lookup(keys)
            if n == 0:
                return None, 0
            T = self.page_tokens
            K = [torch.empty((1, self.kv_heads, n * T, self.head_dim), dtype=self.dtype) for _ in range(self.layers)]
            V = [torch.empty_like(k) for k in K]
            got = 0
            elems = self.page_bytes // K[0].element_size()
            shape = (self.layers, 2, self.kv_heads, T, self.head_dim)
            missing = False
            while got < n and not missing:
                batch = keys[got:min(n, got + self.client.max_batch)]
                with self.client.get(batch) as pages, warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
                    for view in pages:
                        if view is None:  # evicted or failed validation after lookup: keep the prefix
                            missing = True
                            break
                        page = torch.frombuffer(view, dtype=self.dtype, count=elems).view(shape)
                        sl = slice(got * T, (got + 1) * T)
                        for layer in range(self.layers):
                            K[layer][0, :, sl] = page[layer, 0]
                            V[layer][0, :, sl] = page[layer, 1]
                        got += 1
            if got == 0:
                return None, 0
            data = [(k[:, :, :got * T], v[:, :, :got * T]) for k, v in zip(K, V)]
            return DynamicCache(ddp_cache_data=data, config=self.model.config), got * T
        except Exception as e:
            log.warning("kv load failed; recomputing", error=repr(e))
            return None, 0

    def save(self, input_ids: Any, cache: Any, *, wait: bool = False) -> PutResult | None:
        """Save the whole prompt pages of ``cache`` (K/V of ``input_ids``); ``None`` on any error.

        Pages the store already holds are skipped by the service.
        """
        ids = _ids(input_ids)
        T = self.page_tokens
        try:
            n = min(len(ids), cache.get_seq_length()) // T
            if n == 0:
                return PutResult(0, 0, 0, 0)
            keys = page_keys(self.ns, ids[:n * T])
            start = self.client.lookup(keys)  # leading pages already stored: nothing to build
            totals = [0, 0, 0, start]
            step = self.client.max_batch
            for s in range(start, n, step):
                pages = []
                for p in range(s, min(n, s + step)):
                    sl = slice(p * T, (p + 1) * T)
                    page = torch.stack([torch.stack([cache.layers[layer].keys[0, :, sl],
                                                     cache.layers[layer].values[0, :, sl]])
                                        for layer in range(self.layers)]).contiguous()
                    buf = np.zeros(self.client.page_size, dtype=np.uint8)
                    buf[:self.page_bytes] = page.view(torch.uint8).numpy().reshape(-1)
                    pages.append(buf)
                r = self.client.put(keys[s:s + len(pages)], pages, wait=wait)
                totals[0] += r.stored
                totals[1] += r.queued
                totals[2] += r.skipped
            return PutResult(totals[0], totals[1], totals[2] + totals[3], 0)
        except Exception as e:
            log.warning("kv save failed", error=repr(e))
            return None


@dataclass(frozen=True)
class GenerateResult:
    """What ``generate_with_store`` did."""

    sequences: Any
    """Prompt and generated token ids, ``[1, n]``."""
    cached_tokens: int
    """Prompt tokens whose K/V came from the store."""
    computed_tokens: int
    """Prompt tokens prefilled by the model."""
    load_seconds: float
    """Time spent loading pages."""
    saved: PutResult | None
    """What saving the prompt's pages did (``None``: saving failed or was off)."""


def generate_with_store(model: Any, input_ids: Any, kv: KVStoreCache, *, max_new_tokens: int,
                        save: bool = True, **generate_kwargs: Any) -> GenerateResult:
    """``model.generate`` that first loads the longest stored prefix and afterwards saves the prompt's pages.

    At least one prompt token is always computed (the model needs it to produce
    the first new token's logits).
    """
    ids = torch.as_tensor(input_ids).reshape(1, -1)
    t0 = time.perf_counter()
    cache, n = kv.load(ids, max_tokens=ids.shape[1] - 1)
    t_load = time.perf_counter() - t0
    kw = dict(generate_kwargs)
    if cache is not None:
        kw[kv.cache_kw] = cache
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **kw)
    saved = kv.save(ids, _output_cache(out)) if save else None
    return GenerateResult(out.sequences, n, ids.shape[1] - n, t_load, saved)


def prefill(model: Any, input_ids: Any, kv: KVStoreCache | None = None) -> tuple[Any, Any, int]:
    """One prefill of the prompt, reusing stored pages when ``kv`` is given.

    Returns ``(logits of the computed tokens, cache of the whole prompt, cached tokens)``.
    """
    ids = torch.as_tensor(input_ids).reshape(1, -1)
    cache, n = (kv.load(ids, max_tokens=ids.shape[1] - 1) if kv is not None else (None, 0))
    kw: dict[str, Any] = {"use_cache": True}
    if cache is not None:
        kw[kv.cache_kw if kv is not None else "cache"] = cache
    with torch.no_grad():
        out = model(ids[:, n:], **kw)
    return out.logits, _output_cache(out), n


def _ids(input_ids: Any) -> np.ndarray[Any, Any]:
    if isinstance(input_ids, torch.Tensor):
        return input_ids.reshape(-1).cpu().numpy()
    return np.asarray(input_ids, dtype=np.int64).reshape(-1)
