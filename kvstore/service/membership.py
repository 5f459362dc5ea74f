"""Membership while serving: re-read the devices' superblocks and this machine's config, off the loop.

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

from ..config import MEMBERSHIP_POLL_S, StoreConfig, compose_membership, load_local, store_path
from ..errors import KVStoreError
from ..storage.membership import Membership

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


class RefusedCopies(KVStoreError):
    """Some superblock copies did not verify; the membership was read from the others."""
