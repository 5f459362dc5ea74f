"""allow / deny on a live store: real services pick the change up from the store config and superblocks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import load_store
from kvstore.storage.device import read_superblock
from kvstore.testing import ServiceProcess, free_port_pair, make_store, wait_for
from kvstore.tui.source import LiveSource

from .test_multiserver import PS, keys_of, put_pages, read_all, stats, visible

pytestmark = pytest.mark.integration


def ctl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MASS_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def cluster(home: Path, devices: Any, names: list[str], spare: int, slots: int = 100) -> list[str]:
    n = len(names) + spare
    devs = devices.make(2, (1 << 20) + n * slots * (4096 + PS))
    make_store(home, "m", devs, PS, [f"{x}=127.0.0.1:{free_port_pair()}" for x in names], spare=spare)
    return devs


def test_allow_a_server_into_a_running_store(home: Path, file_devices: Any, services: Any) -> None:
    devs = cluster(home, file_devices, ["a", "b"], spare=1)
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    assert put_pages(home, "a", keys_of("a", 40)).stored == 40
    r = ctl(home, "allow", "m", f"c=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 0, r.stderr
    assert "area 2" in r.stdout and "applied by the running service(s) here: a, b" in r.stdout
    cfg = load_store("m", home)
    assert [s.name for s in cfg.servers] == ["a", "b", "c"] and len(cfg.servers[2].public_key) == 40
    assert (home / "keys" / "m" / "c.key").exists()
    assert all(read_superblock(d).areas[2].server == "c" for d in devs)
    assert stats(sa).config_reloads == 1 and stats(sb).config_reloads == 1
    services(home, "m", "c")
    # the new server reads what a saved, and a and b read what it saves
    assert wait_for(lambda: visible(home, "c", keys_of("a", 40)) == 40)
    assert read_all(home, "c", keys_of("a", 40)) == (40, 0, 0)
    assert put_pages(home, "c", keys_of("c", 30)).stored == 30
    for reader in ("a", "b"):
        assert wait_for(lambda: visible(home, reader, keys_of("c", 30)) == 30)
        assert read_all(home, reader, keys_of("c", 30)) == (30, 0, 0)
    # refusals: no spare area left, already allowed, bad address, unknown store
    r = ctl(home, "allow", "m", f"d=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 4 and "no spare area" in r.stderr
    r = ctl(home, "allow", "m", f"c=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 4 and "already allowed" in r.stderr
    r = ctl(home, "allow", "m", "d=127.0.0.1:notaport")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = ctl(home, "allow", "m", "d")  # several servers: a sync address is needed
    assert r.returncode == 2 and "sync address" in r.stderr
    assert ctl(home, "allow", "nope", "d").returncode == 3
    assert [s.name for s in load_store("m", home).servers] == ["a", "b", "c"]  # refusals changed nothing
    assert stats(sa).sync_messages_rejected == 0
    # a broken config file is not applied: the services say so and serve on
    cfg_file = home / "stores" / "m.toml"
    good = cfg_file.read_text()
    src = LiveSource("m", home)
    cfg_file.write_text(good.replace("[store]", "[store", 1))
    assert wait_for(lambda: any(w["event"] == "store config changed but was not applied"
                                for w in src.snapshot()["a"]["warnings"]))
    assert put_pages(home, "a", keys_of("a-later", 5)).stored == 5
    assert read_all(home, "a", keys_of("a-later", 5)) == (5, 0, 0)
    cfg_file.write_text(good)


def test_deny_cuts_a_server_off_and_allow_takes_it_back(home: Path, file_devices: Any, services: Any) -> None:
    cluster(home, file_devices, ["a", "b", "c"], spare=0)
    # c runs from its own MASS_HOME, as on another machine: it never hears of the deny
    home_c = home / "host-c"
    (home_c / "stores").mkdir(parents=True)
    (home_c / "keys" / "m").mkdir(parents=True)
    shutil.copy(home / "stores" / "m.toml", home_c / "stores" / "m.toml")
    shutil.copy(home / "keys" / "m" / "c.key", home_c / "keys" / "m" / "c.key")
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    sc = ServiceProcess(home_c, "m", "c").start()
    try:
        assert put_pages(home_c, "c", keys_of("c", 30)).stored == 30
        assert wait_for(lambda: visible(home, "a", keys_of("c", 30)) == 30)
        r = ctl(home, "deny", "m", "c")
        assert r.returncode == 0, r.stderr
        assert "applied by the running service(s) here: a, b" in r.stdout
        # applied means: c's pages are gone from a's and b's index at once, its key is revoked
        assert visible(home, "a", keys_of("c", 30)) == 0 and visible(home, "b", keys_of("c", 30)) == 0
        assert read_all(home, "a", keys_of("c", 30)) == (0, 30, 0)
        assert stats(sa).areas_dropped == 30
        assert not (home / "keys" / "m" / "c.key").exists()
        assert load_store("m", home).servers[2].denied
        # c, still running on its old config, writes on; a and b never take its word again
        assert put_pages(home_c, "c", keys_of("c-after", 20)).stored == 20
        assert put_pages(home, "b", keys_of("b-marker", 5)).stored == 5
        assert wait_for(lambda: visible(home, "a", keys_of("b-marker", 5)) == 5)
        time.sleep(1.5)  # several heartbeats and flushes of c's: a negative check needs a window
        assert visible(home, "a", keys_of("c-after", 20) + keys_of("c", 30)) == 0
        # refusals
        r = ctl(home, "connect", "m", "--server", "c")
        assert r.returncode == 4 and "was denied" in r.stderr
        r = ctl(home, "deny", "m", "c")
        assert r.returncode == 4 and "already denied" in r.stderr
        r = ctl(home, "deny", "m", "zz")
        assert r.returncode == 4 and "not allowed" in r.stderr
    finally:
        assert sc.stop() == 0
    assert not sc.leftovers()
    # allow c again: it gets its area back with a new key, and what it holds is visible again
    r = ctl(home, "allow", "m", "c")
    assert r.returncode == 0, r.stderr
    assert "area 2" in r.stdout
    services(home, "m", "c")
    assert wait_for(lambda: visible(home, "a", keys_of("c-after", 20)) == 20)
    assert read_all(home, "a", keys_of("c-after", 20)) == (20, 0, 0)
    # the last allowed server cannot be denied
    assert ctl(home, "deny", "m", "b").returncode == 0
    r = ctl(home, "deny", "m", "c")
    assert r.returncode == 0
    r = ctl(home, "deny", "m", "a")
    assert r.returncode == 4 and "last allowed server" in r.stderr
    assert wait_for(lambda: sb.proc.poll() is not None)  # b stopped itself when it was denied
    assert sb.proc.returncode == 0
    # d takes over b's area, and the pages b left in it
    r = ctl(home, "allow", "m", "d=127.0.0.1:1", "--reuse", "a")
    assert r.returncode == 4 and "not denied" in r.stderr
    r = ctl(home, "allow", "m", f"d=127.0.0.1:{free_port_pair()}", "--reuse", "b")
    assert r.returncode == 0 and "area 1" in r.stdout and "applied by the running service(s) here: a" in r.stdout
    assert [s.name for s in load_store("m", home).servers] == ["a", "d", "c"]
    assert visible(home, "a", keys_of("b-marker", 5)) == 0
    services(home, "m", "d")
    assert wait_for(lambda: visible(home, "a", keys_of("b-marker", 5)) == 5)
    assert read_all(home, "a", keys_of("b-marker", 5)) == (5, 0, 0)
    assert read_all(home, "d", keys_of("b-marker", 5)) == (5, 0, 0)
    assert put_pages(home, "d", keys_of("d", 10)).stored == 10
    assert wait_for(lambda: visible(home, "a", keys_of("d", 10)) == 10)
    assert put_pages(home, "a", keys_of("a-end", 10)).stored == 10  # a serves on, alone
    assert read_all(home, "a", keys_of("a-end", 10)) == (10, 0, 0)
