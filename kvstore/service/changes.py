"""One feed of slot changes: what the slot table gained or lost, for whoever publishes it.

Four kinds of change reach the feed, each at the moment it happens, while the slot still
holds the register it is about:

- ``STORED``: own writes committed (``Requests``);
- ``RETIRED``: an own slot retired, evicted or dropped after a failed validation (``Allocator``);
- ``MERGED``: peers' registers merged (``SyncLink``): ``gids`` became VALID, ``removed`` are the
  digests of the VALID registers the merge replaced;
- ``FORGOTTEN``: pages no longer read here (a denied server's area, another server's page that
  failed validation); their digests still sit in the slots.

Subscribers are callables taking a ``Change``: the sync link publishes own changes (stored and
retired registers) to peers, the KV-event publisher announces every change to routers. A change
costs nothing when nobody listens: publishers that need digests compute them themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

STORED, RETIRED, MERGED, FORGOTTEN = "stored", "retired", "merged", "forgotten"
KINDS = (STORED, RETIRED, MERGED, FORGOTTEN)


@dataclass(frozen=True)
class Change:
    """One change of the slot table (see the module doc)."""

    kind: str
    gids: np.ndarray[Any, Any]
    """The slots it is about (int64), holding their registers as of the change."""
    removed: tuple[bytes, ...] = ()
    """``MERGED`` only: digests of the VALID registers the merge replaced."""

    @property
    def own(self) -> bool:
        """A change of this server's own area (what peers learn from us)."""
        return self.kind in (STORED, RETIRED)


Subscriber = Callable[[Change], None]


class ChangeFeed:
    """Hands every change to every subscriber, in order, synchronously (the service loop's thread)."""

    def __init__(self) -> None:
        self._subs: list[Subscriber] = []

    def subscribe(self, sub: Subscriber) -> None:
        """Hear every change from now on."""
        self._subs.append(sub)

    def emit(self, kind: str, gids: Any, removed: tuple[bytes, ...] = ()) -> None:
        """Announce one change; ``gids`` are slot ids (any int sequence)."""
        if kind not in KINDS:
            raise ValueError(f"unknown change kind {kind!r}")
        if not self._subs:
            return
        g = np.asarray(gids, dtype=np.int64).reshape(-1)
        if not len(g) and not removed:
            return
        ch = Change(kind, g, removed)
        for s in self._subs:
            s(ch)

    def stored(self, gids: Any) -> None:
        """Own writes committed."""
        self.emit(STORED, gids)

    def retired(self, gids: Any) -> None:
        """Own slots retired (``Allocator``'s ``on_retire``)."""
        self.emit(RETIRED, gids)

    def merged(self, removed: list[bytes], gids: Any) -> None:
        """Peers' registers merged (``SyncLink``'s ``on_change``)."""
        self.emit(MERGED, gids, tuple(removed))

    def forgotten(self, gids: Any) -> None:
        """Pages this server no longer reads."""
        self.emit(FORGOTTEN, gids)


__all__ = ["Change", "ChangeFeed", "FORGOTTEN", "KINDS", "MERGED", "RETIRED", "STORED", "Subscriber"]
