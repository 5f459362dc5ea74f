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
    assert dev.read_bytes().count(0) == dev.stat().st_size  # nothing written
    with pytest.raises(ValueError, match="exceed the key index's limit"):
        kvstore.shm.index.index_capacity(101)
