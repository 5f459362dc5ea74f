"""Page keys: the one place where a page of K/V gets its name.

A page covers ``page_tokens`` consecutive tokens of every layer (or of a
configured layer range). Its key chains, like vLLM's prefix cache:

    key[0] = H(root, tokens[0:T], extra[0])
    key[i] = H(key[i-1], tokens[i*T:(i+1)*T], extra[i])

where ``root`` is a digest of the namespace: model id, cache layout (dtype,
number of layers and layer range, KV heads, head dim, page tokens, tensor
parallel rank and size), adapter id and tenant. H is BLAKE2b-256 over a
canonical byte encoding (token ids as little-endian int64), never Python's
``hash()``, so keys are equal across processes, machines and Python versions.
Changing any earlier token, the model, the layout or the adapter changes
every later key. Whole pages are keyed by ``page_keys``; a prompt's trailing
partial page gets a key of its own only when one engine hands the whole prompt
to another (``tail_key``, prefill/decode disaggregation), and is otherwise
recomputed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import msgpack
import numpy as np

KEY_BYTES = 32


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that makes the same tokens produce different K/V (or a different tenant)."""

    model_id: str
    """Model name and revision, e.g. ``"meta-llama/Llama-3.1-8B@<sha>"``."""
    dtype: str
    """Element type of K/V as stored, e.g. ``"float16"``."""
    num_layers: int
    """Layers of the model."""
    kv_heads: int
    """KV heads in a page (per tensor-parallel rank)."""
    head_dim: int
    """Head dimension."""
    page_tokens: int
    """Tokens per page."""
    layer_start: int = 0
    """First layer a page holds."""
    layer_stop: int = -1
    """One past the last layer a page holds (-1: all layers)."""
    tp_rank: int = 0
    """Tensor-parallel rank whose heads the page holds."""
    tp_size: int = 1
    """Tensor-parallel world size."""
    adapter_id: str = ""
    """LoRA or other adapter applied (empty: none)."""
    tenant: str = ""
    """Tenant; pages are shared only within one namespace."""
    layout: str = "lkhtd"
    """Byte order of a page's axes: ``"lkhtd"`` = layer, k/v, head, token, dim (the
    transformers adapter); ``"lkthd"`` = layer, k/v, token, head, dim (the vLLM
    connector). Two layouts of the same tokens never share keys."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size), got {self.tp_rank} of {self.tp_size}")
        stop = self.num_layers if self.layer_stop == -1 else self.layer_stop
        if not 0 <= self.layer_start < stop <= self.num_layers:
            raise ValueError(f"layer range [{self.layer_start}, {self.layer_stop}) is not within {self.num_layers} layers")

    @property
    def layers(self) -> range:
        """The layers a page holds."""
        return range(self.layer_start, self.num_layers if self.layer_stop == -1 else self.layer_stop)

    def root(self) -> bytes:
        """The chain's root: a digest of the canonical encoding of every field."""
        blob = msgpack.packb(sorted(asdict(self).items()), use_bin_type=True)
        return hashlib.blake2b(blob, digest_size=KEY_BYTES, person=b"kvstore-ns-v1").digest()


def page_keys(ns: KeyNamespace, token_ids: Sequence[int] | np.ndarray, extra: Sequence[bytes] | None = None,
              *, parent: bytes | None = None) -> list[bytes]:
    """Keys of every whole page of ``token_ids``.

    Args:
        ns: the namespace.
        token_ids: the prompt's token ids (any int sequence or array).
        extra: per-page extra key bytes (multimodal inputs, cache salts), if any.
        parent: continue a chain from this key instead of the namespace root.

    Raises:
        ValueError: ``extra`` has fewer entries than there are whole pages, or a token id
            does not fit in int64.
    """
    toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = len(toks) // ns.page_tokens
    if extra is not None and len(extra) < n:
        raise ValueError(f"extra has {len(extra)} entries for {n} pages")
    key = parent if parent is not None else ns.root()
    out = []
    T = ns.page_tokens
    le = toks.astype("<i8", copy=False)
    for i in range(n):
        h = hashlib.blake2b(key, digest_size=KEY_BYTES, person=b"kvstore-page")
        h.update(le[i * T:(i + 1) * T].tobytes())
        if extra is not None:
            h.update(struct.pack("<I", len(extra[i])) + extra[i])
        key = h.digest()
        out.append(key)
    return out


def tail_key(parent: bytes, tail_token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Key of a prompt's last, partial page: its tokens after the whole pages, chained from
    ``parent`` (the last whole page's key, or the chain's root).

    Used where one engine hands a whole prompt to another (prefill/decode disaggregation):
    a tail key never equals a whole page's key (another BLAKE2b personalization, and the
    token count is hashed), so a later, longer prompt never loads a partial page as whole.

    Raises:
        ValueError: ``tail_token_ids`` is empty, or a token id does not fit in int64.
    """
    toks = np.asarray(tail_token_ids, dtype=np.int64).reshape(-1)
    if not len(toks):
        raise ValueError("a tail page has at least one token")
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvstore-tail")
    h.update(struct.pack("<I", len(toks)) + toks.astype("<i8", copy=False).tobytes())
    return h.digest()
