"""Tenant isolation: each tenant's keys live in a key space of their own unless namespaces are shared."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient, KVStoreError, NotAllowed
from kvstore.config import StoreConfig, load_store, run_dir, save_store
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store, opened_to_others

pytestmark = pytest.mark.integration
PS = 16 << 10


def trusting(cfg: StoreConfig, **changes: Any) -> StoreConfig:
    """The config with declared tenants trusted (``service.trust_declared_tenant``): these tests
    run every client as one user and name tenants at connect."""
    return dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, trust_declared_tenant=True), **changes)


def test_tenants_cannot_hit_or_read_each_other(home: Path, file_devices: Any, services: Any) -> None:
    (dev,) = file_devices.make(1, (1 << 20) + 100 * (4096 + PS))
    save_store(trusting(make_store(home, "t", [dev], PS)), home)
    services(home, "t")
    keys = [b"system-prompt/%d" % i for i in range(8)]
    pages = [page_bytes(k, PS) for k in keys]
    with KVCacheClient.connect("t", home=home, tenant="alice") as a, \
            KVCacheClient.connect("t", home=home, tenant="bob") as b, \
            KVCacheClient.connect("t", home=home) as default:
        assert a.put(keys, pages, wait=True).stored == 8
        assert a.lookup(keys) == 8
        # bob and the default tenant see nothing of alice's: no hit, no read, no dedup
        for other in (b, default):
            assert other.lookup(keys) == 0 and other.contains(keys) == [False] * 8
            with other.get(keys) as v:
                assert v.hits == 0
        r = b.put(keys, [bytes(PS)] * 8, wait=True)  # bob's own pages under the same key bytes
        assert r.stored == 8
        with a.get(keys) as va, b.get(keys) as vb:
            assert all(bytes(x) == p.tobytes() for x, p in zip(va, pages))  # alice still reads hers
            assert all(bytes(x) == bytes(PS) for x in vb)                  # bob reads his
    with pytest.raises(KVStoreError, match="tenant name"):
        KVCacheClient.connect("t", home=home, tenant="Bad Name")


def test_shared_namespace(home: Path, file_devices: Any, services: Any) -> None:
    (dev,) = file_devices.make(1, (1 << 20) + 100 * (4096 + PS))
    cfg = make_store(home, "t", [dev], PS)
    save_store(trusting(cfg, namespaces={"alice": "team", "bob": "team"}), home)
    services(home, "t")
    keys = [b"doc/%d" % i for i in range(4)]
    with KVCacheClient.connect("t", home=home, tenant="alice") as a, \
            KVCacheClient.connect("t", home=home, tenant="bob") as b, \
            KVCacheClient.connect("t", home=home, tenant="carol") as c:
        a.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        assert b.lookup(keys) == 4 and b.put(keys, [bytes(PS)] * 4, wait=True).skipped == 4
        with b.get(keys) as v:
            assert all(bytes(x) == page_bytes(k, PS).tobytes() for k, x in zip(keys, v))
        assert c.lookup(keys) == 0
    assert load_store("t", home).namespaces == {"alice": "team", "bob": "team"}


def test_other_local_users_cannot_connect(home: Path, file_devices: Any, services: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    other_python = "/usr/bin/python3"  # an interpreter the other user may execute
    if not os.access(other_python, os.X_OK):
        pytest.skip("no system python3 for the other user")
    (dev,) = file_devices.make(1, (1 << 20) + 20 * (4096 + PS))
    make_store(home, "t", [dev], PS)
    svc = services(home, "t")
    sock = run_dir("t", home) / "local.sock"
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    for seg in svc.leftovers():  # every live segment and wake-up FIFO is owner-only
        assert stat.S_IMODE(os.stat(Path("/dev/shm") / seg).st_mode) == 0o600
    # open every directory on the way (only for this test), so that the socket's own mode decides
    code = ("import socket; s = socket.socket(socket.AF_UNIX); print('socket made', flush=True); "
            f"s.connect({str(sock)!r}); print('connected')")
    with opened_to_others([sock.parent]):
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", other_python, "-c", code],
                           capture_output=True, text=True, cwd="/", timeout=120)
    # the interpreter ran and made its socket; the connect itself was refused
    assert "socket made" in r.stdout and "connected" not in r.stdout, r.stdout + r.stderr
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr


def nogroup_or_skip() -> int:
    """The gid of 'nogroup' where a client can run as another user here (root, a system python3)."""
    import grp

    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and a system python3 to run a client as another user")
    try:
        return grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no 'nogroup' group here")


def run_as_other_user(home: Path, gid: int, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` with the system python3 as uid 65534 in group ``gid``, with the directories
    above ``home`` opened for the run only (so that the service's own modes decide)."""
    with opened_to_others([home]):
        return subprocess.run(["setpriv", "--reuid=65534", f"--regid={gid}", "--clear-groups", "/usr/bin/python3",
                               "-c", code], capture_output=True, text=True, cwd="/", timeout=120)


def test_access_group_lets_its_members_connect(home: Path, file_devices: Any, services: Any) -> None:
    gid = nogroup_or_skip()
    (dev,) = file_devices.make(1, (1 << 20) + 20 * (4096 + PS))
    cfg = make_store(home, "t", [dev], PS)
    save_store(dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, access_group="nogroup")), home)
    svc = services(home, "t")
    sock = run_dir("t", home) / "local.sock"
    st = os.stat(sock)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    # what clients only read: group read; the wake-ups clients post (FIFOs): group write, never
    # read (a reader would take the service's wake-ups); the service's own rings and every
    # connection's segment (passed to its client as a file descriptor): nobody else's
    want = {"control": 0o640, "stats": 0o640, "board": 0o640, "peers": 0o640, "w0": 0o600,
            "sync": 0o600, "wake.bell": 0o620, "wake.w0": 0o620}
    seen = set()
    for seg in svc.leftovers():
        s2 = os.stat(Path("/dev/shm") / seg)
        what = seg[len(svc.prefix):]
        seen.add(what)
        mode = want[what]
        assert stat.S_IMODE(s2.st_mode) == mode, (seg, oct(s2.st_mode))
        assert stat.S_ISFIFO(s2.st_mode) == what.startswith("wake."), seg
        assert (s2.st_gid == gid) == bool(mode & 0o070), seg
    assert {"control", "w0", "stats", "wake.bell", "wake.w0"} <= seen, seen
    r = run_as_other_user(home, gid, "import socket; s = socket.socket(socket.AF_UNIX); "
                                     f"s.connect({str(sock)!r}); print('connected')")
    assert r.returncode == 0 and "connected" in r.stdout, r.stderr


def test_tenant_comes_from_credentials(home: Path, file_devices: Any, services: Any) -> None:
    """The service maps who connected (SO_PEERCRED) to tenants: this user is mapped to alpha only."""
    (dev,) = file_devices.make(1, (1 << 20) + 40 * (4096 + PS))
    cfg = make_store(home, "t", [dev], PS)
    save_store(dataclasses.replace(cfg, tenants={"alpha": [f"uid:{os.getuid()}"], "beta": ["uid:4242"]}), home)
    services(home, "t")
    with pytest.raises(NotAllowed, match=r"may not use tenant 'beta'.*maps it to 'alpha'"):
        KVCacheClient.connect("t", home=home, tenant="beta")
    keys = [b"k/%d" % i for i in range(4)]
    with KVCacheClient.connect("t", home=home, tenant="alpha") as a, KVCacheClient.connect("t", home=home) as d:
        assert a.tenant == "alpha" and d.tenant == "alpha"   # asking for nothing gives its only tenant
        a.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        assert d.lookup(keys) == 4                          # the same key space


def test_another_user_cannot_claim_a_tenant(home: Path, file_devices: Any, services: Any) -> None:
    """A process of another uid (in the access group) asks for tenant alpha, mapped to this user only:
    refused. Its hello says nothing about who it is; the kernel does."""
    import msgpack

    from kvstore.ipc.connection import VERSION

    gid = nogroup_or_skip()
    (dev,) = file_devices.make(1, (1 << 20) + 20 * (4096 + PS))
    cfg = make_store(home, "t", [dev], PS)
    save_store(dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, access_group="nogroup"),
                                   tenants={"alpha": ["uid:0"]}), home)
    services(home, "t")
    sock = run_dir("t", home) / "local.sock"
    hello = msgpack.packb({"v": VERSION, "op": "hello", "tenant": "alpha"})
    frame = len(hello).to_bytes(4, "little") + hello
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(5); "
            f"s.connect({str(sock)!r}); s.sendall(bytes.fromhex({frame.hex()!r})); "
            "d = b''\nwhile True:\n    c = s.recv(65536)\n    if not c: break\n    d += c\nprint(d.hex())")
    r = run_as_other_user(home, gid, code)
    assert r.returncode == 0, r.stderr
    data = bytes.fromhex(r.stdout.strip())
    reply = msgpack.unpackb(data[4:])
    assert reply["ok"] is False and reply["kind"] == "tenant", reply
    assert "uid 65534 may not use tenant 'alpha'" in reply["error"]


def _ctl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", *args], env=dict(os.environ, MASS_HOME=str(home)),
                          capture_output=True, text=True, timeout=120)


def test_invalidate_ends_a_key_space_for_every_connection_at_once_and_only_that_one(
        home: Path, file_devices: Any, services: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mass-ctl kvcache invalidate``: after it returns, no page saved before in the named
    tenant's key space is a hit, through the client's own lookup, a direct read, or the
    service; not for clients connected before it either, not even one that keeps the old
    salt (the workers and the service salt with their own); other key spaces keep theirs."""
    from kvstore.digests import key_digests
    from kvstore.shm.segment import Segment
    from kvstore.shm.stats import StatsBlock

    (dev,) = file_devices.make(1, (1 << 20) + 200 * (4096 + PS))
    save_store(trusting(make_store(home, "t", [dev], PS), namespaces={"alice": "team", "bob": "team"},
                        pin_quotas={"alice": 8}), home)
    svc = services(home, "t")
    keys = [b"weights-v1/%d" % i for i in range(8)]
    pages = [page_bytes(k, PS) for k in keys]
    with KVCacheClient.connect("t", home=home, tenant="alice") as a, \
            KVCacheClient.connect("t", home=home, tenant="bob") as b, \
            KVCacheClient.connect("t", home=home, tenant="carol") as c, \
            KVCacheClient.connect("t", home=home) as d, \
            KVCacheClient.connect("t", home=home, tenant="mallory") as m:
        for cl in (a, c, d):
            assert cl.put(keys, pages, wait=True).stored == 8
        assert b.lookup(keys) == 8  # bob shares alice's key space
        assert a.pin(keys) == 8  # alice's whole pin quota, on pages about to be invalidated
        stale = b._tenant_salt()
        # an adversary scribbles on the keyspace words of its own channel: the service never reads them
        from kvstore._native.lib import LIB

        LIB.kv_store_release_u64(m._chan._kseq, 2**64 - 1)
        r = _ctl(home, "invalidate", "t", "--tenant", "bob")
        assert r.returncode == 0, r.stderr
        assert "key space(s) team" in r.stdout and "applied by the running service(s) here: local" in r.stdout
        # applied before the command returned: the team's old pages are misses on every path
        for cl in (a, b):
            assert cl.lookup(keys) == 0 and cl.contains(keys) == [False] * 8
            with cl.get(keys) as v:
                assert v.hits == 0
            assert cl._lookup_service(key_digests(keys)[0], 10.0)[0] == 0  # the service's own salt moved
        # a client that ignores the new salt finds the old slots in the index; the worker refuses to read them
        monkeypatch.setattr(b, "_tenant_salt", lambda: stale)
        assert b.lookup(keys) == 8
        with b.get(keys) as v:
            assert v.hits == 0
        monkeypatch.undo()
        # the other key spaces are untouched
        for cl in (c, d):
            assert cl.lookup(keys) == 8
            with cl.get(keys) as v:
                assert [bytes(x) for x in v] == [p.tobytes() for p in pages]
        # the team writes again: nothing is skipped as present, and it reads what it wrote
        assert a.put(keys, [bytes(PS)] * 8, wait=True).stored == 8
        with b.get(keys) as v:
            assert [bytes(x) for x in v] == [bytes(PS)] * 8
        # alice's pins on the old pages went with them: her quota pins the new ones
        assert a.pin(keys) == 8
        # --all re-keys the adversary's connection too; the service lives on, and the adversary
        # only misled its own lookups
        r = _ctl(home, "invalidate", "t", "--all")
        assert r.returncode == 0 and "applied by the running service(s) here: local" in r.stdout, r.stderr
        assert m.lookup(keys) == 0 and m.put(keys[:1], pages[:1], wait=True).stored == 1 and m.lookup(keys[:1]) == 1
        assert a.put(keys, pages, wait=True).stored == 8 and b.lookup(keys) == 8
    seg = Segment.attach(svc.prefix + "stats")
    try:
        assert StatsBlock.attach(seg.buf).snapshot().service.salts_changed == 2 + 5  # alice and bob; then all five
    finally:
        seg.close()
    with KVCacheClient.connect("t", home=home, tenant="alice") as a:  # a new connection: the new salt at hello
        assert a.lookup(keys) == 8
    st = load_store("t", home)
    assert (st.key_epoch, st.epochs) == (1, {})
    # --all moved every key space, the default tenant's included
    for tenant in ("carol", ""):
        with KVCacheClient.connect("t", home=home, tenant=tenant) as cl:
            assert cl.lookup(keys) == 0
    bad = _ctl(home, "invalidate", "t")
    assert bad.returncode == 2 and "--tenant" in bad.stderr
    shown = _ctl(home, "show", "t")
    assert shown.returncode == 0 and "key epoch 1 (pages saved under earlier epochs" in shown.stdout
