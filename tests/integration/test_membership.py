"""allow / deny on a live store: real services, on separate MASS_HOMEs standing for separate machines,
pick the change up from the superblocks alone; torn and forged superblocks change nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import load_store
from kvstore.crdt.serverkeys import load_keypair
from kvstore.storage.device import read_superblock
from kvstore.storage.membership import AdminKey
from kvstore.testing import ServiceProcess, free_port_pair, make_store, wait_for
from kvstore.tui.source import LiveSource

from .test_multiserver import PS, _rogue_sub, keys_of, put_pages, read_all, stats, visible

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


def keygen(home: Path, server: str) -> str:
    r = ctl(home, "keygen", "m", "--server", server)
    assert r.returncode == 0, r.stderr
    return next(ln.split(": ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("public key: "))


def admitted(endpoint: str, server_key: bytes, public: bytes, secret: bytes, wait_ms: int) -> bool:
    """Does a SUB with this keypair receive anything from the service's PUB endpoint?"""
    ctx, sub = _rogue_sub(endpoint, server_key, public, secret)
    try:
        return bool(sub.poll(wait_ms))
    finally:
        sub.close(0)
        ctx.term()


def test_machines_join_and_leave_through_the_devices_alone(home: Path, file_devices: Any, services: Any) -> None:
    """Three MASS_HOMEs stand for three machines; nothing is copied between them. The administrator's
    machine creates the store; b and c make their own keys, are allowed by public key, and join with a
    device path; a deny on the administrator's machine reaches both others through the devices."""
    devs = file_devices.make(2, (1 << 20) + 4 * 100 * (4096 + PS))
    make_store(home, "m", devs, PS, [f"a=127.0.0.1:{free_port_pair()}"], spare=3)
    sa = services(home, "m", "a")
    assert put_pages(home, "a", keys_of("a", 40)).stored == 40
    host_b, host_c = home / "host-b", home / "host-c"
    pub_b, pub_c = keygen(host_b, "b"), keygen(host_c, "c")
    for name, pub in (("b", pub_b), ("c", pub_c)):
        r = ctl(home, "allow", "m", f"{name}=127.0.0.1:{free_port_pair()}", f"--key={pub}")
        assert r.returncode == 0, r.stderr
        assert "applied by the running service(s) here: a" in r.stdout
        assert not (home / "keys" / "m" / f"{name}.key").exists()  # no private key was made here
    admin_key = json.loads(ctl(home, "show", "m", "--json").stdout)["admin_key"]
    # b: only a device path (the other device is found beside it); its server name comes from its key
    r = ctl(host_b, "connect", "m", "--device", devs[1], "--daemon")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"trusting the administrator key of store m: {admin_key}" in r.stdout and "as server b" in r.stdout
    sb = ServiceProcess(host_b, "m", "b")  # for its prefix and shm checks; the daemon is stopped below
    try:
        local_b = (host_b / "stores" / "m.toml").read_text()
        assert "127.0.0.1" not in local_b and pub_b not in local_b  # membership stays on the devices
        assert wait_for(lambda: visible(host_b, "b", keys_of("a", 40)) == 40)
        assert read_all(host_b, "b", keys_of("a", 40)) == (40, 0, 0)
        # c pins the administrator key it was given
        sc = services(host_c, "m", "c", args=["--device", devs[0], "--admin-key", admin_key])
        assert put_pages(host_c, "c", keys_of("c", 30)).stored == 30
        assert put_pages(host_b, "b", keys_of("b", 20)).stored == 20
        for h, reader in ((home, "a"), (host_b, "b")):
            assert wait_for(lambda: visible(h, reader, keys_of("c", 30)) == 30)
            assert read_all(h, reader, keys_of("c", 30)) == (30, 0, 0)
        assert wait_for(lambda: visible(host_c, "c", keys_of("b", 20)) == 20)
        # the administrator's machine sees b and c through a's sync agent, not as "not running"
        assert wait_for(lambda: all(f"server {x}: not running here; heard" in ctl(home, "status", "m").stdout
                                    for x in ("b", "c")))
        st = json.loads(ctl(home, "status", "m", "--json").stdout)["servers"]["b"]
        assert st["remote"]["by"] == "a" and st["remote"]["heard_s"] < 10 and st["remote"]["behind"] == 0
        assert "server b: not running here, heard" in ctl(home, "show", "m").stdout
        cfg = load_store("m", home)
        c_pub, c_sec = (host_c / "keys" / "m" / "c.key").read_text().encode().split()
        b_endpoint, b_key = cfg.servers[1].endpoints[0], cfg.servers[1].public_key.encode()
        a_pub, a_sec = load_keypair("m", "a", home)
        assert admitted(b_endpoint, b_key, c_pub, c_sec, 3000)  # control: c's key is admitted by b
        # deny c on the administrator's machine: b and c apply it from the devices, with nothing copied
        r = ctl(home, "deny", "m", "c")
        assert r.returncode == 0, r.stderr
        assert wait_for(lambda: sc.proc.poll() is not None)  # c's own service stopped itself
        assert sc.proc.returncode == 4  # a failure to whoever started it (systemd: not a clean stop)
        sc.expected_exit = 4
        assert "server 'c' was denied on store 'm'" in sc.log.read_text()
        assert wait_for(lambda: visible(host_b, "b", keys_of("c", 30)) == 0)
        assert visible(home, "a", keys_of("c", 30)) == 0
        assert read_all(host_b, "b", keys_of("c", 30)) == (0, 30, 0)
        assert stats(sb).config_reloads == 1  # b joined after both allows: it applied the deny
        # b no longer admits c's key, and still admits a's
        assert not admitted(b_endpoint, b_key, c_pub, c_sec, 1500)
        assert admitted(b_endpoint, b_key, a_pub, a_sec, 3000)
        r = ctl(host_c, "connect", "m", "--server", "c")
        assert r.returncode == 4 and "was denied" in r.stderr
        r = ctl(host_c, "connect", "m")  # c's key matches no allowed server any more
        assert r.returncode == 4 and "server 'c' was denied on store 'm'" in r.stderr
        # refusals on a machine that is not the administrator's
        r = ctl(host_b, "deny", "m", "a")
        assert r.returncode == 4 and "no administrator key" in r.stderr
        # a machine pinning another administrator key refuses the devices
        r = ctl(home / "host-d", "connect", "m", "--device", devs[0], "--admin-key", "ab" * 32)
        assert r.returncode == 4 and "no superblock copy is signed by the store's administrator key abababab" in r.stderr
        assert stats(sa).sync_messages_rejected == 0
    finally:
        r = ctl(host_b, "disconnect", "m", "--server", "b")
    assert r.returncode == 0, r.stderr
    assert not sb.leftovers()


def test_torn_and_forged_superblocks_keep_the_last_good_membership(home: Path, file_devices: Any,
                                                                    services: Any) -> None:
    devs = cluster(home, file_devices, ["a", "b"], spare=1)
    sa = services(home, "m", "a")
    src = LiveSource("m", home)
    gen = stats(sa).config_generation
    sb0 = read_superblock(devs[0])
    allow_x = tuple(dataclasses.replace(x, server="x", public_key=bytes(32 * [7]), sync="127.0.0.1:1")
                    if x.spare else x for x in sb0.areas)
    admin = AdminKey.load(home / "keys" / "m" / "admin.sign")
    # torn: the administrator's own signed rewrite, cut after its first 4 KiB, in copy A of device 0
    torn = admin.sign(dataclasses.replace(sb0, generation=sb0.generation + 1, membership_gen=sb0.membership_gen + 1,
                                          areas=allow_x)).encode()
    with open(devs[0], "r+b") as f:
        f.write(torn[:4096])
    assert wait_for(lambda: any(w["event"] == "superblock copy refused" and "checksum" in w.get("reason", "")
                                for w in src.snapshot()["a"]["warnings"]))
    # forged: a whole, checksummed copy on device 1 that allows x, signed by a key nobody trusts
    mallory = AdminKey.generate()
    sb1 = read_superblock(devs[1])
    forged = mallory.sign(dataclasses.replace(sb1, generation=sb1.generation + 1,
                                              membership_gen=sb1.membership_gen + 5, areas=allow_x))
    with open(devs[1], "r+b") as f:
        f.write(forged.encode())
    assert wait_for(lambda: any(w["event"] == "superblock copy refused" and "not signed" in w.get("reason", "")
                                for w in src.snapshot()["a"]["warnings"]))
    assert stats(sa).config_generation == gen and stats(sa).config_reloads == 0
    assert [s.name for s in load_store("m", home).servers] == ["a", "b"]
    assert put_pages(home, "a", keys_of("a", 10)).stored == 10  # serving on
    assert read_all(home, "a", keys_of("a", 10)) == (10, 0, 0)
    # both copies of device 1 forged: the device no longer verifies; the service keeps what it has
    with open(devs[1], "r+b") as f:
        f.seek(8192)
        f.write(forged.encode())
    assert wait_for(lambda: any(w["event"] == "store config changed but was not applied"
                                and "no superblock copy is signed" in w.get("error", "")
                                for w in src.snapshot()["a"]["warnings"]))
    assert read_all(home, "a", keys_of("a", 10)) == (10, 0, 0)
    # the administrator builds on the membership it last verified, never on the forgery, and
    # rewrites the forged device with it
    r = ctl(home, "allow", "m", f"y=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 0, r.stderr
    m = load_store("m", home)
    assert [s.name for s in m.servers] == ["a", "b", "y"] and m.membership_gen == gen + 1
    assert all(sb.admin_key == admin.public and sb.areas[2].server == "y" for sb in map(read_superblock, devs))
    assert wait_for(lambda: stats(sa).config_generation == gen + 1)


def test_deny_cuts_a_server_off_and_allow_takes_it_back(home: Path, file_devices: Any, services: Any) -> None:
    cluster(home, file_devices, ["a", "b", "c"], spare=0)
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    sc = services(home, "m", "c")
    assert put_pages(home, "c", keys_of("c", 30)).stored == 30
    assert wait_for(lambda: visible(home, "a", keys_of("c", 30)) == 30)
    r = ctl(home, "deny", "m", "c")
    assert r.returncode == 0, r.stderr
    assert "applied by the running service(s) here: a, b, c" in r.stdout
    # applied means: c's pages are gone from a's and b's index at once, its key is revoked
    assert visible(home, "a", keys_of("c", 30)) == 0 and visible(home, "b", keys_of("c", 30)) == 0
    assert read_all(home, "a", keys_of("c", 30)) == (0, 30, 0)
    assert stats(sa).areas_dropped == 30
    assert not (home / "keys" / "m" / "c.key").exists()
    assert load_store("m", home).servers[2].denied
    assert wait_for(lambda: sc.proc.poll() is not None) and sc.proc.returncode == 4  # denied: refused
    sc.expected_exit = 4
    # refusals
    r = ctl(home, "connect", "m", "--server", "c")
    assert r.returncode == 4 and "was denied" in r.stderr
    r = ctl(home, "deny", "m", "c")
    assert r.returncode == 4 and "already denied" in r.stderr
    r = ctl(home, "deny", "m", "zz")
    assert r.returncode == 4 and "not allowed" in r.stderr
    # allow c again: it gets its area back with a new key, and what it holds is visible again
    r = ctl(home, "allow", "m", "c")
    assert r.returncode == 0, r.stderr
    assert "area 2" in r.stdout
    sc2 = services(home, "m", "c")
    assert wait_for(lambda: visible(home, "a", keys_of("c", 30)) == 30)
    assert read_all(home, "a", keys_of("c", 30)) == (30, 0, 0)
    assert put_pages(home, "b", keys_of("b-marker", 5)).stored == 5
    # the last allowed server cannot be denied
    assert ctl(home, "deny", "m", "b").returncode == 0
    r = ctl(home, "deny", "m", "c")
    assert r.returncode == 0
    assert wait_for(lambda: sc2.proc.poll() is not None) and sc2.proc.returncode == 4
    sc2.expected_exit = 4
    r = ctl(home, "deny", "m", "a")
    assert r.returncode == 4 and "last allowed server" in r.stderr
    assert wait_for(lambda: sb.proc.poll() is not None)  # b stopped itself when it was denied
    assert sb.proc.returncode == 4
    sb.expected_exit = 4
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


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_machine_serves_only_with_the_servers_key(home: Path, file_devices: Any, services: Any, n: int) -> None:
    """A new machine that connects before it is allowed, or that names a server whose key it does
    not hold, is refused before it writes anything, with what to do; the real server loses nothing.
    (Before: on a one-server store the new machine ran as server a, and a read back 0 of its pages.)"""
    from kvstore.errors import NotAllowed
    from kvstore.service.supervisor import Supervisor

    names = ["a", "b", "c"][:n]
    devs = file_devices.make(2, (1 << 20) + (n + 1) * 100 * (4096 + PS))
    make_store(home, "m", devs, PS, [f"{x}=127.0.0.1:{free_port_pair()}" for x in names], spare=1)
    sa = services(home, "m", "a")
    assert put_pages(home, "a", keys_of("a", 40)).stored == 40
    host_x = home / "host-x"
    pub_x = keygen(host_x, "x")
    r = ctl(host_x, "connect", "m", "--device", devs[0])
    assert r.returncode == 4, r.stdout + r.stderr
    assert "this machine's key for server 'x' of store 'm' is not allowed yet" in r.stderr
    assert f"mass-ctl kvcache allow m x=HOST:PORT --key={pub_x}" in r.stderr
    # a key made under a member's name is not that member's key
    keygen(host_x, "a")
    for args in ((), ("--server", "a")):
        r = ctl(host_x, "connect", "m", *args)
        assert r.returncode == 4, r.stdout + r.stderr
        assert "is not the one store 'm' allows for 'a'" in r.stderr
    (host_x / "keys" / "m" / "a.key").unlink()
    (host_x / "keys" / "m" / "x.key").unlink()
    for s in names:
        r = ctl(host_x, "connect", "m", "--server", s)
        assert r.returncode == 4 and f"no key here for server {s!r} of store 'm'" in r.stderr
    # the service itself refuses too (a library caller skips the CLI)
    with pytest.raises(NotAllowed, match="no key here for server 'a'"):
        Supervisor(load_store("m", host_x), "a", host_x)
    # ... and a config of the caller's own that gives a this machine's key: the devices decide
    pub_y = keygen(host_x, "y")
    cfg = load_store("m", host_x)
    forged = dataclasses.replace(cfg, servers=(dataclasses.replace(cfg.servers[0], public_key=pub_y),
                                               *cfg.servers[1:]))
    sup = Supervisor(forged, "a", host_x)
    with pytest.raises(NotAllowed, match="the devices give area 0 to server 'a'.* with another key"):
        sup.start()
    (host_x / "keys" / "m" / "y.key").unlink()
    assert not list((host_x / "run").rglob("*.pid")) if (host_x / "run").exists() else True
    assert read_all(home, "a", keys_of("a", 40)) == (40, 0, 0)
    assert stats(sa).validation_failures == 0


def flip(path: str, offsets: tuple[int, ...] = (300, 8192 + 300)) -> None:
    """One byte flipped in each superblock copy (its checksum fails; magic, store and index stay)."""
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def test_a_torn_device_blocks_no_command(home: Path, file_devices: Any, services: Any) -> None:
    """Both copies of one device torn: status, list, show and disconnect still work and name the
    device; the service serves on; a restart is refused with what to do; the administrator's
    repair (or next allow) rewrites it from the membership it last verified, and the restart works.
    (Before: allow/deny, status, list and disconnect all failed, and no service could restart.)"""
    devs = cluster(home, file_devices, ["a", "b"], spare=1)
    sa = services(home, "m", "a")
    assert put_pages(home, "a", keys_of("a", 20)).stored == 20
    flip(devs[1])
    for args in (("status", "m"), ("status", "m", "--json"), ("show", "m"), ("list",)):
        r = ctl(home, *args)
        assert r.returncode == 0, (args, r.stdout + r.stderr)
    assert f"PROBLEM: device 1 ({devs[1]}): torn" in ctl(home, "status", "m").stdout
    assert json.loads(ctl(home, "status", "m", "--json").stdout)["problems"][0].startswith(f"device 1 ({devs[1]}): torn")
    assert "server a: running" in ctl(home, "status", "m").stdout
    assert "PROBLEM: torn" in ctl(home, "show", "m").stdout and "repair m" in ctl(home, "show", "m").stdout
    assert read_all(home, "a", keys_of("a", 20)) == (20, 0, 0)  # the running service serves on
    r = ctl(home, "disconnect", "m")
    assert r.returncode == 0, r.stderr
    r = ctl(home, "connect", "m", "--server", "a")  # never started on a device it cannot verify
    assert r.returncode == 4 and "checksum mismatch" in r.stderr and "'mass-ctl kvcache repair m'" in r.stderr
    r = ctl(home, "repair", "m")
    assert r.returncode == 0, r.stderr
    assert f"rewrote the superblocks of device(s) {devs[1]}" in r.stdout
    assert "nothing to repair" in ctl(home, "repair", "m").stdout
    sa2 = services(home, "m", "a")
    assert read_all(home, "a", keys_of("a", 20)) == (20, 0, 0)
    # torn again, then allow: the change itself rewrites it
    flip(devs[1])
    r = ctl(home, "allow", "m", f"c=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 0, r.stderr
    assert read_superblock(devs[1]).areas[2].server == "c"
    assert wait_for(lambda: stats(sa2).config_generation == load_store("m", home).membership_gen)
    # a device at that path that does not name the store is never rewritten
    with open(devs[1], "r+b") as f:
        f.write(bytes(16384))
    r = ctl(home, "repair", "m")
    assert r.returncode == 4 and f"device {devs[1]} is not formatted for kvstore" in r.stderr, r.stderr
    with open(devs[1], "rb") as f:
        assert f.read(16384) == bytes(16384)
    assert stats(sa).validation_failures == 0


def test_a_replayed_membership_locks_nobody_out(home: Path, file_devices: Any, services: Any) -> None:
    """A denied host writes back the superblocks from before its deny. Running servers refuse them;
    the administrator's show, allow and deny work from the membership it last verified; a restart
    works; repair rewrites the devices; b stays denied throughout. (Before: show/allow/deny failed
    'older than one this machine has seen' and nothing repaired it.)"""
    devs = cluster(home, file_devices, ["a", "b"], spare=2)
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    assert put_pages(home, "b", keys_of("b", 20)).stored == 20
    assert wait_for(lambda: visible(home, "a", keys_of("b", 20)) == 20)
    before = [open(d, "rb").read(16384) for d in devs]
    assert ctl(home, "deny", "m", "b").returncode == 0
    assert wait_for(lambda: sb.proc.poll() is not None) and sb.proc.returncode == 4
    sb.expected_exit = 4
    gen = load_store("m", home).membership_gen
    for d, old in zip(devs, before):  # the replay
        with open(d, "r+b") as f:
            f.write(old)
    src = LiveSource("m", home)
    assert wait_for(lambda: any("older than the one this machine has seen" in w.get("reason", "")
                                for w in src.snapshot()["a"]["warnings"]))
    assert visible(home, "a", keys_of("b", 20)) == 0 and stats(sa).config_generation == gen
    r = ctl(home, "show", "m")
    assert r.returncode == 0 and "PROBLEM: rolled back" in r.stdout and "b: DENIED" in r.stdout, r.stdout + r.stderr
    assert ctl(home, "status", "m").returncode == 0
    assert ctl(home, "connect", "m", "--server", "b").returncode == 4  # the replay allows b nowhere here
    r = ctl(home, "disconnect", "m", "--server", "a")
    assert r.returncode == 0, r.stderr
    sa2 = services(home, "m", "a")  # restarts on the membership it verified, b still denied
    assert visible(home, "a", keys_of("b", 20)) == 0
    r = ctl(home, "allow", "m", f"c=127.0.0.1:{free_port_pair()}")
    assert r.returncode == 0, r.stderr
    assert all(x.membership_gen == gen + 1 and x.areas[1].denied for x in map(read_superblock, devs))
    for d, old in zip(devs, before):  # and again, repaired
        with open(d, "r+b") as f:
            f.write(old)
    r = ctl(home, "repair", "m")
    assert r.returncode == 0 and "rewrote" in r.stdout, r.stdout + r.stderr
    assert all(x.membership_gen == gen + 2 and x.areas[1].denied and x.areas[2].server == "c"
               for x in map(read_superblock, devs))
    assert wait_for(lambda: stats(sa2).config_generation == gen + 2)
    assert stats(sa2).validation_failures == 0


def test_administrators_at_once_lose_no_server(home: Path, file_devices: Any) -> None:
    """Six allows started at the same moment on the administrator's machine: each gets its own
    area and every one is in the membership. (Before: all reported success, 3 of 6 were missing.)"""
    devs = file_devices.make(1, (1 << 20) + 7 * 40 * (4096 + PS))
    make_store(home, "m", devs, PS, [f"a=127.0.0.1:{free_port_pair()}"], spare=6)
    env = dict(os.environ, MASS_HOME=str(home))
    names = [f"s{i}" for i in range(6)]
    procs = [subprocess.Popen([sys.executable, "-m", "kvstore.cli", "kvcache", "allow", "m",
                               f"{n}=127.0.0.1:{free_port_pair()}"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in names]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    m = load_store("m", home)
    assert sorted(s.name for s in m.servers) == sorted(["a"] + names)
    assert m.membership_gen == 7
    assert len({o.split("area ")[1].split()[0] for o, _ in outs}) == 6  # six different areas


def test_two_candidates_for_one_device_are_named_and_refused(home: Path, file_devices: Any) -> None:
    """A backup copy of device 1 beside it (or one device seen through two paths): joining with
    device 0 alone names both candidates and refuses; naming the right one with --device works.
    (Before: the backup was taken as device 1 without a word.)"""
    import shutil

    from kvstore.admin import join_store
    from kvstore.errors import DeviceMismatch

    devs = cluster(home, file_devices, ["a", "b"], spare=0)
    backup = str(Path(devs[1]).parent / "a-backup-of-dev1.img")
    shutil.copyfile(devs[1], backup)
    host = home / "host-n"
    r = ctl(host, "connect", "m", "--device", devs[0])
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"device 1 of the store is claimed by {backup} and {devs[1]}" in r.stderr
    assert "pass the right one with --device" in r.stderr
    assert not (host / "stores" / "m.toml").exists()
    with pytest.raises(DeviceMismatch, match="claimed by"):
        join_store(host, "m", [devs[0]])
    local, m, _ = join_store(host, "m", [devs[0], devs[1]])
    assert list(local.devices) == devs and m.paths == tuple(devs)
    # the real device torn, the backup whole: still two claimants, never the backup by default
    with open(devs[1], "r+b") as f:
        real = f.read(16384)
    flip(devs[1])
    r = ctl(home / "host-t", "connect", "m", "--device", devs[0])
    assert r.returncode == 4 and f"{devs[1]} (its superblock is torn)" in r.stderr, r.stderr
    with open(devs[1], "r+b") as f:
        f.write(real)
    local, m, _ = join_store(host, "m", [devs[1], backup, devs[0]][1:])  # the backup, picked on purpose
    assert list(local.devices) == [devs[0], backup]


@pytest.mark.parametrize("change", ["deny-allow", "update-address"])
def test_a_returning_server_catches_up_whatever_changed_meanwhile(home: Path, file_devices: Any, services: Any,
                                                                  change: str) -> None:
    """b is down while the membership changes (b denied and allowed again, or a's sync address
    updated: a's sync agent is replaced either way); a saves pages meanwhile. Back, b reads every one
    of them without a new save to prompt it, and a's heartbeats announce what a has. (Before: the new
    agent announced sequence 0, b saw 0 of 20 for 45 s and status said '0 updates behind'.)"""
    cluster(home, file_devices, ["a", "b"], spare=1)
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    assert put_pages(home, "a", keys_of("early", 5)).stored == 5
    assert wait_for(lambda: visible(home, "b", keys_of("early", 5)) == 5)
    assert sb.stop() == 0
    assert put_pages(home, "a", keys_of("a", 20)).stored == 20
    reloads = stats(sa).config_reloads
    if change == "deny-allow":
        assert ctl(home, "deny", "m", "b").returncode == 0
        assert ctl(home, "allow", "m", "b").returncode == 0
    else:
        r = ctl(home, "allow", "m", f"a=127.0.0.1:{free_port_pair()}", "--update")
        assert r.returncode == 0, r.stderr
    assert stats(sa).config_reloads >= reloads + 1
    sb2 = services(home, "m", "b")
    assert wait_for(lambda: visible(home, "b", keys_of("a", 20)) == 20, timeout=30), \
        visible(home, "b", keys_of("a", 20))
    assert read_all(home, "b", keys_of("a", 20)) == (20, 0, 0)
    src = LiveSource("m", home)
    assert wait_for(lambda: (src.snapshot()["b"].get("peers") or {}).get("a", {}).get("behind") == 0
                    and src.snapshot()["b"]["peers"]["a"]["heard_s"] is not None)
    assert stats(sb2).validation_failures == 0


def test_key_rotation_as_operations_describes_it(home: Path, file_devices: Any, services: Any) -> None:
    """docs/OPERATIONS.md: keygen --force on the server, allow --update --key on the administrator's
    machine. b serves on throughout; peers admit only the new key afterwards; a machine holding the
    old key can no longer serve as b."""
    cluster(home, file_devices, ["a", "b"], spare=0)
    sa, sb = services(home, "m", "a"), services(home, "m", "b")
    old_pub, old_sec = load_keypair("m", "b", home)
    old_file = (home / "keys" / "m" / "b.key").read_text()
    new_pub = keygen_force(home, "b")
    r = ctl(home, "allow", "m", "b", "--update", f"--key={new_pub}")
    assert r.returncode == 0, r.stderr
    assert load_store("m", home).servers[1].public_key == new_pub
    assert sb.proc.poll() is None  # b serves on, with its new key
    assert put_pages(home, "b", keys_of("after", 10)).stored == 10
    assert wait_for(lambda: visible(home, "a", keys_of("after", 10)) == 10)
    cfg = load_store("m", home)
    a_endpoint, a_key = cfg.servers[0].endpoints[0], cfg.servers[0].public_key.encode()
    assert not admitted(a_endpoint, a_key, old_pub, old_sec, 1500)
    assert admitted(a_endpoint, a_key, *load_keypair("m", "b", home), 3000)
    other = home / "host-old"
    (other / "keys" / "m").mkdir(parents=True)
    (other / "keys" / "m" / "b.key").write_text(old_file)
    (other / "stores").mkdir()
    for f in ("m.toml",):
        (other / "stores" / f).write_text((home / "stores" / f).read_text())
    r = ctl(other, "connect", "m", "--server", "b")
    assert r.returncode == 4 and "is not the one store 'm' allows for 'b'" in r.stderr
    assert stats(sa).validation_failures == 0


def keygen_force(home: Path, server: str) -> str:
    r = ctl(home, "keygen", "m", "--server", server, "--force")
    assert r.returncode == 0, r.stderr
    return next(ln.split(": ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("public key: "))


def test_pages_a_killed_server_never_published_reach_its_peers_when_it_returns(home: Path, file_devices: Any,
                                                                              services: Any) -> None:
    """b saves pages while its sync agent is frozen (SIGSTOP), then b is killed (SIGKILL): nothing
    was published. When b returns, a learns of them: a new run's delta log begins with what the
    server holds. (Before: a never saw them; the torture test found it with a save right before a
    restart.)"""
    import signal

    cluster(home, file_devices, ["a", "b"], spare=0)
    services(home, "m", "a")
    sb = services(home, "m", "b")
    assert put_pages(home, "b", keys_of("first", 3)).stored == 3
    assert wait_for(lambda: visible(home, "a", keys_of("first", 3)) == 3)
    frozen = [p for p in sb.children() if p not in sb.worker_pids()]  # the sync agent (and nothing else)
    assert frozen
    for p in frozen:
        os.kill(p, signal.SIGSTOP)
    assert put_pages(home, "b", keys_of("unpublished", 8)).stored == 8
    assert visible(home, "a", keys_of("unpublished", 8)) == 0
    for p in [sb.pid, *sb.children()]:
        os.kill(p, signal.SIGKILL)
    sb.proc.wait(30)
    sb.expected_exit = -9
    services(home, "m", "b")
    assert wait_for(lambda: visible(home, "a", keys_of("unpublished", 8)) == 8), visible(home, "a",
                                                                                        keys_of("unpublished", 8))
    assert read_all(home, "a", keys_of("unpublished", 8)) == (8, 0, 0)


def test_a_copy_of_another_devices_superblock_is_refused_and_repaired(home: Path, file_devices: Any,
                                                                     services: Any) -> None:
    """Device 0's own current superblock written over device 1's first copy (validly signed, same
    generation): the path is device 1 as this machine verified, so that copy is refused, the other
    copy read, nothing locks out; show and status flag the device and repair rewrites both copies.
    (Found by an outside review: show failed, repair/allow/deny and b's restart were refused.)"""
    devs = cluster(home, file_devices, ["a", "b"], spare=1)
    services(home, "m", "a")
    sb = services(home, "m", "b")
    assert put_pages(home, "b", keys_of("b", 10)).stored == 10
    with open(devs[0], "rb") as f:
        block = f.read(8192)
    with open(devs[1], "r+b") as f:
        f.write(block)
    r = ctl(home, "show", "m")
    assert r.returncode == 0 and "one superblock copy does not verify" in r.stdout, r.stdout + r.stderr
    assert f"PROBLEM: device 1 ({devs[1]}): one superblock copy does not verify" in ctl(home, "status", "m").stdout
    assert sb.stop() == 0
    sb2 = services(home, "m", "b")  # restarts
    r = ctl(home, "repair", "m")
    assert r.returncode == 0 and f"rewrote the superblocks of device(s) {devs[1]}" in r.stdout, r.stdout + r.stderr
    from kvstore.storage.device import read_copies

    assert [c.device_index for c in read_copies(devs[1])] == [1, 1]  # type: ignore[union-attr]
    assert "nothing to repair" in ctl(home, "repair", "m").stdout
    assert read_all(home, "b", keys_of("b", 10)) == (10, 0, 0)
    assert stats(sb2).validation_failures == 0


def test_a_wiped_superblock_is_repaired_only_when_the_operator_vouches_for_the_path(home: Path,
                                                                                     file_devices: Any) -> None:
    devs = cluster(home, file_devices, ["a", "b"], spare=0)
    assert ctl(home, "show", "m").returncode == 0  # the record is written
    with open(devs[1], "r+b") as f:
        f.write(bytes(16384))
    r = ctl(home, "repair", "m")
    assert r.returncode == 4 and "not formatted for kvstore" in r.stderr
    r = ctl(home, "repair", "m", "--force", "/nowhere")
    assert r.returncode == 2 and "not a device of store 'm'" in r.stderr
    r = ctl(home, "repair", "m", "--force", devs[1])
    assert r.returncode == 0 and "rewrote" in r.stdout, r.stdout + r.stderr
    assert read_superblock(devs[1]).device_index == 1 and "nothing to repair" in ctl(home, "repair", "m").stdout


def test_connect_refuses_a_metrics_address_that_collides_and_saves_nothing(home: Path, file_devices: Any,
                                                                          services: Any) -> None:
    """connect --metrics on the server's own sync port (or another's): refused with both named,
    nothing saved. (Before: saved; the sync agent never bound; peers saw none of its pages.) A
    connect refused because the service already runs saves nothing either."""
    cluster(home, file_devices, ["a", "b"], spare=0)
    cfg = load_store("m", home)
    sync_b = cfg.servers[1].sync
    before = (home / "stores" / "m.toml").read_text()
    r = ctl(home, "connect", "m", "--server", "b", "--metrics", sync_b)
    assert r.returncode == 2 and f"server b's metrics address {sync_b} takes port" in r.stderr, r.stderr
    assert (home / "stores" / "m.toml").read_text() == before
    services(home, "m", "a")
    r = ctl(home, "connect", "m", "--server", "a", "--metrics", "127.0.0.1:1")
    assert r.returncode == 4 and "already runs here" in r.stderr
    assert (home / "stores" / "m.toml").read_text() == before
