"""The local trust boundary, tried by an adversary that maps and writes the shared memory itself.

``adversary.py`` (stdlib only, layouts from docs/FORMAT.md) speaks the hello and then posts what
no honest client posts. It runs as another Unix user (``nobody``, in the access group) and as
the service's own user with another tenant. Tenant alpha (this user, through ``KVCacheClient``)
is the victim; each test checks what the attacker got (nothing) and what alpha saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig, load_store, run_dir, save_store
from kvstore.ipc.iorings import IO_REQUEST, OP_WRITE, WorkerRings
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment
from kvstore.shm.wake import WakeWriter
from kvstore.storage.membership import read_membership
from kvstore.testing import make_store, opened_to_others, wait_for

from .test_tenants import nogroup_or_skip

pytestmark = pytest.mark.integration
PS = 16 << 10
ADVERSARY = Path(__file__).with_name("adversary.py")


def _stats(home: Path, store: str) -> Any:
    return _snapshot(home, store).service


def _snapshot(home: Path, store: str) -> Any:
    from kvstore.shm.segment import name_prefix
    from kvstore.shm.stats import StatsBlock

    seg = Segment.attach(name_prefix(home, store, "local") + "stats")
    try:
        return StatsBlock.attach(seg.buf).snapshot()
    finally:
        seg.close()


class Scene:
    """A store with tenant alpha (this user) and beta (``nobody``, or this user too)."""

    def __init__(self, home: Path, file_devices: Any, services: Any, *, same_uid: bool, slots: int = 200,
                 beta: bool = True, **service: Any) -> None:
        self.gid = nogroup_or_skip()
        self.same_uid = same_uid
        (dev,) = file_devices.make(1, (1 << 20) + slots * (4096 + PS))
        cfg = make_store(home, "t", [dev], PS)
        me = os.getuid()
        tenants = {"alpha": [f"uid:{me}"]}
        if beta:
            tenants["beta"] = [f"uid:{me}"] if same_uid else ["uid:65534"]
        cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, access_group="nogroup", **service),
                                  tenants=tenants)
        save_store(cfg, home)
        self.cfg = cfg
        self.home = home
        self.svc = services(home, "t")
        self.sock = run_dir("t", home) / "local.sock"

    def alpha(self, **kw: Any) -> KVCacheClient:
        return KVCacheClient.connect("t", home=self.home, tenant="alpha", timeout=20, **kw)

    def _cmd(self, attack: str, seconds: float, tenant: str) -> list[str]:
        args = [str(ADVERSARY), str(self.sock), tenant, attack, str(seconds)]
        if self.same_uid:
            return [sys.executable, *args]
        return ["setpriv", "--reuid=65534", f"--regid={self.gid}", "--clear-groups", "/usr/bin/python3", *args]

    def opened(self) -> contextlib.AbstractContextManager[None]:
        """The directories above the socket and the adversary, opened for the run (so that the
        service's own modes decide what another user reaches)."""
        return opened_to_others([self.home, ADVERSARY.parent])

    def attack(self, attack: str, seconds: float = 3.0, tenant: str = "beta") -> dict[str, Any]:
        with self.opened():
            r = subprocess.run(self._cmd(attack, seconds, tenant), capture_output=True, text=True, cwd="/",
                               timeout=120)
        assert r.returncode == 0, r.stderr
        out: dict[str, Any] = json.loads(r.stdout)
        return out

    def attack_in_background(self, attack: str, seconds: float) -> subprocess.Popen[str]:
        self._restore = contextlib.ExitStack()
        self._restore.enter_context(self.opened())
        return subprocess.Popen(self._cmd(attack, seconds, "beta"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd="/")

    def restore(self) -> None:
        if hasattr(self, "_restore"):
            self._restore.close()


def _save(c: KVCacheClient, keys: list[bytes]) -> None:
    for i in range(0, len(keys), c.max_batch):
        part = keys[i:i + c.max_batch]
        assert c.put(part, [page_bytes(k, PS) for k in part], wait=True).stored == len(part)


def _all_good(c: KVCacheClient, keys: list[bytes]) -> bool:
    for i in range(0, len(keys), c.max_batch):
        part = keys[i:i + c.max_batch]
        with c.get(part) as got:
            if any(v is None or bytes(v) != bytes(page_bytes(k, PS)) for k, v in zip(part, got)):
                return False
    return True


@pytest.mark.parametrize("same_uid", [False, True], ids=["other-uid", "same-uid"])
def test_direct_reads_of_another_tenants_slots_get_nothing(home: Path, file_devices: Any, services: Any,
                                                           same_uid: bool) -> None:
    """Beta names alpha's slots with what the slot table shows (generation and digest): the first
    version served 8 of 8 as validated hits. Now the worker reads only what the record's key
    id, salted with beta's salt, is the digest of: nothing, and beta is disconnected."""
    sc = Scene(home, file_devices, services, same_uid=same_uid)
    keys = [b"alpha/secret/%d" % i for i in range(8)]
    with sc.alpha() as a:
        _save(a, keys)
        with a.get(keys) as held:  # alpha holds views of its pages while beta attacks
            got = sc.attack("steal")
            assert _all_good(a, keys) and all(v is not None for v in held)
    assert got["ok"] and got["valid_seen"] >= 8
    assert got["hits"] == 0 and 0 not in got["statuses"], got
    assert got["disconnected"], got
    assert got["other_connections_seen"] >= 1, got
    if not same_uid:  # the kernel keeps another user off the service's tables, its rings and alpha's memory
        assert not got["control_writable"] and not got["w0_writable"] and not got["sync_writable"], got
        assert got["other_connections_readable"] == 0, got
    st = _stats(home, "t")
    assert st.clients_refused >= 1 and st.direct_refused >= 1 and st.validation_failures == 0
    with sc.alpha() as a:
        assert _all_good(a, keys)


@pytest.mark.parametrize("same_uid", [False, True], ids=["other-uid", "same-uid"])
def test_lying_reads_change_no_page(home: Path, file_devices: Any, services: Any, same_uid: bool) -> None:
    """Records with alpha's generation and one bit of the digest flipped: the first version
    took the failed reads as evidence and deleted 100 of 100 pages. Now nothing is read for
    them, no slot is distrusted, and alpha keeps every page."""
    sc = Scene(home, file_devices, services, same_uid=same_uid)
    keys = [b"alpha/page/%d" % i for i in range(100)]
    with sc.alpha() as a:
        _save(a, keys)
    got = sc.attack("lie")
    assert got["hits"] == 0 and got["disconnected"], got
    st = _stats(home, "t")
    assert st.validation_failures == 0 and st.evictions == 0
    with sc.alpha() as a:
        assert a.contains(keys) == [True] * 100
        assert _all_good(a, keys)


def test_impossible_ring_tails_stop_no_write(home: Path, file_devices: Any, services: Any) -> None:
    """Beta stores tail = head + 2^62 on its direct-read and request rings and stays connected:
    the first version then took no write on that device while beta lived. Now beta is
    disconnected and alpha's puts and gets go on."""
    sc = Scene(home, file_devices, services, same_uid=False)
    adv = sc.attack_in_background("tails", 20.0)
    try:
        with sc.alpha() as a:
            assert wait_for(lambda: _stats(home, "t").clients_connected >= 2 or adv.poll() is not None, 20)
            keys = [b"alpha/after/%d" % i for i in range(64)]
            _save(a, keys)  # put(wait=True): each batch's writes done within the timeout
            assert _all_good(a, keys)
        out, err = adv.communicate(timeout=60)
    finally:
        if adv.poll() is None:
            adv.kill()
        sc.restore()
    got = json.loads(out)
    assert got["disconnected"], (got, err)
    assert _stats(home, "t").clients_refused >= 1


def test_no_wake_up_can_be_taken(home: Path, file_devices: Any, services: Any) -> None:
    """Beta (nobody, in the access group) tries to wait on every wake-up of the service: the
    supervisor's doorbell, the I/O worker's, alpha's own. Version 3 used named semaphores, group
    read-write: a waiter took the wake-ups meant for the service and for alpha (whose gets then
    waited out timeouts). Now they are FIFOs whose read end the group cannot open: beta opens
    none for waiting, takes nothing, and alpha's gets and puts go on meanwhile, all correct."""
    sc = Scene(home, file_devices, services, same_uid=False)
    with sc.alpha() as a:
        keys = [b"alpha/%d" % i for i in range(32)]
        _save(a, keys)
        adv = sc.attack_in_background("wakes", 6.0)
        try:
            assert wait_for(lambda: _stats(home, "t").clients_connected >= 2 or adv.poll() is not None, 20)
            rounds = 0
            while adv.poll() is None:
                assert _all_good(a, keys)
                if rounds < 30:  # new pages, 152 in all: the store (200 slots) evicts none
                    more = [b"alpha/more/%d/%d" % (rounds, i) for i in range(4)]
                    _save(a, more)
                    assert _all_good(a, more)
                rounds += 1
            out, err = adv.communicate(timeout=60)
        finally:
            if adv.poll() is None:
                adv.kill()
            sc.restore()
    got = json.loads(out)
    assert got["ok"], (got, err)
    wakes = {n[len(sc.svc.prefix):] for n in got["wakes_seen"]}
    assert {"wake.bell", "wake.w0"} <= wakes and any(w.startswith("wake.c") for w in wakes), got
    assert got["wakes_waitable"] == [] and got["stolen"] == 0, got
    assert set(got["wakes_refused"]) == set(got["wakes_seen"]), got
    assert rounds >= 1


def test_pin_words_hold_no_one_elses_slot(home: Path, file_devices: Any, services: Any) -> None:
    """Beta writes every slot id into its pin words and stays connected while alpha's writes
    wrap around the area: the service asks only the workers' own pins, so every one of alpha's
    writes is stored and readable (before, the named slots stayed out of reuse: alpha's writes
    were dropped and its cache emptied)."""
    sc = Scene(home, file_devices, services, same_uid=False, slots=60)
    own = _stats(home, "t").own_slots
    first = [b"alpha/old/%d" % i for i in range(own)]
    with sc.alpha() as a:
        _save(a, first)
    adv = sc.attack_in_background("pinall", 15.0)
    try:
        assert wait_for(lambda: _stats(home, "t").clients_connected >= 1, 20)
        time.sleep(0.5)  # its pin words are written right after the hello
        fresh = [b"alpha/new/%d" % i for i in range(own)]
        with sc.alpha() as a:
            _save(a, fresh)  # asserts every page stored
            assert _all_good(a, fresh)
    finally:
        adv.kill()
        adv.wait()
        sc.restore()


def test_clients_that_leave_their_lease_marked_held_leave_nothing(home: Path, file_devices: Any,
                                                                  services: Any) -> None:
    """A client marks its whole lease as being read (and some buffers quarantined), sets pins and
    exits: the first version never dropped it (max_clients of them locked the service) and never
    freed the quarantined buffers. Now every place and every buffer comes back."""
    sc = Scene(home, file_devices, services, same_uid=False, max_clients=3, client_buffers=16)
    for _ in range(4):  # more than max_clients of them, one after another
        assert sc.attack("hold")["left"]
        assert wait_for(lambda: _stats(home, "t").clients_connected == 0, 20)
    clients = [sc.alpha() for _ in range(3)]
    try:
        for c in clients:
            with c.reserve(16, timeout=10) as r:  # the whole lease is free
                assert len(r) == 16
    finally:
        for c in clients:
            c.close()


def test_no_client_receives_the_store_salt(home: Path, file_devices: Any, services: Any) -> None:
    """A user mapped to no tenant gets the default tenant, whose salt is derived from the store's
    like any other (with the store salt it could derive every tenant's)."""
    sc = Scene(home, file_devices, services, same_uid=False, beta=False)  # nobody: no tenant
    cfg = sc.cfg
    got = sc.attack("idle", 0.2, tenant="")
    assert got["ok"], got
    salt = bytes.fromhex(got["salt"])
    assert salt != bytes.fromhex(cfg.salt) and salt == cfg.tenant_salt("") and salt != cfg.tenant_salt("alpha")


def test_forged_writes_reach_no_device(home: Path, file_devices: Any, services: Any) -> None:
    """Write requests on the worker's ring that no supervisor sends: at offset 0 (the
    superblocks), in another server's area, at an offset that is not the slot's. The worker
    carries out none; the superblocks and alpha's pages are intact and the service restarts.
    (The ring is owner-only: another user cannot even open it, see the first test.)"""
    sc = Scene(home, file_devices, services, same_uid=True)
    keys = [b"alpha/keep/%d" % i for i in range(4)]
    with sc.alpha() as a:
        _save(a, keys)
    sb = load_store("t", home)
    before = read_membership(sb.devices, store_uuid=sb.uuid_bytes, admin_key=bytes.fromhex(sb.admin_key) if sb.admin_key else None).sbs[0]
    own = before.areas[0]
    seg = Segment.attach(sc.svc.prefix + "w0")
    rings = WorkerRings(seg.buf, sb.service.max_clients)
    forged = np.zeros(3, dtype=IO_REQUEST)
    forged["op"] = OP_WRITE
    forged["tag"] = [1 << 61, (1 << 61) + 1, (1 << 61) + 2]
    forged["buf"] = 0
    forged["length"] = 4096 + PS
    forged["payload_len"] = PS
    forged["gen"] = 1 << 40
    forged["area"] = [0, 0, 0]
    forged["slot"] = [0, 0, 1]
    forged["offset"] = [0, 8192, own.offset + 7]  # both superblock copies; not a slot's offset
    before_errors = _snapshot(home, 't').devices[0].write_errors
    rings.writes.put_many(forged)
    w = WakeWriter.open(sc.svc.prefix + "wake.w0")
    w.post()
    w.close()
    assert wait_for(lambda: _snapshot(home, 't').devices[0].write_errors >= before_errors + 3, 20)
    del rings
    seg.close()
    after = read_membership(sb.devices, store_uuid=sb.uuid_bytes, admin_key=bytes.fromhex(sb.admin_key) if sb.admin_key else None).sbs[0]
    assert after.generation == before.generation
    with sc.alpha() as a:
        assert _all_good(a, keys)
    assert sc.svc.stop() == 0
    sc.svc.start()  # the superblocks still hold: the service starts
    with sc.alpha() as a:
        assert _all_good(a, keys)


def test_a_connection_flood_does_not_keep_a_healthy_client_out(home: Path, file_devices: Any,
                                                               services: Any) -> None:
    """Another user holds 300 silent connections: the first version refused 20 of 20 normal
    connects (a full backlog, one accept per loop turn). Each of 20 connects here succeeds;
    the latencies are printed for docs/RELIABILITY.md, not asserted (a shared machine)."""
    sc = Scene(home, file_devices, services, same_uid=False)
    code = ("import socket, sys, time; n = 0; socks = []\n"
            "for _ in range(300):\n"
            "    s = socket.socket(socket.AF_UNIX); s.setblocking(False)\n"
            "    try: s.connect(sys.argv[1]); socks.append(s)\n"
            "    except OSError: pass\n"
            "print(len(socks), flush=True); time.sleep(float(sys.argv[2]))\n")
    with sc.opened():
        flood = subprocess.Popen(["setpriv", "--reuid=65534", f"--regid={sc.gid}", "--clear-groups",
                                  "/usr/bin/python3", "-c", code, str(sc.sock), "8"], stdout=subprocess.PIPE,
                                 text=True, cwd="/")
        try:
            assert flood.stdout is not None
            held = int(flood.stdout.readline())
            lat = []
            for i in range(20):
                t0 = time.monotonic()
                with sc.alpha() as a:
                    lat.append(time.monotonic() - t0)
                    assert a.lookup([b"k%d" % i]) == 0
            print(f"flood of {held} silent connections: 20/20 connects, "
                  f"p50 {sorted(lat)[10] * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms")
        finally:
            flood.kill()
            flood.wait()


def test_another_user_cannot_take_every_place(home: Path, file_devices: Any, services: Any) -> None:
    """With the default config, another user holds at most a quarter of ``max_clients``; the
    service's own user still connects (an outside review took all 16 places as nobody)."""
    sc = Scene(home, file_devices, services, same_uid=False)
    code = ("import sys, json, time; sys.path.insert(0, sys.argv[1]); import adversary\n"
            "got = []\n"
            "for _ in range(16):\n"
            "    s, h, fds = adversary.hello(sys.argv[2], 'beta'); got.append((s, h.get('ok'), h.get('kind')))\n"
            "print(json.dumps([[ok, kind] for _s, ok, kind in got]), flush=True); time.sleep(float(sys.argv[3]))\n")
    with sc.opened():
        p = subprocess.Popen(["setpriv", "--reuid=65534", f"--regid={sc.gid}", "--clear-groups", "/usr/bin/python3",
                              "-c", code, str(ADVERSARY.parent), str(sc.sock), "10"], stdout=subprocess.PIPE, text=True,
                             cwd="/")
        try:
            assert p.stdout is not None
            got = json.loads(p.stdout.readline())
            assert sum(1 for ok, _k in got if ok) == 4, got           # a quarter of 16
            assert all(k == "busy" for ok, k in got if not ok), got
            with sc.alpha() as a:                                      # the service's own user gets in
                assert a.lookup([b"x"]) == 0
        finally:
            p.kill()
            p.wait()


def test_sync_ring_records_out_of_range_are_dropped() -> None:
    """The supervisor drops (and counts) a sync-ring record naming a device, area, slot or peer
    the store does not have, instead of indexing with it (one such record stopped the service)."""
    from types import SimpleNamespace

    from kvstore.crdt.log import K_HINT, K_REMOTE, K_REQUEST, SYNC_REC
    from kvstore.service.sync import SyncLink
    from kvstore.shm.slots import SlotMap

    smap = SlotMap([[4, 4], [4, 4]])
    recs = np.zeros(6, dtype=SYNC_REC)
    recs["kind"] = [K_REMOTE, K_REMOTE, K_REMOTE, K_HINT, K_REQUEST, K_REMOTE]
    recs["device"] = [1, 2, 0, 0, 0, 0]
    recs["area"] = [1, 0, 0, 5, 0, 1]
    recs["slot"] = [3, 0, 4, 0, 0, 0]
    recs["peer"] = [1, 0, 0, 0, 9, 1]
    ok = SyncLink._in_range(SimpleNamespace(smap=smap), recs)  # type: ignore[arg-type]
    assert ok.tolist() == [True, False, False, False, False, True]


def test_healthy_clients_keep_reading_while_an_adversary_lies(home: Path, file_devices: Any,
                                                             services: Any) -> None:
    """While beta repeatedly connects and lies, alpha's gets keep returning exactly its pages
    (none wrong, none lost)."""
    sc = Scene(home, file_devices, services, same_uid=True)
    keys = [b"alpha/busy/%d" % i for i in range(32)]
    with sc.alpha() as a:
        _save(a, keys)
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        with sc.alpha() as a:
            while not stop.is_set():
                if not _all_good(a, keys):
                    bad.append("wrong or missing page")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for attack in ("steal", "lie", "steal"):
            assert sc.attack(attack, 1.0)["hits"] == 0
    finally:
        stop.set()
        t.join(60)
    assert not bad
