"""The sync agent's process, as the supervisor runs it: started, replaced on a membership change,
restarted when it dies, stopped at shutdown. The loop never waits for it.

The agent itself (``kvstore.crdt.agent``) replicates location deltas with the peers; the
supervisor merges what it hands over (``service/sync.py``). This module only manages the
process: which peers and keys it is started with (the membership in force, the server's own
keypair from this machine), and that a replaced agent is gone before its successor binds the
same endpoints.
"""

from __future__ import annotations

import time
from typing import Any

from ..crdt.agent import ADDRESS_IN_USE_HINT, EXIT_ADDRESS_IN_USE, AgentParams, Peer, agent_main
from ..crdt.serverkeys import keypair_for, load_keypair
from ..errors import NotAllowed
from .runtime import Runtime
from .state import StoreState
from .sync import SyncLink

STOP_GRACE_S = 5.0  # a replaced agent that ignores SIGTERM this long is killed
QUICK_DEATH_S = 10.0  # an agent that dies sooner than this after its start is restarted after a back-off
RESPAWN_FIRST_S = 0.25  # ... doubling per quick death, up to
RESPAWN_MAX_S = 4.0


class AgentProcess:
    """The sync agent's process (see the module doc)."""

    def __init__(self, st: StoreState, rt: Runtime, *, epoch: int, mp: Any, sync: SyncLink,
                 resnapshot: set[int]) -> None:
        """``resnapshot``: areas whose full state the agent must fetch again (the membership part
        adds to it); an agent that cannot start for want of this server's key stops the service
        (``StoreState.give_up``)."""
        self.st = st
        self.server, self.area, self.home, self.epoch = rt.server, st.area, rt.home, epoch
        self.smap, self.rt, self._mp = st.smap, rt, mp
        self.stats, self.log, self.sync = st.stats, st.log, sync
        self.resnapshot = resnapshot
        self.proc: Any = None
        self.old: Any = None
        self.old_at = 0.0
        self.restarts = 0
        self.started_at = 0.0
        self.quick_deaths = 0
        self.respawn_at = 0.0
        """When to start the next agent after one died (0: none pending)."""

    def spawn(self) -> None:
        """Start an agent for the membership in force."""
        self.respawn_at = 0.0
        cfg = self.st.cfg
        me = cfg.servers[self.area]
        try:
            public, secret = keypair_for(cfg.name, me.public_key.encode(), self.home) if me.public_key \
                else load_keypair(cfg.name, self.server, self.home)
        except NotAllowed as e:  # the administrator gave this server a key this machine does not hold
            self.st.give_up(f"{e}; stopped")
            return
        # the membership the new agent serves is the one the supervisor merges for
        self.sync.denied[:len(cfg.servers)] = [s.denied for s in cfg.servers]
        peers = tuple(Peer(s.name, i, *s.endpoints, s.public_key.encode())
                      for i, s in enumerate(cfg.servers) if i != self.area and not s.denied)
        params = AgentParams(
            store=cfg.name, server=self.server, area=self.area, epoch=self.epoch, pub=me.endpoints[0],
            router=me.endpoints[1], public_key=public, secret_key=secret, peers=peers,
            counts=tuple(tuple(c) for c in self.smap.counts), page_size=cfg.page_size,
            sync_segment=self.rt.name("sync"), stats_name=self.rt.name("stats"), doorbell=self.rt.doorbell,
            flush_interval_s=cfg.sync.flush_interval_s, flush_records=cfg.sync.flush_records,
            heartbeat_s=cfg.sync.heartbeat_s, request_timeout_s=cfg.sync.request_timeout_s,
            snapshot_from=tuple(sorted(self.resnapshot)), peers_board=self.rt.name("peers"),
            start_seq=self.sync.log.next)
        self.proc = self._mp.Process(target=agent_main, args=(params,), daemon=True,
                                     name=f"kvstore-sync-{cfg.name}")
        self.proc.start()
        self.started_at = time.monotonic()

    def replace(self) -> None:
        """Ask the agent to stop; ``check`` (polled) spawns its successor once it is gone."""
        if self.proc is None:
            if self.old is None:
                self.spawn()
            return
        if self.proc.is_alive():
            self.proc.terminate()
        self.old = self.proc
        self.old_at = time.monotonic()
        self.proc = None
        self._finish_stop()

    def turn(self, now: float) -> None:
        """The tick's work: ``check``."""
        self.check()

    def check(self) -> None:
        """Restart an agent that died (after a back-off when it keeps dying at start); finish
        replacing one."""
        now = time.monotonic()
        if self.proc is not None and not self.proc.is_alive() and not self.st.stopping:
            self.quick_deaths = self.quick_deaths + 1 if now - self.started_at < QUICK_DEATH_S else 0
            delay = min(RESPAWN_MAX_S, RESPAWN_FIRST_S * 2 ** (self.quick_deaths - 1)) if self.quick_deaths else 0.0
            if self.proc.exitcode == EXIT_ADDRESS_IN_USE:
                self.log.warning("sync agent could not bind the sync address (in use); restarting",
                                 pid=self.proc.pid, in_s=delay, hint=ADDRESS_IN_USE_HINT)
            else:
                self.log.warning("sync agent lost; restarting", pid=self.proc.pid, code=self.proc.exitcode,
                                 in_s=delay)
            self.proc.join(0)
            self.proc = None
            self.restarts += 1
            self.stats.set("sync_restarts", self.restarts)
            self.respawn_at = now + delay
        if self.respawn_at and now >= self.respawn_at and self.proc is None and self.old is None \
                and not self.st.stopping:
            self.spawn()
        self._finish_stop()

    def _finish_stop(self) -> None:
        old = self.old
        if old is None:
            return
        if old.is_alive():
            if time.monotonic() - self.old_at > STOP_GRACE_S:
                old.kill()  # SIGTERM ignored: the replacement must not wait for ever
            return
        old.join(0)
        self.old = None
        if not self.st.stopping and self.proc is None:
            self.spawn()

    def stop(self) -> None:
        """Stop the agent and wait for it (shutdown only: the loop never waits for a process)."""
        if self.old is not None:
            if self.old.is_alive():
                self.old.kill()
            self.old.join(5.0)
            self.old = None
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.proc = None


__all__ = ["AgentProcess"]
