"""The service's gauges in the stats block, and the board the dashboard reads.

Cheap gauges (heartbeat, clients, pins) every tick; the ones that scan the slot table
(O(slots)) and the board (tenants' usage, recent warnings) once a second.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..logging import recent_warnings
from ..shm.slots import VALID
from .clients import Clients
from .state import StoreState

FULL_EVERY_S = 1.0


class Gauges:
    """Keeps the stats block's gauges and the board current (see the module doc)."""

    def __init__(self, st: StoreState, clients: Clients) -> None:
        self.st = st
        self.clients = clients
        self._last_full = 0.0
        self._last_board: Any = None

    def turn(self, now: float) -> None:
        st, s = self.st, self.st.stats
        s.set("heartbeat_ns", time.time_ns())
        s.set("clients_connected", self.clients.count_all())
        s.set("pins", st.alloc.pinned_slots)
        if now - self._last_full < FULL_EVERY_S:
            return
        self._last_full = now
        states = st.slots["state"]
        s.set("slots_total", st.smap.total)
        s.set("slots_valid", int(np.count_nonzero(states == VALID)))
        own = sum(len(r) for r in st.own)
        own_valid = [int(np.count_nonzero(states[r.start:r.stop] == VALID)) for r in st.own]
        for d, r in enumerate(st.own):
            s.dev_set(d, "own_slots", len(r))
            s.dev_set(d, "own_slots_valid", own_valid[d])
        s.set("own_slots", own)
        s.set("own_slots_valid", sum(own_valid))
        tenants = {}
        for name, tid in self.clients.tenant_ids.items():
            tenants[name] = {"slots": st.alloc.used_by.get(tid, 0), "quota": st.cfg.quota_for(name),
                             "pinned": len(st.alloc.pinned_by.get(tid, ())),
                             "pin_quota": st.cfg.pin_quota_for(name, own)}
        board = {"tenants": tenants, "warnings": recent_warnings()[-10:]}
        if board != self._last_board:
            st.board.write(board)
            self._last_board = board


__all__ = ["Gauges"]
