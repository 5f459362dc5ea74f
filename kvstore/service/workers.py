"""The device I/O workers of one service: spawning them, judging their health, replacing them.

One worker process per device (``kvstore.ioworkers.worker``). ``Workers.check`` runs at every
tick of the service loop and never waits for a process: a worker that exited, or that holds a
device I/O (or has work queued and a loop that stopped turning) for longer than
``worker.io_timeout_s``, is killed; the I/Os it held are failed at once through ``on_lost``
(the supervisor answers them as misses); buffers a still-running kernel I/O may land in stay
quarantined until the process is gone; the replacement starts only then, after ``on_replaced``
failed the clients' direct reads the old one had taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


from ..ipc.iorings import WorkerRings
from ..ioworkers.worker import worker_main
from ..ipc import lease as A
from ..shm.segment import Segment
from ..shm.wake import WakeReader
from ..shm.stats import D
from .connections import Conn, give_back
from .runtime import Runtime
from .state import StoreState


@dataclass
class WorkerSlot:
    """A device's worker process and its rings."""

    device: int
    path: str
    seg: Segment
    rings: WorkerRings
    wake: WakeReader
    """The worker's wake-up: the worker drains it; this end keeps the FIFO open and posts."""
    wake_name: str
    proc: Any = None
    restarts: int = 0
    old: Any = None          # a lost worker still exiting; the replacement waits for it
    lost_at: float = 0.0
    warned: bool = False


class Workers:
    """Every device worker of the service (see the module doc)."""

    def __init__(self, st: StoreState, rt: Runtime, mp: Any, *, queued: Callable[[int], bool],
                 on_lost: Callable[[int, bool], list[tuple[Conn, int]]],
                 on_replaced: Callable[[int], None]) -> None:
        """Make each device's rings and wake-up (through ``rt``); nothing is spawned yet.
        ``queued(device)``: the service has I/O of that device outstanding; ``on_lost(device,
        dead)``: fail the I/Os of a lost worker, returning the (connection, buffer) pairs a kernel
        I/O may still land in unless ``dead``; ``on_replaced(device)``: the old worker is gone,
        the new one starts."""
        self.st = st
        self.rt = rt
        self._mp = mp
        self.stats = st.stats
        self.log = st.log
        self.arena = st.arena
        self._queued = queued
        self._on_lost = on_lost
        self._on_replaced = on_replaced
        n = st.cfg.service.max_clients
        self.slots: list[WorkerSlot] = []
        try:
            for d, path in enumerate(st.cfg.devices):
                # the worker's rings and connection table: the service's and the worker's alone
                seg = rt.segment(f"w{d}", WorkerRings.nbytes(n), 0o600)
                rings = WorkerRings(seg.buf, n)
                rings.pins[:] = -1  # no direct read pins anything yet
                wake = rt.wake(rt.worker_wake(d))  # drained by the worker; this end keeps it open and posts
                self.slots.append(WorkerSlot(d, path, seg, rings, wake, rt.worker_wake(d)))
        except BaseException:
            self.close()  # the wake-ups made so far (``rt`` removes the names and segments)
            raise
        self.zombies: list[tuple[Any, list[tuple[Conn, int]]]] = []
        self._last_check_ns = 0

    def spawn(self, w: WorkerSlot) -> None:
        """Start ``w``'s worker process."""
        w.proc = self._mp.Process(target=worker_main, args=(self.rt.worker_params(self.st, w.device, w.path),),
                                  daemon=True, name=f"kvstore-io-{self.st.cfg.name}-{w.device}")
        w.proc.start()
        self.stats.dev_set(w.device, "pid", w.proc.pid)

    def spawn_all(self) -> None:
        """Start every device's worker."""
        for w in self.slots:
            self.spawn(w)

    def turn(self, now: float) -> None:
        """The tick's work: ``check``."""
        self.check()

    def check(self) -> None:
        """Replace dead or hung workers, never blocking the loop.

        A worker is hung when an I/O it submitted to the device has been outstanding for
        more than ``io_timeout_s`` (the age the worker publishes, counted from
        ``io_submit``), or when it has work queued but its loop has not turned for that
        long. Time a request spends queued in the ring behind reads is not held against
        it: writes wait there by design (reads first)."""
        cfg = self.st.cfg
        now_ns = time.monotonic_ns()
        tmo_ns = int(cfg.worker.io_timeout_s * 1e9)
        # right after this loop itself was stopped (SIGSTOP, swap, CPU starvation), ages say
        # nothing about the workers: judge them at the next tick, not now
        judge = now_ns - self._last_check_ns < tmo_ns // 2
        self._last_check_ns = now_ns
        for w in self.slots:
            if w.proc is None:
                self.restart(w)
                continue
            row = self.stats.device[w.device]
            oldest = int(row[D["oldest_io_ns"]])
            beat = int(row[D["loop_ns"]])
            queued = self._queued(w.device) if beat else False
            if not w.proc.is_alive():
                self.lost(w, f"exited with code {w.proc.exitcode}")
            elif judge and oldest and now_ns - oldest > tmo_ns:
                self.lost(w, f"a device I/O outstanding for more than {cfg.worker.io_timeout_s} s")
            elif judge and beat and queued and now_ns - beat > tmo_ns:
                self.lost(w, f"its loop stalled for more than {cfg.worker.io_timeout_s} s with work queued")
        for z in list(self.zombies):
            proc, held = z
            if not proc.is_alive():  # no more DMA can land in its buffers
                for conn, b in held:
                    give_back(conn, b, self.arena, A.FREE)
                self.zombies.remove(z)

    def lost(self, w: WorkerSlot, why: str) -> None:
        """Kill the worker and fail its I/Os now; the replacement starts once the old process
        is gone (``restart``, polled: the loop never waits for a process)."""
        self.log.warning("I/O worker lost; restarting", device=w.device, pid=w.proc.pid, reason=why)
        if w.proc.is_alive():
            w.proc.kill()
        dead = not w.proc.is_alive()  # the kernel ends a dead process's AIO before it is reaped
        held = self._on_lost(w.device, dead)
        self.zombies.append((w.proc, held))
        self.stats.dev_set(w.device, "oldest_io_ns", 0)
        self.stats.dev_set(w.device, "loop_ns", 0)
        w.old = w.proc
        w.proc = None
        w.lost_at = time.monotonic()
        w.restarts += 1
        self.stats.add("worker_restarts")
        self.stats.dev_set(w.device, "restarts", w.restarts)
        self.restart(w)

    def restart(self, w: WorkerSlot) -> None:
        """Start the replacement once the old worker has exited (it may still be in the kernel)."""
        if self.st.stopping or w.old is None:
            return
        if w.old.is_alive():
            if time.monotonic() - w.lost_at > 5.0 and not w.warned:
                w.warned = True
                self.log.warning("old I/O worker still exiting; its device waits", device=w.device,
                                 pid=w.old.pid)
            return
        w.old.join(0)
        w.old = None
        w.warned = False
        w.rings.reset()
        self._on_replaced(w.device)
        self.spawn(w)

    def stop_all(self) -> None:
        """Terminate every worker and wait for it (5 s, then kill): they drain their device I/O."""
        for w in self.slots:
            if w.proc is not None and w.proc.is_alive():
                w.proc.terminate()
        for proc in [p for w in self.slots for p in (w.proc, w.old) if p is not None]:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    def close(self) -> None:
        """Close the workers' wake-ups (after ``stop_all``)."""
        for w in self.slots:
            w.wake.close()
        self.slots.clear()


__all__ = ["WorkerSlot", "Workers"]
