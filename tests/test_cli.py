"""mass-ctl, driven as a user would: real processes, a temporary MASS_HOME, real exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import KVCacheClient
from kvstore.cli import main
from kvstore.config import load_store
from kvstore.shm.segment import home_prefix, leftovers


def run(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MASS_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def env_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MASS_HOME", str(home))
    return home


def create(home: Path, store: str = "s1", *extra: str) -> int:
    return main(["kvcache", "create", store, "--device", str(home / f"{store}.img"), "--device-size", "16MiB",
                 "--page-size", "64KiB", "--server", "local", *extra])


def test_create_status_and_refusals(env_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert create(env_home) == 0
    out = capsys.readouterr().out
    assert "created store s1" in out and "formatted" in out
    # exists already
    assert create(env_home) == 4
    assert "already exists" in capsys.readouterr().err
    # a device of another store is refused without --force, and left alone
    assert main(["kvcache", "create", "s2", "--device", str(env_home / "s1.img"), "--page-size", "64KiB",
                 "--server", "local"]) == 4
    assert "already belongs to store 's1'" in capsys.readouterr().err
    assert not (env_home / "stores" / "s2.toml").exists()
    # bad page sizes and size strings
    assert main(["kvcache", "create", "s3", "--device", str(env_home / "s3.img"), "--device-size", "16MiB",
                 "--page-size", "5000", "--server", "local"]) == 2
    assert "multiple of 4096" in capsys.readouterr().err
    assert main(["kvcache", "create", "s3", "--device", str(env_home / "s3.img"), "--device-size", "16MiB",
                 "--page-size", "lots", "--server", "local"]) == 2
    assert "is not a size" in capsys.readouterr().err
    # too small a device
    assert main(["kvcache", "create", "s4", "--device", str(env_home / "s4.img"), "--device-size", "1MiB",
                 "--page-size", "64KiB", "--server", "local"]) == 2
    assert "too small" in capsys.readouterr().err
    # missing device without --device-size
    assert main(["kvcache", "create", "s5", "--device", str(env_home / "nope.img"), "--page-size", "64KiB",
                 "--server", "local"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # bad names
    assert main(["kvcache", "create", "Bad/Name", "--device", "x", "--page-size", "64KiB",
                 "--server", "local"]) == 2
    # status of a stopped store, and of an unknown one
    assert main(["kvcache", "status", "s1", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["page_size"] == 65536 and st["servers"]["local"]["running"] is False
    assert main(["kvcache", "status", "nope"]) == 3
    assert "store 'nope' not found" in capsys.readouterr().err


def test_connect_status_second_service_refused(env_home: Path, services) -> None:  # type: ignore[no-untyped-def]
    assert create(env_home) == 0
    r = run(env_home, "kvcache", "connect", "s1", "--server", "intruder")
    assert r.returncode == 4 and "'intruder' is not allowed" in r.stderr
    assert run(env_home, "kvcache", "connect", "nope").returncode == 3
    svc = services(env_home, "s1")
    r = run(env_home, "kvcache", "connect", "s1")
    assert r.returncode == 4 and "already runs here" in r.stderr
    with KVCacheClient.connect("s1") as c:
        c.put([b"a", b"b"], [bytes(c.page_size), bytes(c.page_size)], wait=True)
        with c.get([b"a", b"zz"]) as b:
            assert b.hits == 1
    r = run(env_home, "kvcache", "status", "s1", "--json")
    assert r.returncode == 0
    st = json.loads(r.stdout)["servers"]["local"]
    assert st["running"] and st["pid"] == svc.pid
    assert st["stats"]["service"]["pages_written"] == 2
    assert st["stats"]["service"]["hits"] == 1 and st["stats"]["service"]["misses"] == 1
    r = run(env_home, "kvcache", "status", "s1")
    assert "server local: running" in r.stdout and "hit rate 50.0%" in r.stdout
    # Ctrl-C / SIGTERM stop the foreground service cleanly
    assert svc.stop() == 0
    assert not svc.leftovers()


def _private_shm() -> bool:
    """Whether a command can get a /dev/shm of its own here (root, util-linux ``unshare``)."""
    return os.geteuid() == 0 and subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o mode=1777 tmpfs /dev/shm"],
        capture_output=True).returncode == 0


@pytest.mark.slow
def test_quickstart_runs_and_leaves_nothing(home: Path, tmp_path: Path) -> None:
    """The quickstart's services and clients leave nothing in /dev/shm. As root the run gets a
    /dev/shm of its own (a mount namespace), which must be empty afterwards whatever other tests
    running beside this one (pytest-xdist workers) hold meanwhile; elsewhere nothing named for
    the quickstart's temporary MASS_HOME (which it prints) may remain."""
    args = ["kvcache", "quickstart", "--pages", "256", "--page-size", "64KiB"]
    left = tmp_path / "left"
    if _private_shm():
        script = 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "$@"; rc=$?; ls -A /dev/shm > "$LEFT"; exit $rc'
        r = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", sys.executable, "-m", "kvstore.cli",
                            *args], env=dict(os.environ, MASS_HOME=str(home), LEFT=str(left)),
                           capture_output=True, text=True, timeout=300)
    else:
        r = run(home, *args, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wrong pages: 0" in r.stdout
    assert "hit rate" in r.stdout and "GB/s" in r.stdout
    # gpu-a starts cold; gpu-b, the other server, loads the documents gpu-a saved
    assert "on gpu-a, nothing stored yet: 0 of 160 pages loaded, 160 computed" in r.stdout, r.stdout
    assert "on gpu-b, saved by gpu-a:     128 of 160 pages loaded" in r.stdout, r.stdout
    if left.exists():
        assert left.read_text() == "", f"left in the run's /dev/shm: {left.read_text().split()}"
    else:
        m = re.search(r" in (/\S+kvstore-quickstart-\S+?)[:\s]", r.stdout)
        assert m, r.stdout
        assert not leftovers(home_prefix(Path(m.group(1)))), leftovers(home_prefix(Path(m.group(1))))


def test_list_show_daemon_watch_disconnect(env_home: Path) -> None:
    assert create(env_home, "s1") == 0
    assert create(env_home, "s2") == 0
    r = run(env_home, "kvcache", "connect", "s1", "--daemon")
    assert r.returncode == 0 and "runs as pid" in r.stdout, r.stderr
    try:
        lst = json.loads(run(env_home, "kvcache", "list", "--json").stdout)
        assert {x["store"]: x["running"] for x in lst} == {"s1": ["local"], "s2": []}
        assert "s1" in run(env_home, "kvcache", "list").stdout
        r = run(env_home, "kvcache", "connect", "s1", "--daemon")
        assert r.returncode == 4 and "already runs" in r.stderr
        show = json.loads(run(env_home, "kvcache", "show", "s1", "--json").stdout)
        assert show["devices"][0]["belongs"] is True and show["servers"][0]["running_pid"]
        assert show["devices"][0]["areas"] == [{"server": "local", "slots": 225, "denied": False}]
        out = run(env_home, "kvcache", "show", "s1").stdout
        assert "server local: running" in out
        w = run(env_home, "kvcache", "status", "s1", "--watch", "--interval", "0.1", "--count", "3")
        assert w.returncode == 0 and w.stdout.count("server local: running") == 3
        assert (env_home / "run" / "s1" / "local.log").exists()
        with KVCacheClient.connect("s1") as c:
            assert c.put([b"x"], [bytes(c.page_size)], wait=True).stored == 1
    finally:
        d = run(env_home, "kvcache", "disconnect", "s1")
    assert d.returncode == 0 and "stopped" in d.stdout
    r = run(env_home, "kvcache", "disconnect", "s1")
    assert r.returncode == 3 and "no service" in r.stderr
    assert run(env_home, "kvcache", "show", "nope").returncode == 3
    # a device that now belongs to another store shows up as such
    assert main(["kvcache", "create", "s3", "--device", str(env_home / "s2.img"), "--page-size", "64KiB",
                 "--server", "local", "--force"]) == 0
    out = run(env_home, "kvcache", "show", "s2").stdout
    assert "ANOTHER store" in out


def test_create_with_area_size_or_spares(env_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.storage.device import read_superblock

    dev = str(env_home / "a.img")
    # 64 MiB with 64 KiB pages (68 KiB slots): 12 MiB areas hold 180 slots, 5 such areas fit
    assert main(["kvcache", "create", "a", "--device", dev, "--device-size", "64MiB", "--page-size", "64KiB",
                 "--server", "x=127.0.0.1:7000", "--server", "y=127.0.0.1:7002", "--area-size", "12MiB"]) == 0
    assert "3 spare for 'allow'" in capsys.readouterr().out
    sb = read_superblock(dev)
    assert [(x.server, x.slot_count) for x in sb.areas] == [("x", 180), ("y", 180)] + [("", 180)] * 3
    assert main(["kvcache", "create", "b", "--device", str(env_home / "b.img"), "--device-size", "16MiB",
                 "--page-size", "64KiB", "--server", "x", "--spare", "2"]) == 0
    assert [x.server for x in read_superblock(str(env_home / "b.img")).areas] == ["x", "", ""]
    out = json.loads(run(env_home, "kvcache", "show", "b", "--json").stdout)
    assert [x["server"] for x in out["devices"][0]["areas"]] == ["x", None, None]
    # refusals: an area too small for one slot, too large for the servers, too many spares, both options
    for extra, msg in [(["--area-size", "32KiB"], "holds no slot"), (["--area-size", "40MiB"], "need one each"),
                       (["--spare", "99"], "--spare must be"), (["--area-size", "lots"], "is not a size")]:
        assert main(["kvcache", "create", "c", "--device", str(env_home / "c.img"), "--device-size", "64MiB",
                     "--page-size", "64KiB", "--server", "x=127.0.0.1:7000", "--server", "y=127.0.0.1:7002",
                     *extra]) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["kvcache", "create", "c", "--device", "d", "--page-size", "64KiB", "--server", "x",
              "--spare", "1", "--area-size", "1MiB"])
    assert e.value.code == 2


def test_allow_and_deny_without_running_services(env_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kvcache", "create", "s", "--device", str(env_home / "s.img"), "--device-size", "16MiB",
                 "--page-size", "64KiB", "--server", "x=127.0.0.1:7000", "--spare", "1"]) == 0
    assert main(["kvcache", "allow", "s", "y=127.0.0.1:7002", "--metrics", "127.0.0.1:9100"]) == 0
    out = capsys.readouterr().out
    assert "allowed server y on store s: area 1" in out and "next, on y: mass-ctl kvcache connect s --device" in out
    assert "its keypair was made here" in out  # no --key: the administrator's machine made it
    assert main(["kvcache", "deny", "s", "x"]) == 0
    assert "denied server x" in capsys.readouterr().out
    lst = json.loads(run(env_home, "kvcache", "list", "--json").stdout)
    assert lst[0]["servers"] == ["x", "y"] and lst[0]["denied"] == ["x"]
    assert "x (denied)" in run(env_home, "kvcache", "list").stdout
    assert "DENIED" in run(env_home, "kvcache", "show", "s").stdout
    # invalidate: a tenant's key space (and what a bad call gets)
    assert main(["kvcache", "invalidate", "s", "--tenant", "t1", "--tenant", ""]) == 0
    out = capsys.readouterr().out
    assert "invalidated the pages of key space(s) :default, t1 on store s: key epoch 0, namespace epochs " \
        ":default=1, t1=1" in out
    assert load_store("s").epochs == {":default": 1, "t1": 1} and load_store("s").key_epoch == 0
    assert main(["kvcache", "invalidate", "s", "--tenant", "Bad Name"]) == 2
    assert "tenant name" in capsys.readouterr().err
    assert main(["kvcache", "invalidate", "s", "--all", "--tenant", "t1"]) == 2
    # the single allowed server is picked by connect; the denied one is refused
    r = run(env_home, "kvcache", "connect", "s", "--server", "x")
    assert r.returncode == 4 and "was denied" in r.stderr
    # only where the administrator key is: another machine's allow is refused, and changes nothing
    sign = env_home / "keys" / "s" / "admin.sign"
    sign.rename(sign.with_suffix(".away"))
    assert main(["kvcache", "allow", "s", "z=127.0.0.1:7004"]) == 4
    assert "no administrator key" in capsys.readouterr().err
    assert main(["kvcache", "invalidate", "s", "--all"]) == 4
    assert "no administrator key" in capsys.readouterr().err
    # a key that is not the one the store trusts is refused too
    from kvstore.storage.membership import AdminKey

    AdminKey.generate().save(sign)
    assert main(["kvcache", "allow", "s", "x"]) == 4
    assert "is not the one store 's' trusts" in capsys.readouterr().err
    assert [(s.name, s.denied) for s in load_store("s").servers] == [("x", True), ("y", False)]


def test_connect_refuses_mismatched_devices_and_unknown_stores(env_home: Path) -> None:
    assert create(env_home, "s1") == 0
    # the device was reformatted for another store since: connect says so and starts nothing
    assert main(["kvcache", "create", "s2", "--device", str(env_home / "s1.img"), "--page-size", "64KiB",
                 "--server", "local", "--force"]) == 0
    r = run(env_home, "kvcache", "connect", "s1")
    assert r.returncode == 4 and "belongs to store 's2'" in r.stderr
    assert not (env_home / "run" / "s1" / "local.pid").exists()
    r = run(env_home, "kvcache", "connect", "s1", "--daemon")  # refused before anything is started
    assert r.returncode == 4 and "belongs to store 's2'" in r.stderr
    # a device that went missing
    assert create(env_home, "s3") == 0
    os.unlink(env_home / "s3.img")
    r = run(env_home, "kvcache", "connect", "s3")
    assert r.returncode == 4 and "does not exist" in r.stderr
    # list reports the broken store on its own line and goes on with the others
    r = run(env_home, "kvcache", "list")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("s3 ") and "error:" in ln and "does not exist" in ln for ln in lines), r.stdout
    assert any(ln.startswith("s2 ") and "64.0 KiB" in ln for ln in lines), r.stdout
    # piped into a reader that goes away: no traceback
    p = subprocess.Popen(f"{sys.executable} -m kvstore.cli kvcache status s2 --watch --interval 0.001 --count 100000 "
                         "| head -1", shell=True, env=dict(os.environ, MASS_HOME=str(env_home)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert out.startswith("store s2") and "Traceback" not in err and "BrokenPipe" not in err, err
    for sub in (["dashboard", "nope"], ["disconnect", "nope"], ["allow", "nope", "x"], ["deny", "nope", "x"],
                ["repair", "nope"], ["invalidate", "nope", "--all"], ["show", "nope"], ["status", "nope", "--watch", "--count", "1"]):
        r = run(env_home, "kvcache", *sub)
        assert r.returncode == 3 and "store 'nope' not found" in r.stderr, sub
    # every subcommand explains itself
    for sub in ("create", "connect", "allow", "deny", "invalidate", "repair", "keygen", "status", "dashboard", "list", "show",
                "disconnect", "quickstart"):
        r = run(env_home, "kvcache", sub, "--help")
        assert r.returncode == 0 and "usage: mass-ctl kvcache " + sub in r.stdout, sub


def test_allow_into_a_single_server_store_needs_its_sync_address(env_home: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kvcache", "create", "one", "--device", str(env_home / "o.img"), "--device-size", "16MiB",
                 "--page-size", "64KiB", "--server", "x", "--spare", "1"]) == 0
    capsys.readouterr()
    assert main(["kvcache", "allow", "one", "y=127.0.0.1:7002"]) == 2
    err = capsys.readouterr().err
    assert "server x needs a sync address" in err and "allow one x=HOST:PORT --update" in err
    assert [s.name for s in load_store("one").servers] == ["x"]
    assert main(["kvcache", "allow", "one", "x=127.0.0.1:7000"]) == 4
    assert "--update changes its sync address" in capsys.readouterr().err
    assert main(["kvcache", "allow", "one", "x=127.0.0.1:7000", "--update"]) == 0
    assert main(["kvcache", "allow", "one", "y=127.0.0.1:7002"]) == 0
    assert [(s.name, s.sync) for s in load_store("one").servers] == [("x", "127.0.0.1:7000"), ("y", "127.0.0.1:7002")]


def test_a_checkout_in_the_current_directory_is_not_imported_by_children(env_home: Path, tmp_path: Path) -> None:
    """A service started from inside a source checkout (no compiled I/O extension there) runs the
    installed package in its children; started with 'python -m' from there, it says why it cannot."""
    import shutil

    import kvstore

    checkout = tmp_path / "checkout"
    shutil.copytree(Path(kvstore.__file__).parent, checkout / "kvstore",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert create(env_home, "s1") == 0
    mass_ctl = Path(sys.executable).parent / "mass-ctl"
    assert mass_ctl.exists(), "the test runs in the project's environment, where mass-ctl is installed"
    env = dict(os.environ, MASS_HOME=str(env_home))
    r = subprocess.run([str(mass_ctl), "kvcache", "connect", "s1", "--daemon"], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr  # before: the daemon imported ./kvstore and died
    try:
        with KVCacheClient.connect("s1", home=env_home) as c:  # the I/O workers run: a page goes through
            assert c.put([b"x"], [b"y" * c.page_size], wait=True).stored == 1
            with c.get([b"x"]) as got:
                assert got[0] is not None and bytes(got[0]) == b"y" * c.page_size
        assert "ModuleNotFoundError" not in (env_home / "run" / "s1" / "local.log").read_text()
    finally:
        d = subprocess.run([str(mass_ctl), "kvcache", "disconnect", "s1"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert d.returncode == 0, d.stderr
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", "connect", "s1"], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "whose compiled I/O extension (kvstore._native._lib) is not built" in r.stderr


def test_daemon_reports_a_service_that_did_not_come_up_with_its_reason(env_home: Path) -> None:
    """--daemon succeeds only once the service answers a client; a service that stops during its
    start (here: its metrics port is held) is a failure with the service's own error line."""
    import socket

    from kvstore.testing import free_port_pair

    assert create(env_home, "s1") == 0
    port = free_port_pair()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        r = run(env_home, "kvcache", "connect", "s1", "--daemon", "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"the service exited with code 1: server local: metrics address 127.0.0.1:{port} cannot be bound" \
        in r.stderr
    assert not (env_home / "run" / "s1" / "local.pid").exists()
    r = run(env_home, "kvcache", "connect", "s1", "--daemon", "--metrics", "")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "runs as pid" in r.stdout
    assert run(env_home, "kvcache", "disconnect", "s1").returncode == 0
