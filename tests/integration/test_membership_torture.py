"""Membership torture: random allow / deny / address update / restart of servers on three machines
(three MASS_HOMEs, nothing copied between them) while clients save and read; at the end every live
server reads every page saved by the servers still allowed, none reads a wrong page, and the
membership on every machine is the one the administrator last set."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient
from kvstore.config import load_store
from kvstore.errors import KVStoreError
from kvstore.quickstart import page_bytes
from kvstore.testing import ServiceProcess, free_port_pair, make_store, wait_for

from .test_membership import ctl, keygen
from .test_multiserver import PS, keys_of, read_all, stats

pytestmark = pytest.mark.integration

STEPS = int(os.environ.get("KVS_TORTURE_STEPS", "14"))


@pytest.mark.parametrize("seed", [int(os.environ.get("KVS_TORTURE_SEED", "7"))])
def test_membership_torture(home: Path, file_devices: Any, seed: int) -> None:
    rng = random.Random(seed)
    devs = file_devices.make(2, (1 << 20) + 4 * 120 * (4096 + PS))
    make_store(home, "m", devs, PS, [f"a=127.0.0.1:{free_port_pair()}"], spare=3)
    homes = {"a": home, "b": home / "host-b", "c": home / "host-c"}
    for n in ("b", "c"):
        r = ctl(home, "allow", "m", f"{n}=127.0.0.1:{free_port_pair()}", f"--key={keygen(homes[n], n)}")
        assert r.returncode == 0, r.stderr
    svcs: dict[str, ServiceProcess] = {}
    dead: list[ServiceProcess] = []
    allowed = {"a": True, "b": True, "c": True}
    saved: dict[str, list[bytes]] = {"a": [], "b": [], "c": []}
    wrong: list[str] = []
    stop = threading.Event()
    log: list[str] = []

    def start(n: str) -> None:
        args = ["--device", devs[0]] if n != "a" else []
        svcs[n] = ServiceProcess(homes[n], "m", n, args=args).start()

    def reader() -> None:
        """Reads what was saved, on whichever servers run, all along: never a wrong page."""
        r = random.Random(seed + 1)
        while not stop.is_set():
            live = [n for n, s in list(svcs.items()) if s.proc is not None and s.proc.poll() is None]
            keys = [k for ks in list(saved.values()) for k in ks]
            if not live or not keys:
                stop.wait(0.05)
                continue
            try:
                _, _, w = read_all(homes[(n := r.choice(live))], n, r.sample(keys, min(32, len(keys))))
            except KVStoreError:
                continue  # stopped or denied under us: a miss, never wrong data
            if w:
                wrong.append(f"{w} wrong pages read on {n}")

    for n in ("a", "b", "c"):
        start(n)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        # every kind of change at least once, then at random
        script = ["save", "deny", "save", "restart", "update", "allow", "save", "deny", "save"]
        for step in range(STEPS):
            op = script[step] if step < len(script) else rng.choice(["save", "save", "deny", "allow", "update",
                                                                       "restart"])
            n = rng.choice(["b", "c"])
            if op == "save":
                n = rng.choice([x for x in svcs if allowed[x] and svcs[x].proc and svcs[x].proc.poll() is None])
            log.append(f"{step}: {op} {n}")
            if op == "save":
                who = n
                ks = keys_of(f"{who}{step}", rng.randint(4, 12))
                with KVCacheClient.connect("m", server=who, home=homes[who]) as c:
                    assert c.put(ks, [page_bytes(k, PS) for k in ks], wait=True).stored == len(ks)
                saved[who] += ks
            elif op == "deny" and allowed[n]:
                r = ctl(home, "deny", "m", n)
                assert r.returncode == 0, r.stderr
                allowed[n] = False
                s = svcs.pop(n, None)
                if s is not None:  # it stops itself (exit 4), within the superblock poll
                    assert wait_for(lambda: s.proc.poll() is not None, 30), log
                    assert s.proc.returncode == 4, (s.proc.returncode, log)
                    s.expected_exit = 4
                    dead.append(s)
            elif op == "allow" and not allowed[n]:
                pub = keygen(homes[n], n)  # its key file went nowhere: the same key, printed again
                r = ctl(home, "allow", "m", f"{n}=127.0.0.1:{free_port_pair()}", f"--key={pub}")
                assert r.returncode == 0, r.stderr
                allowed[n] = True
                start(n)
            elif op == "update" and allowed[n]:
                r = ctl(home, "allow", "m", f"{n}=127.0.0.1:{free_port_pair()}", "--update")
                assert r.returncode == 0, r.stderr
            elif op == "restart" and allowed[n] and n in svcs:
                assert svcs.pop(n).stop() == 0
                start(n)
        stop.set()
        t.join(60)
        assert not wrong, (wrong, log)
        # the end: every live server reads every page of the servers still allowed, and none of the others'
        expect = [k for x, ks in saved.items() if allowed[x] for k in ks]
        gone = [k for x, ks in saved.items() if not allowed[x] for k in ks]
        for n, s in svcs.items():
            if not wait_for(lambda: read_all(homes[n], n, expect)[0] == len(expect), 60):
                with KVCacheClient.connect("m", server=n, home=homes[n]) as c:
                    missing = sorted({k.decode().split("/")[0] for k, hit in zip(expect, c.contains(expect))
                                      if not hit})
                pytest.fail(f"{n} misses pages of {missing}: {read_all(homes[n], n, expect)}; steps {log}")
            assert read_all(homes[n], n, gone) == (0, len(gone), 0), (n, log)
            assert stats(s).validation_failures == 0
        # the membership every machine reads is the administrator's last
        want = [(x, not allowed[x]) for x in ("a", "b", "c")]
        for n, h in homes.items():
            cfg = load_store("m", h)
            assert [(s.name, s.denied) for s in cfg.servers] == want, (n, log)
            assert cfg.membership_gen == load_store("m", home).membership_gen
    finally:
        stop.set()
        bad = []
        for s in [*svcs.values(), *dead]:
            rc = s.stop()
            if rc not in (s.expected_exit, -9):
                bad.append((s.server, rc))
            assert not s.leftovers()
        assert not bad, (bad, log)
