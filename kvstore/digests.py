"""Key digests: what a client key is called on the wire and in the store.

Two digests, both BLAKE2b-256 (docs/FORMAT.md "Key digests")::

    key id   = BLAKE2b-256(key)                      what a client sends for a key
    digest   = BLAKE2b-256(key = tenant salt; key id)  what the slot table, index and headers hold

A client sends key ids, never digests: the service salts them for the gets it serves, puts
and pins, and an I/O worker salts the id of each direct read with the reading connection's
tenant salt from its own table before it compares it with the slot's register. A client can
read every digest in the slot table, so taking salted digests from it would let one tenant
name another's pages. A client salts only for its own lookups (in ``KVCacheClient``), with
its own tenant's salt, which the service hands it at the hello.

Whole batches go through compiled code, not a Python loop: ``_native/keypack.c`` checks the keys and
packs them into one buffer, ``_native/keys.c`` hashes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._native import _keypack
from ._native.lib import FFI, LIB

DIGEST_BYTES = 32


def _u8(buf: Any) -> Any:
    return FFI.from_buffer("uint8_t[]", buf)


def check_keys(keys: Sequence[Any]) -> list[bytes]:
    """``keys`` as a new list, or ``TypeError``/``ValueError`` naming the first bad key
    (not ``bytes``, or empty)."""
    return _keypack.check(keys)


def pack_keys(keys: Sequence[Any]) -> tuple[bytes, bytes]:
    """``keys`` checked (as ``check_keys``) and concatenated, with their lengths as u64: the input of
    the compiled digest passes (``IndexReader.lookup_keys`` takes it as it is)."""
    return _keypack.pack(keys)


def key_digests(keys: Sequence[bytes], salt: bytes | None = None) -> tuple[np.ndarray[Any, Any],
                                                                           np.ndarray[Any, Any] | None]:
    """Key ids of ``keys`` (``n x 32`` uint8) and, given the tenant ``salt``, their digests
    (``n x 4`` little-endian u64 words), in one pass. Raises as ``check_keys``."""
    n = len(keys)
    ids = np.empty((n, DIGEST_BYTES), dtype=np.uint8)
    words = np.empty((n, 4), dtype="<u8") if salt is not None else None
    if n:
        blob, lens = pack_keys(keys)  # checked, concatenated, lengths as u64: one C pass
        LIB.kv_key_digests(_u8(blob), FFI.from_buffer("uint64_t[]", lens), n,
                           _u8(salt) if salt is not None else FFI.NULL, len(salt) if salt is not None else 0,
                           _u8(ids), _u8(words) if words is not None else FFI.NULL)
    return ids, words


def salted_words(ids: np.ndarray[Any, Any], salt: bytes) -> np.ndarray[Any, Any]:
    """The digests of client key ids (``n x 32`` uint8) in the key space of ``salt``, as ``n x 4`` u64."""
    ids = np.ascontiguousarray(ids, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    out = np.empty((len(ids), 4), dtype="<u8")
    if len(ids):
        LIB.kv_salt_ids(_u8(ids), len(ids), _u8(salt), len(salt), _u8(out))
    return out


def key_id(key: bytes) -> bytes:
    """The id a client sends for one ``key``."""
    return bytes(key_digests(check_keys([key]))[0][0])
