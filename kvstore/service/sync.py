"""The supervisor's side of replication: publish own updates, merge peers', answer requests.

The supervisor stays the only writer of the slot table: the sync agent hands
it validated peer registers (``in`` ring) and it applies the join here, in
batches, vectorized (``crdt.merge.apply``), then indexes what became VALID.
Own updates (a page written, a slot retired) go into the delta log with a
sequence number and to the agent (``out`` ring). Requests from peers are
answered from the log, or with a snapshot of our areas when the log no longer
reaches back far enough or the peer knew another epoch of ours.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from ..crdt.log import (END_LAST, END_SNAPSHOT, K_ANSWER, K_ANSWER_END, K_DELTA, K_HINT, K_REMOTE, K_REQUEST,
                        SYNC_REC, DeltaLog, SyncRings, to_registers, to_sync)
from ..crdt.merge import apply, gids_of, registers_of
from ..crdt.register import REGISTER_DTYPE
from ..shm.index import KeyIndex
from ..shm.slots import RETIRED, VALID, SlotMap, entry_words
from ..shm.stats import StatsBlock
from .changes import Change
from .state import StoreState

log = structlog.get_logger(__name__)

ANSWER_CHUNK = 1 << 14


@dataclass
class _Answer:
    peer: int
    from_seq: int
    next_seq: int
    snapshot: bool
    regs: np.ndarray[Any, Any]
    sent: int = 0


class SyncLink:
    """Invariant: every own update is in the delta log before it is offered to the agent."""

    def __init__(self, buf: Any, slots: np.ndarray[Any, Any], smap: SlotMap, index: KeyIndex, area: int,
                 epoch: int, log_capacity: int, stats: StatsBlock,
                 on_change: Callable[[list[bytes], np.ndarray[Any, Any]], None] | None = None,
                 on_hint: Callable[[np.ndarray[Any, Any]], None] | None = None) -> None:
        """``on_change(removed digests, gids now valid)`` hears what each merge changed;
        ``on_hint(gids)`` hears which of our slots peers read (still holding what they read).
        ``of`` wires these to a service's state."""
        self.rings = SyncRings(buf)
        self.slots = slots
        self.smap = smap
        self.index = index
        self.area = area
        self.epoch = epoch
        self.log = DeltaLog(log_capacity)
        self.stats = stats
        self.answers: deque[_Answer] = deque()
        self.on_change = on_change
        self.on_hint = on_hint
        self.denied = np.zeros(smap.n_areas, dtype=bool)
        """Areas of denied servers: their registers are dropped, never merged."""
        # a run's log begins with what this server holds: a peer that follows our new epoch from
        # seq 0 then learns of pages saved in an earlier run but never published (stopped or
        # killed right after a save), which no other log holds. An area larger than the log
        # wraps it, and such a peer is answered with a snapshot instead (``_queue_answer``).
        self.log.append(np.concatenate([registers_of(slots, smap, d, area) for d in range(smap.n_devices)]))
        self.pending: list[tuple[int, Any]] = []
        """Own registers as they were when they changed, to publish at the end of the turn."""

    @classmethod
    def of(cls, st: StoreState, buf: Any, epoch: int) -> SyncLink:
        """The link of a service: merges announced on ``st.changes``, peers' reads touch the
        allocator's CLOCK bits, own changes from the feed published each turn."""
        link = cls(buf, st.slots, st.smap, st.index, st.area, epoch, st.cfg.sync.delta_log_records, st.stats,
                   on_change=st.changes.merged, on_hint=st.alloc.touch)
        st.changes.subscribe(link.hear)
        return link

    def hear(self, ch: Change) -> None:
        """Queue the register of an own change *as it is now* (a retired slot is often rewritten
        in the same turn, before the batch is published)."""
        if ch.own:
            self.pending.extend((int(g), self.slots[g].copy()) for g in ch.gids)

    def turn(self, now: float) -> int:
        """Merge peers' registers, push answers, publish this turn's own changes; records handled."""
        n = self.drain() + self.serve_answers()
        if self.pending:
            self.publish(self.pending)
            self.pending = []
        return n

    def publish(self, updates: list[tuple[int, Any]]) -> None:
        """Record own registers, as captured when they changed, as updates and offer them to the agent.

        Only wire states (VALID, RETIRED) are published: a slot being written is not a
        register peers may see (its commit will be).
        """
        updates = [(g, e) for g, e in updates if int(e["state"]) in (VALID, RETIRED)]
        if not updates:
            return
        g = np.array([u[0] for u in updates], dtype=np.int64)
        s = np.array([u[1] for u in updates], dtype=self.slots.dtype)
        regs = np.zeros(len(g), dtype=REGISTER_DTYPE)
        loc = np.array([self.smap.locate(int(x)) for x in g], dtype=np.int64).reshape(-1, 3)
        regs["device"], regs["area"], regs["slot"] = loc[:, 0], loc[:, 1], loc[:, 2]
        for f in ("gen", "d0", "d1", "d2", "d3", "length", "state"):
            regs[f] = s[f]
        seq0 = self.log.append(regs)
        recs = to_sync(regs, K_DELTA, 0, seq0)
        out = self.rings.out
        if out.free() >= len(recs):
            out.put_many(recs)
        # else: the agent is behind; peers see the seq gap and ask for these from the log

    def send_hints(self, gids: list[int]) -> None:
        """Tell the owners of these (remote) slots that we read them; dropped if the ring is full."""
        if not gids:
            return
        g = np.asarray(gids, dtype=np.int64)
        s = self.slots[g]
        regs = np.zeros(len(g), dtype=REGISTER_DTYPE)
        loc = np.array([self.smap.locate(int(x)) for x in g], dtype=np.int64).reshape(-1, 3)
        regs["device"], regs["area"], regs["slot"] = loc[:, 0], loc[:, 1], loc[:, 2]
        for f in ("gen", "d0", "d1", "d2", "d3", "length"):
            regs[f] = s[f]
        regs["state"] = VALID
        recs = to_sync(regs, K_HINT)
        recs["peer"] = regs["area"]
        if self.rings.out.free() >= len(recs):
            self.rings.out.put_many(recs)

    def drain(self) -> int:
        """Merge peers' registers and queue answers to their requests; returns records handled."""
        recs = self.rings.inn.get_batch(1 << 16)
        if not len(recs):
            return 0
        n = len(recs)
        # the agent validated every record, but the ring is input here too: a record that names
        # no slot of this store (or no peer) is dropped and counted, never indexed with
        ok = self._in_range(recs)
        if not ok.all():
            self.stats.add("sync_messages_rejected", int((~ok).sum()))
            recs = recs[ok]
        remote = recs[recs["kind"] == K_REMOTE]
        # re-checked here, not only in the agent: a register is merged only from its area's owner
        bad = remote["area"] != remote["peer"]
        if bad.any():
            self.stats.add("sync_messages_rejected", int(bad.sum()))
            remote = remote[~bad]
        if len(remote) and self.denied.any():
            remote = remote[~self.denied[np.minimum(remote["area"], len(self.denied) - 1)]]
        if len(remote):
            regs = to_registers(remote)
            gids = gids_of(self.smap, regs)
            uniq = np.unique(gids)
            before = self.slots[uniq]  # a copy: what the join may overwrite
            changed = apply(self.slots, gids, regs)
            if len(changed):
                valid = changed[self.slots["state"][changed] == VALID]
                if self.on_change is not None:  # the replaced registers' digests: for KV events
                    old = before[np.searchsorted(uniq, changed)]
                    self.on_change([bytes(d) for d in entry_words(old[old["state"] == VALID])], valid)
                self.index.index_slots(valid)
                self.stats.add("sync_records_merged", len(changed))
        hints = recs[recs["kind"] == K_HINT]
        bad = hints["area"] != self.area  # hints name our own slots only
        if bad.any():
            self.stats.add("sync_messages_rejected", int(bad.sum()))
            hints = hints[~bad]
        if len(hints) and self.denied.any():
            hints = hints[~self.denied[np.minimum(hints["peer"], len(self.denied) - 1)]]
        if len(hints) and self.on_hint is not None:
            regs = to_registers(hints)
            g = gids_of(self.smap, regs)
            same = (self.slots["gen"][g] == regs["gen"]) & (self.slots["state"][g] == VALID)
            self.on_hint(g[same])
            self.stats.add("hints_received", len(hints))
        for r in recs[recs["kind"] == K_REQUEST]:
            self._queue_answer(int(r["peer"]), int(r["seq"]), int(r["gen"]))
        return n

    def _in_range(self, recs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Which records name a peer (area) of the store and, for registers and hints, a slot of it."""
        sm = self.smap
        ok = recs["peer"] < sm.n_areas
        regs = (recs["kind"] == K_REMOTE) | (recs["kind"] == K_HINT)
        if regs.any():
            dev = recs["device"].astype(np.int64)
            area = recs["area"].astype(np.int64)
            inside = (dev < sm.n_devices) & (area < sm.n_areas)
            counts = np.array(sm.counts, dtype=np.int64).reshape(sm.n_devices, sm.n_areas)
            inside[inside] &= recs["slot"][inside].astype(np.int64) < counts[dev[inside], area[inside]]
            ok &= ~regs | inside
        return ok

    def _queue_answer(self, peer: int, from_seq: int, epoch: int) -> None:
        tail = self.log.since(from_seq) if epoch == self.epoch else None
        if tail is not None:
            self.answers.append(_Answer(peer, from_seq, self.log.next, False, tail))
        else:
            snap = [registers_of(self.slots, self.smap, d, self.area) for d in range(self.smap.n_devices)]
            self.answers.append(_Answer(peer, 0, self.log.next, True, np.concatenate(snap)))
            self.stats.add("sync_snapshots_served")
        self.stats.add("sync_answers_served")

    def serve_answers(self) -> int:
        """Push queued answers to the agent as far as the ring has room; returns records pushed."""
        out = self.rings.out
        pushed = 0
        while self.answers:
            a = self.answers[0]
            n = min(ANSWER_CHUNK, len(a.regs) - a.sent)
            if out.free() < n + 1:
                break
            out.put_many(to_sync(a.regs[a.sent:a.sent + n], K_ANSWER, a.peer))
            a.sent += n
            pushed += n
            end = np.zeros(1, dtype=SYNC_REC)
            done = a.sent >= len(a.regs)
            end["kind"], end["peer"], end["seq"], end["gen"] = K_ANSWER_END, a.peer, a.from_seq, a.next_seq
            end["state"] = (END_SNAPSHOT if a.snapshot else 0) | (END_LAST if done else 0)
            out.put_nowait(end[0])
            if done:
                self.answers.popleft()
        return pushed


def new_epoch() -> int:
    """An epoch for this run: the start time in ns (distinct across restarts)."""
    return time.time_ns()
