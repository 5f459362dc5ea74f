"""Peer wire messages: msgpack maps with a version, registers as raw little-endian arrays.

Every message is one ZMQ frame holding a msgpack map (docs/FORMAT.md "Peer messages")::

    {"v": 1, "t": "d",  "o": owner, "e": epoch, "s": first_seq, "r": <n x 56 bytes>}   deltas (PUB)
    {"v": 1, "t": "hb", "o": owner, "e": epoch, "s": next_seq}                        heartbeat (PUB)
    {"v": 1, "t": "q",  "o": owner, "e": epoch, "s": from_seq}                        request (DEALER -> ROUTER)
    {"v": 1, "t": "a",  "o": owner, "e": epoch, "s": from_seq, "n": next_seq,
     "snap": bool, "last": bool, "r": <n x 56 bytes>}                                  answer (ROUTER -> DEALER)
    {"v": 1, "t": "h",  "o": owner, "e": 0, "s": 0, "r": <n x 56 bytes>}              hit hints (DEALER -> ROUTER):
                                                                                      the owner's slots the sender read

``owner`` is the area index of the server whose registers these are; ``epoch``
identifies one run of that server's service (its start time in ns), ``seq``
numbers its deltas within the epoch. A receiver accepts registers only from
the owner itself (the socket it came on is connected to, and authenticated
as, that server), only for the owner's own area, within the store's device and
slot ranges, in a wire state, and with a length within the page size.
Anything else is dropped and counted; decoding never raises past ``decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..shm.slots import RETIRED, VALID, SlotMap
from .register import REGISTER_DTYPE

VERSION = 1
MAX_RECORDS = 1 << 16
MAX_MESSAGE = 64 + MAX_RECORDS * REGISTER_DTYPE.itemsize
KINDS = ("d", "hb", "q", "a", "h")


class BadMessage(ValueError):
    """A peer message failed validation (it is dropped and counted)."""


@dataclass(frozen=True)
class Message:
    """A decoded, validated peer message."""

    kind: str
    """"d" deltas, "hb" heartbeat, "q" request, "a" answer, "h" hit hints."""
    owner: int
    """Area index of the server whose registers (or log) this is about."""
    epoch: int
    """The owner's service run."""
    seq: int
    """First sequence number (d, a), next expected (hb), or first wanted (q)."""
    records: np.ndarray[Any, Any]
    """Registers (REGISTER_DTYPE), empty for hb and q."""
    next_seq: int = 0
    """Answers: the sequence number after the last one covered."""
    snapshot: bool = False
    """Answers: a full snapshot (the log no longer reaches back far enough)."""
    last: bool = True
    """Answers: the final chunk of this answer."""


def encode(kind: str, owner: int, epoch: int, seq: int, records: np.ndarray[Any, Any] | None = None,
           *, next_seq: int = 0, snapshot: bool = False, last: bool = True) -> bytes:
    """One message frame."""
    m: dict[str, Any] = {"v": VERSION, "t": kind, "o": owner, "e": epoch, "s": seq}
    if kind in ("d", "a", "h"):
        assert records is not None and records.dtype == REGISTER_DTYPE
        m["r"] = records.tobytes()
    if kind == "a":
        m.update({"n": next_seq, "snap": snapshot, "last": last})
    out: bytes = msgpack.packb(m, use_bin_type=True)
    return out


def _int(m: dict[Any, Any], k: str, hi: int) -> int:
    v = m.get(k)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hi:
        raise BadMessage(f"field {k!r} missing or out of range")
    return v


def decode(data: bytes, smap: SlotMap, page_size: int, expect_owner: int) -> Message:
    """Parse and validate a frame from the peer whose area is ``expect_owner``.

    Raises:
        BadMessage: anything malformed, out of range, or about another owner.
    """
    if len(data) > MAX_MESSAGE:
        raise BadMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=MAX_MESSAGE,
                            max_str_len=16, max_array_len=0, max_map_len=16)
    except Exception as e:
        raise BadMessage(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(m, dict) or m.get("v") != VERSION:
        raise BadMessage("not a version 1 message")
    kind = m.get("t")
    if kind not in KINDS:
        raise BadMessage("unknown message type")
    owner = _int(m, "o", smap.n_areas)
    if owner != expect_owner:
        raise BadMessage(f"peer {expect_owner} sent a message about owner {owner}")
    epoch = _int(m, "e", 1 << 64)
    seq = _int(m, "s", 1 << 64)
    recs = np.zeros(0, dtype=REGISTER_DTYPE)
    if kind in ("d", "a", "h"):
        raw = m.get("r")
        if not isinstance(raw, bytes) or len(raw) % REGISTER_DTYPE.itemsize:
            raise BadMessage("register array missing or truncated")
        recs = np.frombuffer(raw, dtype=REGISTER_DTYPE)
        if len(recs) > MAX_RECORDS:
            raise BadMessage("too many registers")
        check_records(recs, smap, page_size, owner)
    if kind == "a":
        nxt = _int(m, "n", 1 << 64)
        snap, last = m.get("snap"), m.get("last")
        if not isinstance(snap, bool) or not isinstance(last, bool):
            raise BadMessage("answer flags missing")
        return Message(kind, owner, epoch, seq, recs, nxt, snap, last)
    return Message(kind, owner, epoch, seq, recs)


def check_records(recs: np.ndarray[Any, Any], smap: SlotMap, page_size: int, owner: int) -> None:
    """Validate registers from ``owner`` (vectorized); raises ``BadMessage`` on the first problem."""
    if not len(recs):
        return
    dev = recs["device"].astype(np.int64)
    if (dev >= smap.n_devices).any():
        raise BadMessage("device index out of range")
    if (recs["area"] != owner).any():
        raise BadMessage("register for an area the sender does not own")
    counts = np.array(smap.counts, dtype=np.int64)[dev, owner]
    if (recs["slot"].astype(np.int64) >= counts).any():
        raise BadMessage("slot index out of range")
    st = recs["state"]
    if ((st != VALID) & (st != RETIRED)).any():
        raise BadMessage("register state not VALID or RETIRED")
    if (recs["length"] > page_size).any():
        raise BadMessage("length beyond the page size")
    if (recs["gen"] == 0).any() or (recs["gen"] >= (1 << 62)).any():
        raise BadMessage("generation out of range")
