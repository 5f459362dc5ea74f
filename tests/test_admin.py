"""Naming servers with their own public keys: parsing, create/allow with keys, keygen."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.utils.z85
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.admin import ServerSpec
from kvstore.cli import main
from kvstore.storage.device import read_superblock


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 65534), st.sampled_from(["127.0.0.1", "gpu-07.cluster", "[fd00::7]"]))
def test_spec_with_a_key_round_trips_whatever_characters_the_key_has(port: int, host: str) -> None:
    pub = zmq.curve_keypair()[0].decode()  # Z85: may contain ':' and '='
    s = ServerSpec.parse(f"gpu7={host}:{port}:{pub}")
    assert (s.name, s.sync, s.public_key) == ("gpu7", f"{host}:{port}", pub)
    assert ServerSpec.parse(f"gpu7=:{pub}") == ServerSpec("gpu7", "", pub)
    assert ServerSpec.parse(f"gpu7={host}:{port}", key=pub) == s


def test_bad_specs_are_refused_with_what_is_wrong() -> None:
    pub = zmq.curve_keypair()[0].decode()
    for spec, msg in [("gpu7=127.0.0.1:7000:short", "expected NAME=HOST:PORT"),
                      ("gpu7=127.0.0.1:99999", "is not HOST:PORT"),
                      ("Bad=127.0.0.1:7000", "server name"),
                      (f"gpu7=127.0.0.1:7000:{'~' * 40}", "is not a CurveZMQ public key")]:
        with pytest.raises(ValueError, match=msg):
            ServerSpec.parse(spec)
    with pytest.raises(ValueError, match="two different public keys"):
        ServerSpec.parse(f"gpu7=127.0.0.1:7000:{pub}", key=zmq.curve_keypair()[0].decode())


def test_create_with_servers_own_keys_makes_no_keypair(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MASS_HOME", str(home))
    pa, pb = zmq.curve_keypair()[0].decode(), zmq.curve_keypair()[0].decode()
    dev = str(home / "d.img")
    assert main(["kvcache", "create", "s", "--device", dev, "--device-size", "16MiB", "--page-size", "64KiB",
                 "--server", f"a=127.0.0.1:7000:{pa}", "--server", f"b=127.0.0.1:7002:{pb}"]) == 0
    out = capsys.readouterr().out
    assert "keypairs made here" not in out
    assert not (home / "keys" / "s" / "a.key").exists() and not (home / "keys" / "s" / "b.key").exists()
    sb = read_superblock(dev)
    assert [(x.server, x.sync, x.public_key) for x in sb.areas] == [
        ("a", "127.0.0.1:7000", zmq.utils.z85.decode(pa.encode())),
        ("b", "127.0.0.1:7002", zmq.utils.z85.decode(pb.encode()))]
    # keygen: made once, shown again, replaced only with --force
    assert main(["kvcache", "keygen", "s", "--server", "a"]) == 0
    first = capsys.readouterr().out
    assert main(["kvcache", "keygen", "s", "--server", "a"]) == 0
    again = capsys.readouterr().out
    key = first.split("public key: ")[1].split()[0]
    assert "already exists" in again and f"public key: {key}" in again
    assert f"allow s a=HOST:PORT --key='{key}'" in first
    assert main(["kvcache", "keygen", "s", "--server", "a", "--force"]) == 0
    assert key not in capsys.readouterr().out


def test_a_key_that_begins_with_a_dash_is_allowed_as_keygen_prints_it(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Z85 keys may begin with '-' (about 1 in 85): 'allow ... --key KEY' then fails in argparse, so keygen
    prints '--key=KEY', and that form is accepted whatever the key begins with."""
    monkeypatch.setenv("MASS_HOME", str(home))
    raw = (63 * 85 ** 4).to_bytes(4, "big") + bytes(range(28))  # the first Z85 digit is the 63rd: '-'
    key = zmq.utils.z85.encode(raw).decode()
    assert key.startswith("-")
    dev = str(home / "d.img")
    assert main(["kvcache", "create", "s", "--device", dev, "--device-size", "16MiB", "--page-size", "64KiB",
                 "--server", "a=127.0.0.1:7000", "--spare", "1"]) == 0
    with pytest.raises(SystemExit):  # the form that fails, for the record
        main(["kvcache", "allow", "s", "b=127.0.0.1:7002", "--key", key])
    capsys.readouterr()
    assert main(["kvcache", "allow", "s", "b=127.0.0.1:7002", f"--key={key}"]) == 0
    assert [(x.server, x.public_key) for x in read_superblock(dev).areas if x.server == "b"] == [("b", raw)]


def test_create_refuses_more_slots_than_the_key_index_holds_before_formatting(
        home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The limit is 2^31 slots (u32 gids in the key index); a real device that large does not fit
    here, so the test lowers the limit: what is checked is that create refuses with the limit
    named, and formats nothing."""
    import kvstore.shm.index

    monkeypatch.setenv("MASS_HOME", str(home))
    monkeypatch.setattr(kvstore.shm.index, "MAX_SLOTS", 100)
    dev = home / "d.img"
    assert main(["kvcache", "create", "s", "--device", str(dev), "--device-size", "16MiB", "--page-size", "64KiB",
                 "--server", "a=127.0.0.1:7000"]) != 0
    err = capsys.readouterr().err
    assert "a store holds at most 100" in err and "use larger pages" in err
    assert not dev.exists()  # the file the refused create made is gone again
    with open(dev, "wb") as f:  # a device that was there stays, unwritten
        f.truncate(16 << 20)
    assert main(["kvcache", "create", "s", "--device", str(dev), "--page-size", "64KiB",
                 "--server", "a=127.0.0.1:7000"]) != 0
    assert dev.read_bytes().count(0) == dev.stat().st_size
    with pytest.raises(ValueError, match="exceed the key index's limit"):
        kvstore.shm.index.index_capacity(101)


def test_collisions_are_refused_naming_both_parties(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two servers on one port of one host (PORT+1 of a sync or events address included), or one
    public key for two servers, are refused at create and allow; nothing is written. A sync port in
    the kernel's ephemeral range is allowed with a warning."""
    from kvstore.config import load_store

    monkeypatch.setenv("MASS_HOME", str(home))
    pa, pb = zmq.curve_keypair()[0].decode(), zmq.curve_keypair()[0].decode()
    dev = str(home / "d.img")
    base = ["kvcache", "create", "s", "--device", dev, "--device-size", "16MiB", "--page-size", "64KiB"]
    for servers, extra, msg in [
            ([f"a=127.0.0.1:7000:{pa}", f"b=127.0.0.1:7000:{pb}"], [], "server b's sync address 127.0.0.1:7000 "
             "takes port 7000 of 127.0.0.1, which server a's sync address 127.0.0.1:7000 takes too"),
            ([f"a=127.0.0.1:7000:{pa}", f"b=127.0.0.1:7001:{pb}"], [], "which server a's sync address "
             "127.0.0.1:7000 (PORT+1) takes too"),
            ([f"a=localhost:7000:{pa}", f"b=127.0.0.1:7001:{pb}"], [], "takes port 7001 of 127.0.0.1"),
            ([f"a=127.000.0.1:7000:{pa}", f"b=127.0.0.1:7000:{pb}"], [], "takes port 7000 of 127.0.0.1"),
            ([f"a=127.0.0.1:7000:{pa}", f"b=127.0.0.1:7002:{pa}"], [], "server b's public key is server a's too"),
            ([f"a=127.0.0.1:7000:{pa}", f"b=127.0.0.1:7002:{pb}"], ["--events", "b=127.0.0.1:6999"],
             "server b's events address 127.0.0.1:6999 (PORT+1) takes port 7000")]:
        assert main(base + [x for s in servers for x in ("--server", s)] + extra) == 2
        assert msg in capsys.readouterr().err
        assert not (home / "stores" / "s.toml").exists()
    # other hosts may use the same ports
    assert main(base + ["--server", f"a=10.0.0.1:7000:{pa}", "--server", f"b=10.0.0.2:7000:{pb}", "--spare",
                        "4"]) == 0
    capsys.readouterr()
    pc = zmq.curve_keypair()[0].decode()
    for spec, key, msg in [("c=10.0.0.1:7001", pc, "server c's sync address 10.0.0.1:7001 takes port 7001 of "
                            "10.0.0.1, which server a's sync address 10.0.0.1:7000 (PORT+1) takes too"),
                           ("c=10.0.0.3:7000", pa, "server c's public key is server a's too")]:
        assert main(["kvcache", "allow", "s", spec, f"--key={key}"]) == 2
        assert msg in capsys.readouterr().err
    assert main(["kvcache", "allow", "s", "a=10.0.0.2:6999", "--update"]) == 2  # its own update, onto b's port
    assert "takes port 7000 of 10.0.0.2, which server b's" in capsys.readouterr().err
    assert [x.name for x in load_store("s", home).servers] == ["a", "b"]
    # a wildcard metrics address is on its own server's machine: two machines may use the same one,
    # but nothing else on that machine may take its port
    pd, pe, pf = (zmq.curve_keypair()[0].decode() for _ in range(3))
    assert main(["kvcache", "allow", "s", "d=10.0.0.4:7000", f"--key={pd}", "--metrics", "0.0.0.0:9400"]) == 0
    assert main(["kvcache", "allow", "s", "e=10.0.0.5:7000", f"--key={pe}", "--metrics", "0.0.0.0:9400"]) == 0
    capsys.readouterr()
    assert main(["kvcache", "allow", "s", "f=10.0.0.4:9399", f"--key={pf}"]) == 2
    assert "takes port 9400 of 10.0.0.4, which server d's metrics address 0.0.0.0:9400 takes too" in \
        capsys.readouterr().err
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert main(["kvcache", "allow", "s", f"c=10.0.0.3:{lo + 10}", f"--key={pc}"]) == 0
    assert f"server c's sync address 10.0.0.3:{lo + 10}: port {lo + 10} lies in this machine's ephemeral " \
           "range" in capsys.readouterr().err


def test_create_mistakes_name_the_item(home: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MASS_HOME", str(home))
    home.mkdir(parents=True, exist_ok=True)
    dev = str(home / "d.img")
    base = ["kvcache", "create", "s", "--page-size", "64KiB"]
    for args, msg in [
            (["--device", dev, "--device", dev, "--device-size", "16MiB", "--server", "a"],
             f"device {dev} is given twice"),
            (["--device", dev, "--device-size", "16MiB", "--server", "a=127.0.0.1:7000", "--server",
              "a=127.0.0.1:7002"], "server name(s) a listed twice"),
            (["--device", dev, "--device-size", "1MiB", "--server", "a"],
             f"{dev}: device of 1048576 bytes is too small"),
            (["--device", str(home), "--server", "a"], f"device {home} is a directory"),
            (["--device", "/dev/null", "--server", "a"],
             "device /dev/null is neither a block device nor a regular file")]:
        assert main(base + args) in (2, 4), args
        assert msg in capsys.readouterr().err, args
        assert not Path(dev).exists()  # nothing left behind
    assert not (home / "stores" / "s.toml").exists()
