"""Membership while serving: re-read the devices' superblocks and this machine's config, off the
loop (``MembershipWatcher``), and apply what changed between requests (``Reloads``).

The supervisor's loop must never wait on a device (a stalled NVMe-oF target would stall
every client), so a daemon thread does the reading: every ``interval`` seconds, or at
once when poked (SIGHUP, sent by ``mass-ctl kvcache allow/deny`` on this machine), it
reads this machine's config and every device's superblocks, verifies them
(storage/membership.py) and, when the membership generation or the config file
changed, hands the composed store to the loop, which applies it between requests.
A read that fails (a torn or forged superblock, a broken config file) is handed over
as the error, once per distinct error; the loop logs it and serves on with what it has.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from typing import Any

import zmq.utils.z85

from ..config import MEMBERSHIP_POLL_S, StoreConfig, compose_membership, load_local, seen_record, store_path
from ..crdt.serverkeys import serving_key
from ..errors import KVStoreError, NotAllowed
from ..storage.membership import Membership, read_membership
from .state import StoreState

Update = tuple[StoreConfig, Membership]


class MembershipWatcher:
    """Polls store ``name``'s membership and config in a thread; the loop ``take``s changes."""

    def __init__(self, name: str, home: Path, gen: int, interval: float = MEMBERSHIP_POLL_S) -> None:
        self.name = name
        self.home = home
        self.interval = interval
        self._seen: tuple[int, tuple[int, int, int] | None] = (gen, self._stat())
        self._error = ""
        self._wake = threading.Event()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._ready: list[Update | Exception] = []
        self._refused: tuple[str, ...] = ()
        self._thread = threading.Thread(target=self._run, name=f"kvstore-membership-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        """Read now (safe from a signal handler: only sets an event)."""
        self._wake.set()

    def take(self) -> list[Update | Exception]:
        """The changes and errors not yet taken, oldest first."""
        with self._lock:
            items, self._ready = self._ready, []
        return items

    def _hand(self, item: Update | Exception) -> None:
        with self._lock:
            self._ready = (self._ready + [item])[-8:]  # bounded: the loop may be slow to take

    def stop(self, timeout: float = 2.0) -> None:
        self._halt.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)  # a read stuck on a hung device is left behind (daemon thread)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(store_path(self.name, self.home))
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _run(self) -> None:
        while not self._halt.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._halt.is_set():
                return
            self.check()

    def check(self) -> None:
        """One read (the thread's body; callable directly in tests)."""
        st = self._stat()
        try:
            cfg, m = compose_membership(load_local(self.name, self.home), self.home)
        except (ValueError, KVStoreError, OSError) as e:
            if str(e) != self._error:
                self._error = str(e)
                self._hand(e)
            return
        self._error = ""
        if m.refused != self._refused:  # a torn or forged copy beside a good one: say so, once
            self._refused = m.refused
            if m.refused:
                self._hand(RefusedCopies("; ".join(m.refused)))
        if (m.gen, st) == self._seen:
            return
        self._seen = (m.gen, st)
        self._hand((cfg, m))


def verified_membership(cfg: StoreConfig, server: str, area: int, home: Path, log: Any) -> Membership:
    """The devices' membership at start-up; refuses a config that is not the devices' word.

    A device rolled back to an older membership is read as this machine last saw it; a torn
    one stops the start (its path may lead to another device now)."""
    m = read_membership(cfg.devices, store_uuid=cfg.uuid_bytes,
                        admin_key=bytes.fromhex(cfg.admin_key) if cfg.admin_key else None,
                        min_gen=cfg.membership_gen, seen=seen_record(cfg.name, home).load())
    for why in m.refused:
        log.warning("superblock copy refused", reason=why)
    mine = m.newest.areas[area]
    if mine.server != server or mine.denied or \
            zmq.utils.z85.encode(mine.public_key).decode() != cfg.servers[area].public_key:
        # the config handed in is not the devices' word (a library caller's own): the devices decide
        raise NotAllowed(f"the devices give area {area} to server {mine.server!r}"
                         f"{' (denied)' if mine.denied else ''} with another key than the config this "
                         f"service was started with: start it from the store's own config")
    return m


class RefusedCopies(KVStoreError):
    """Some superblock copies did not verify; the membership was read from the others."""


class Reloads:
    """Applies what the watcher read: an allow/deny from any machine (through the superblocks) or
    this machine's edited config. What cannot be applied while serving is logged and refused;
    the service serves on as it was."""

    def __init__(self, st: StoreState, home: Path, watcher: MembershipWatcher | None = None) -> None:
        self.st = st
        self.home = home
        self.watcher = watcher or MembershipWatcher(st.cfg.name, home, st.cfg.membership_gen)
        self.resnapshot: set[int] = set()
        """Areas allowed again: their pages were forgotten, and their deltas will not repeat them,
        so the sync agent fetches their full state."""

    def start(self) -> None:
        self.watcher.start()

    def poke(self) -> None:
        """Read now (SIGHUP; safe from a signal handler)."""
        self.watcher.poke()

    def turn(self, now: float) -> bool:
        """Apply what was read; whether the peers changed (the sync agent must start, or be
        replaced: it takes its peers and the keys it admits at spawn). The supervisor publishes
        the generation in force (``config_generation``) once the other parts followed it (new
        tenant salts: ``Clients.follow_keys``), since ``mass-ctl`` waits for it."""
        peers = False
        for item in self.watcher.take():
            if isinstance(item, RefusedCopies):
                self.st.log.warning("superblock copy refused", reason=str(item))
            elif isinstance(item, Exception):
                self.st.log.warning("store config changed but was not applied", error=str(item))
            else:
                try:
                    peers |= self.apply(*item)
                except (ValueError, KVStoreError, OSError) as e:
                    self.st.log.warning("store config changed but was not applied", error=str(e))
        return peers

    def apply(self, new: StoreConfig, m: Membership) -> bool:
        """Apply one composed store; whether the servers changed (see ``turn``)."""
        st = self.st
        old = st.cfg
        if new.membership_gen < old.membership_gen:
            raise ValueError(f"the devices' membership went back from generation {old.membership_gen} to "
                             f"{new.membership_gen}: refused")
        for what in ("uuid", "page_size", "devices", "salt"):
            if getattr(new, what) != getattr(old, what):
                raise ValueError(f"the config's {what} changed: restart the service to use it")
        if len(new.servers) < len(old.servers) or any(
                o.name != n.name and not o.denied for o, n in zip(old.servers, new.servers)):
            raise ValueError("servers were removed or reordered (deny them instead; areas never shift)")
        if (new.key_epoch, new.epochs, new.namespaces) != (old.key_epoch, old.epochs, old.namespaces):
            st.keyspace += 1  # tenant salts moved: the clients part re-keys its connections (this tick)
            st.log.warning("key spaces moved: pages saved before under them are no longer served",
                           key_epoch=new.key_epoch, epochs=new.epochs)
        if new.servers == old.servers:
            st.cfg = new  # this machine's settings changed, or nothing that concerns us
            return False
        if [[a.slot_count for a in sb.areas] for sb in m.sbs] != st.smap.counts:
            raise ValueError("the devices' area layout changed: restart the service")
        if new.servers[st.area].denied or new.servers[st.area].name != st.server:
            st.give_up(f"server {st.server!r} was denied on store {new.name!r} (membership generation "
                       f"{new.membership_gen}); stopped")
            return False
        if new.servers[st.area].public_key != old.servers[st.area].public_key:
            try:  # the administrator rotated this server's key: serve on only if the new one is here
                serving_key(new.name, st.server, new.servers[st.area].public_key, self.home)
            except NotAllowed as e:
                st.give_up(f"{e}; stopped")
                return False
        dropped = 0
        for i, sv in enumerate(new.servers):
            was = old.servers[i].denied if i < len(old.servers) else False
            if sv.denied and not was:
                dropped += st.forget_area(i)
                st.log.warning("server denied: its area is no longer read", denied=sv.name, area=i)
            elif was and not sv.denied:
                self.resnapshot.add(i)
                st.log.info("server allowed again" if sv.name == old.servers[i].name
                            else "server allowed into a denied server's area", allowed=sv.name, area=i)
            elif i >= len(old.servers):
                st.log.info("server allowed", allowed=sv.name, area=i)
        st.cfg = new
        st.sbs = m.sbs
        st.stats.add("areas_dropped", dropped)
        st.stats.add("config_reloads")
        return True

    def close(self) -> None:
        self.watcher.stop()
