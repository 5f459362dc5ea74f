"""Slot allocation in this server's own areas: free lists, CLOCK eviction, retirement, pins.

Retirement rule (DESIGN.md "Space reuse"): a slot is first marked RETIRED in
the slot table, with its generation bumped (the tombstone peers will see);
from that moment the key index no longer finds it (an entry counts only while
its slot is VALID). Only then may it be overwritten, once no local read pins it
and ``grace_s`` has passed for readers on other servers. The reverse order
(overwrite, then retire) would let a lookup that raced the overwrite hand out a
location whose bytes are changing; header validation would still catch it, but
as a miss the engine could have avoided.

CLOCK never picks a pinned slot, and a RETIRED slot cannot gain a pin (only
VALID slots are found by lookup), so with ``grace_s == 0`` a retired slot is
reusable at once. With ``grace_s > 0`` eviction retires only what writes ask
for: one slot per write that finds nothing free (usable after the grace), and
a reserve sized to the writes of the last grace period, so a steady write
rate keeps finding slots while the rest of the cache keeps serving.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native.lib import LIB

from ..shm.slots import EMPTY, RETIRED, VALID, WRITING


BATCH_MIN = 8  # ``allocate_many`` of fewer pages calls ``allocate`` per page (measured: as cheap or cheaper below 8)


class FreeSlots:
    """A FIFO of free slot ids in a numpy ring (a deque of Python ints costs ~36 bytes a slot,
    which at 10^7 slots is most of the supervisor's memory)."""

    def __init__(self, capacity: int, initial: np.ndarray[Any, Any]) -> None:
        self.buf = np.empty(max(1, capacity), dtype=np.int64)
        self.head = 0
        self.n = len(initial)
        self.buf[:self.n] = initial

    def __len__(self) -> int:
        return self.n

    def popleft(self) -> int:
        """Oldest free slot (raises IndexError when empty)."""
        if not self.n:
            raise IndexError("no free slot")
        g = int(self.buf[self.head])
        self.head = (self.head + 1) % len(self.buf)
        self.n -= 1
        return g

    def pop_many(self, k: int) -> np.ndarray[Any, Any]:
        """The ``min(k, len(self))`` oldest free slots, in order."""
        k = min(k, self.n)
        idx = (self.head + np.arange(k)) % len(self.buf)
        out: np.ndarray[Any, Any] = self.buf[idx]  # fancy indexing: a copy
        self.head = (self.head + k) % len(self.buf)
        self.n -= k
        return out

    def append(self, gid: int) -> None:
        """Return a slot (never more than the capacity: each slot is in at most one place)."""
        self.buf[(self.head + self.n) % len(self.buf)] = gid
        self.n += 1


class Generations:
    """Per-area generation source: strictly increasing, also across restarts.

    ``next()`` returns ``max(last + 1, now in microseconds)``: the clock term
    keeps generations increasing after a restart even where a slot's last
    header was destroyed, as long as the wall clock does not go back by more
    than the service was down.
    """

    def __init__(self, floor: int = 0, clock: Callable[[], int] = time.time_ns) -> None:
        self.last = floor
        self._clock = clock

    def next(self) -> int:
        """A generation greater than every one returned or observed before."""
        self.last = max(self.last + 1, self._clock() // 1000)
        return self.last

    def next_many(self, k: int) -> np.ndarray[Any, Any]:
        """``k`` generations, increasing, each greater than every one returned before (as ``k``
        calls of ``next`` one after the other would give)."""
        first = max(self.last + 1, self._clock() // 1000)
        self.last = first + k - 1 if k else self.last
        return np.arange(first, first + k, dtype=np.uint64)

    def observe(self, gen: int) -> None:
        """Account for a generation found on the device."""
        self.last = max(self.last, gen)


@dataclass(frozen=True)
class AllocatorStatistics:
    """A snapshot of the allocator."""

    own_slots: int
    """Slots in this server's areas."""
    free: int
    """Own slots empty and ready to write."""
    quarantined: int
    """Retired own slots waiting for pins or the grace period."""
    pinned: int
    """Slots (any area) pinned by reads in flight."""


class Allocator:
    """Hands out own slots for writes, one device at a time.

    Invariant: a gid is in at most one of {free list, quarantine, WRITING,
    VALID}; a slot handed out by ``allocate`` is in state WRITING with a fresh
    generation and is neither pinned nor indexed.
    """

    def __init__(self, slots: np.ndarray[Any, Any], own: Sequence[range], gens: Sequence[Generations],
                 grace_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 on_retire: Callable[[np.ndarray[Any, Any]], None] | None = None,
                 ref: np.ndarray[Any, Any] | None = None,
                 reading: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]] | None = None) -> None:
        """``own[d]`` is the gid range of this server's area on device ``d``; ``on_retire(gids)``
        is told of every tombstone (the sync agent publishes it); ``ref``: the CLOCK reference
        bits, one byte per slot (in shared memory, where clients' lookups set them; private if None);
        ``reading(gids)``: for each slot, whether a client's direct read pins it (a retired slot
        is reused only once it is neither pinned here nor there)."""
        self.reading = reading
        self.slots = slots
        # field views, made once: ``slots["state"]`` builds a new view on every call (~1 us), and
        # the allocator's per-write path touches a slot's fields a dozen times
        self._state = slots["state"]
        self._gen = slots["gen"]
        self._len = slots["length"]
        self._dw = [slots["d0"], slots["d1"], slots["d2"], slots["d3"]]
        self.own = list(own)
        self.gens = list(gens)
        self.on_retire = on_retire
        self.grace_s = grace_s
        self.clock = clock
        n = len(slots)
        self.pins = np.zeros(n, dtype=np.int32)
        self.pinned_slots = 0  # slots with a read in flight (kept here: counting 10^7 pins per tick is slow)
        self.sticky = np.zeros(n, dtype=np.int32)  # client pins: CLOCK never evicts these
        self.owner = np.full(n, -1, dtype=np.int32)  # tenant id that wrote the slot (-1: unknown)
        self.used_by: dict[int, int] = {}            # tenant id -> own slots it holds (valid or being written)
        self.pinned_by: dict[int, set[int]] = {}     # tenant id -> slots it pinned
        self.ref = ref if ref is not None else np.zeros(n, dtype=np.uint8)
        self.free: list[FreeSlots] = []
        self.quarantine: list[deque[tuple[int, float]]] = [deque() for _ in own]
        self.hand = [r.start for r in own]
        self.demand: list[deque[float]] = [deque() for _ in own]  # times of writes that needed eviction
        self.evictions = 0
        for r in own:
            st = slots["state"][r.start:r.stop]
            self.free.append(FreeSlots(len(r), r.start + np.nonzero(st != VALID)[0]))
            slots["state"][r.start:r.stop][st != VALID] = EMPTY

    def pin(self, gid: int) -> None:
        """A read of ``gid`` is in flight; also marks it recently used."""
        if not self.pins[gid]:
            self.pinned_slots += 1
        self.pins[gid] += 1
        self.ref[gid] = 1

    def unpin(self, gid: int) -> None:
        """The read of ``gid`` is done."""
        self.pins[gid] -= 1
        if not self.pins[gid]:
            self.pinned_slots -= 1

    def touch(self, gids: np.ndarray[Any, Any]) -> None:
        """Mark slots recently used (lookup hits)."""
        self.ref[gids] = 1

    def retire(self, gid: int, device: int) -> None:
        """Retire an own VALID slot: tombstone generation (unindexes it), quarantine until safe."""
        t = int(self.owner[gid])
        if t >= 0 and self._state[gid] == VALID:
            self.used_by[t] = self.used_by.get(t, 0) - 1
            self.owner[gid] = -1
        if self.sticky[gid]:  # only a failed validation retires a pinned slot: the pin goes too
            self.sticky[gid] = 0
            for pins in self.pinned_by.values():
                pins.discard(gid)
        # state first, then the generation: a client that reads gen, state, gen (client.py
        # _post_direct) and sees VALID then also sees the old generation twice, never a new
        # generation beside the old state (that read would expect a header no device holds)
        self._state[gid] = RETIRED
        LIB.kv_fence()
        self._gen[gid] = self.gens[device].next()
        self.quarantine[device].append((gid, self.clock() + self.grace_s))
        if self.on_retire is not None:
            self.on_retire(np.array([gid], dtype=np.int64))

    def _from_quarantine(self, device: int) -> int:
        q = self.quarantine[device]
        now = self.clock()
        for _ in range(len(q)):
            gid, ready = q[0]
            if ready > now:
                return -1  # FIFO with one grace: later entries are not ready either
            q.popleft()
            if self.pins[gid] == 0 and (self.reading is None
                                        or not self.reading(np.array([gid], dtype=np.int64))[0]):
                return gid
            q.append((gid, now))  # still pinned: look again later
        return -1

    def _retire_one(self, device: int, tenant: int | None = None) -> bool:
        """CLOCK: retire the next own VALID slot that is neither pinned nor recently used (of
        ``tenant`` only, if given); False if a full double sweep finds none."""
        r = self.own[device]
        st = self._state
        for _ in range(2 * len(r)):
            gid = self.hand[device]
            self.hand[device] = gid + 1 if gid + 1 < r.stop else r.start
            if st[gid] != VALID or self.pins[gid] or self.sticky[gid]:
                continue
            if tenant is not None and self.owner[gid] != tenant:
                continue
            if self.ref[gid]:
                self.ref[gid] = 0
                continue
            self.retire(gid, device)
            self.evictions += 1
            return True
        return False

    def _clock_sweep(self, device: int, tenant: int | None = None) -> int:
        """Retire for a write that found nothing free. Without a grace period a retired slot is
        reusable at once: retire until one comes out of quarantine. With one, retire a single
        slot per call: it becomes usable after the grace, and retiring more now would only empty
        the cache (each retired page is a miss everywhere) without giving this write a slot."""
        n = len(self.own[device])
        for k in range(max(1, n)):
            if not self._retire_one(device, tenant):
                if tenant is not None and k == 0:
                    # a tenant at its quota with nothing of its own to evict: a slot from the
                    # quarantine would take it over its quota
                    return -1
                return self._from_quarantine(device)
            got = self._from_quarantine(device)
            if got >= 0 or self.grace_s > 0:
                return got
        return -1

    def _top_up(self, device: int) -> None:
        """With a grace period, keep about as many slots in quarantine as writes needed eviction
        during the last grace period (at most a quarter of the area), so that a steady stream of
        writes finds slots whose grace has passed instead of being dropped. At most two
        retirements per write."""
        now = self.clock()
        q = self.demand[device]
        q.append(now)
        while q and q[0] < now - self.grace_s:
            q.popleft()
        want = min(len(q), len(self.own[device]) // 4)
        for _ in range(2):
            if len(self.free[device]) + len(self.quarantine[device]) >= want:
                return
            if not self._retire_one(device):
                return

    def allocate(self, device: int, tenant: int = -1, quota: int | None = None) -> int:
        """An own slot on ``device`` ready to write (state WRITING, new generation), or -1.

        A tenant at its ``quota`` gets one of its own pages evicted instead of free space.
        """
        if not len(self.own[device]):
            return -1
        if quota is not None and self.used_by.get(tenant, 0) >= quota:
            gid = self._clock_sweep(device, tenant)
        else:
            evicting = not self.free[device]
            gid = self.free[device].popleft() if self.free[device] else self._from_quarantine(device)
            if gid < 0:
                gid = self._clock_sweep(device)
            if self.grace_s > 0 and evicting:
                self._top_up(device)
        if gid < 0:
            return -1
        # a slot counts against its tenant from allocation on: a batch cannot overshoot the quota
        self.owner[gid] = tenant
        if tenant >= 0:
            self.used_by[tenant] = self.used_by.get(tenant, 0) + 1
        self._gen[gid] = self.gens[device].next()
        self._state[gid] = WRITING
        self._len[gid] = 0
        self.ref[gid] = 1
        return gid

    def allocate_many(self, device: int, k: int, tenant: int = -1, quota: int | None = None) -> np.ndarray[Any, Any]:
        """Up to ``k`` own slots on ``device`` ready to write, as ``k`` calls of ``allocate``
        would give them (fewer when the area has no more to give), in one pass: a put's pages
        are allocated per batch, not per page (the supervisor's per-page Python was the largest
        share of a save's CPU). Without a grace period, the slots a full area needs are chosen
        by one CLOCK sweep over numpy windows and retired together."""
        r = self.own[device]
        if k <= 0 or not len(r):
            return np.zeros(0, dtype=np.int64)
        if k < BATCH_MIN or (quota is not None and self.used_by.get(tenant, 0) + k > quota) or (
                self.grace_s > 0 and len(self.free[device]) < k):
            # a few pages (a window of numpy calls costs more than ``allocate`` a few times),
            # at the quota (a tenant's own pages are evicted) or evicting under a grace period
            # (``_top_up``'s reserve): page by page
            got = []
            for _ in range(k):
                g = self.allocate(device, tenant, quota)
                if g < 0:
                    break
                got.append(g)
            return np.array(got, dtype=np.int64)
        parts = [self.free[device].pop_many(k)]
        need = k - len(parts[0])
        while need:  # slots a pin kept in quarantine, ready now
            g = self._from_quarantine(device)
            if g < 0:
                break
            parts.append(np.array([g], dtype=np.int64))
            need -= 1
        while need:
            victims = self._clock_evict(device, need)
            if not len(victims):
                break
            if self.reading is not None:
                busy = self.reading(victims)
                if busy.any():  # a client's direct read pins them: quarantined until it is done
                    now = self.clock()
                    self.quarantine[device].extend((int(g), now) for g in victims[busy])
                    victims = victims[~busy]
            parts.append(victims)
            need -= len(victims)
        gids = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if not len(gids):
            return gids
        self.owner[gids] = tenant
        if tenant >= 0:
            self.used_by[tenant] = self.used_by.get(tenant, 0) + len(gids)
        self._gen[gids] = self.gens[device].next_many(len(gids))
        self._state[gids] = WRITING
        self._len[gids] = 0
        self.ref[gids] = 1
        return gids

    def _clock_evict(self, device: int, k: int) -> np.ndarray[Any, Any]:
        """Retire the next ``k`` slots CLOCK picks on ``device`` and return them: what ``k`` calls
        of ``_retire_one`` do (VALID, neither pinned nor client-pinned, reference bit clear; a
        set bit is cleared on the way), a window of slots at a time. As there, the search for
        each slot gives up after two sweeps of the area from the last slot found, and the hand
        ends where it would."""
        r = self.own[device]
        out: list[np.ndarray[Any, Any]] = []
        found = 0
        budget = 2 * len(r)  # steps left since the last slot found
        while found < k and budget > 0:
            h = self.hand[device]
            w = min(max(256, 8 * (k - found)), r.stop - h, budget)
            cand = (self._state[h:h + w] == VALID) & (self.pins[h:h + w] == 0) & (self.sticky[h:h + w] == 0)
            refd = self.ref[h:h + w] != 0
            vic = np.flatnonzero(cand & ~refd)
            end = w
            if len(vic) >= k - found:
                vic = vic[:k - found]
                end = int(vic[-1]) + 1
            clear = np.flatnonzero(cand[:end] & refd[:end])
            if len(clear):
                self.ref[h + clear] = 0
            self.hand[device] = h + end if h + end < r.stop else r.start
            if len(vic):
                got = (h + vic).astype(np.int64)
                self._retire_many(got, device)  # now: a later sweep of this call must not pick them again
                out.append(got)
                found += len(vic)
                budget = 2 * len(r) - (end - int(vic[-1]) - 1)
            else:
                budget -= end
        self.evictions += found
        return np.concatenate(out) if len(out) > 1 else out[0] if out else np.zeros(0, dtype=np.int64)

    def _retire_many(self, gids: np.ndarray[Any, Any], device: int) -> None:
        """``retire`` for VALID slots that no one pins (``_clock_evict``'s), together; with no
        grace period they are reused at once, so they do not go to the quarantine."""
        t = self.owner[gids]
        t = t[t >= 0]
        if len(t):
            lo, hi = int(t.min()), int(t.max())
            if lo == hi:  # the usual case: one tenant's pages (np.unique costs more than the rest)
                self.used_by[lo] = self.used_by.get(lo, 0) - len(t)
            else:
                for tenant, n in zip(*np.unique(t, return_counts=True)):
                    self.used_by[int(tenant)] = self.used_by.get(int(tenant), 0) - int(n)
        self.owner[gids] = -1
        # state first, then the generation (as ``retire``)
        self._state[gids] = RETIRED
        LIB.kv_fence()
        self._gen[gids] = self.gens[device].next_many(len(gids))
        if self.on_retire is not None:
            self.on_retire(gids)

    def commit(self, gids: np.ndarray[Any, Any], words: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]) -> None:
        """The writes of ``gids`` completed (``words``: one row of 4 per gid): record the keys and
        mark them VALID (caller indexes them)."""
        for i, f in enumerate(self._dw):
            f[gids] = words[:, i]
        self._len[gids] = lengths
        self._state[gids] = VALID

    def abandon(self, gid: int, device: int) -> None:
        """The write of ``gid`` failed or was dropped: the slot is empty again."""
        t = int(self.owner[gid])
        if t >= 0:
            self.used_by[t] = self.used_by.get(t, 0) - 1
            self.owner[gid] = -1
        self._state[gid] = EMPTY
        self.free[device].append(gid)

    def drop(self, gid: int, device: int | None) -> None:
        """A read of ``gid`` failed validation: forget the location (own slots are retired)."""
        if device is not None and self._state[gid] == VALID:
            self.retire(gid, device)
        elif self._state[gid] == VALID:
            self._state[gid] = EMPTY

    def pin_client(self, gid: int, tenant: int, quota: int) -> bool:
        """Pin an own VALID slot for ``tenant`` so CLOCK never evicts it; False at the quota."""
        pins = self.pinned_by.setdefault(tenant, set())
        if gid in pins:
            return True
        if len(pins) >= quota:
            return False
        pins.add(gid)
        self.sticky[gid] += 1
        return True

    def unpin_client(self, gid: int, tenant: int) -> bool:
        """Drop ``tenant``'s pin of ``gid``; False if it had none."""
        pins = self.pinned_by.get(tenant, set())
        if gid not in pins:
            return False
        pins.discard(gid)
        self.sticky[gid] -= 1
        return True

    def unpin_tenant(self, tenant: int) -> int:
        """Drop every pin of ``tenant`` (its key space moved: those pages are never asked for
        again, and their keys no longer name them for an unpin); returns how many."""
        pins = self.pinned_by.pop(tenant, set())
        for gid in pins:
            self.sticky[gid] -= 1
        return len(pins)

    def statistics(self) -> AllocatorStatistics:
        """Own slots, free, quarantined, pinned."""
        return AllocatorStatistics(sum(len(r) for r in self.own), sum(len(f) for f in self.free),
                                   sum(len(q) for q in self.quarantine), self.pinned_slots)
