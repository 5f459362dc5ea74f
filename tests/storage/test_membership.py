"""The membership on the devices: signed, read across devices, torn/forged/replayed copies refused."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest

from kvstore.errors import DeviceMismatch
from kvstore.storage.device import format_device, read_superblock, write_superblock
from kvstore.storage.membership import AdminKey, change_membership, read_membership, signed_by
from kvstore.storage.superblock import AREA_DENIED, COPY_OFFSETS, Area

U = uuid.uuid4().bytes
KEY_A, KEY_B = bytes([1] * 32), bytes([2] * 32)


def store(tmp_path: Path, admin: AdminKey, devices: int = 2) -> list[str]:
    paths = []
    for i in range(devices):
        p = tmp_path / f"d{i}"
        with open(p, "wb") as f:
            f.truncate(16 << 20)
        format_device(str(p), store_uuid=U, store_name="s", page_size=1 << 16, device_index=i, device_count=devices,
                      servers=[Area("a", 0, 0, 0, KEY_A, "127.0.0.1:7000"), Area("b", 0, 0, 0, KEY_B, "127.0.0.1:7002")],
                      salt=b"x" * 32, sign=admin.sign, areas=3)
        paths.append(str(p))
    return paths


def allow_c(areas: list[Area]) -> list[Area]:
    areas[2] = dataclasses.replace(areas[2], server="c", public_key=bytes([3] * 32), sync="127.0.0.1:7004")
    return areas


def test_membership_is_read_from_the_devices_and_changed_on_all(tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    m = read_membership(list(reversed(paths)), store_uuid=U, admin_key=admin.public)
    assert m.paths == tuple(paths) and m.gen == 1 and not m.lagging and not m.refused
    assert [(x.name, x.sync, x.public_key, x.denied) for x in m.members] == [
        ("a", "127.0.0.1:7000", KEY_A, False), ("b", "127.0.0.1:7002", KEY_B, False)]
    m2 = change_membership(paths, store_uuid=U, admin=admin, change=allow_c)
    assert m2.gen == 2 and [x.name for x in m2.members] == ["a", "b", "c"]
    assert all(sb.membership_gen == 2 and sb.areas[2].changed_gen == 2 and sb.areas[0].changed_gen == 1
               for sb in m2.sbs)

    def deny_b(areas: list[Area]) -> list[Area]:
        areas[1] = dataclasses.replace(areas[1], flags=AREA_DENIED, public_key=b"")
        return areas

    m3 = change_membership(paths, store_uuid=U, admin=admin, change=deny_b)
    assert m3.members[1].denied and m3.members[1].public_key == b""
    # no resizing through a membership change
    with pytest.raises(ValueError, match="add, move or resize"):
        change_membership(paths, store_uuid=U, admin=admin,
                          change=lambda a: [dataclasses.replace(a[0], slot_count=1)] + a[1:])


def test_a_change_interrupted_between_devices_is_read_from_the_newest_and_finished_by_the_next(
        tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    old1 = read_superblock(paths[1])
    change_membership(paths, store_uuid=U, admin=admin, change=allow_c)
    write_superblock(paths[1], old1)  # as if the writer died after device 0
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.gen == 2 and m.lagging == (1,) and [x.name for x in m.members] == ["a", "b", "c"]
    m = change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a)
    assert m.gen == 3 and not m.lagging


def test_torn_copy_keeps_the_last_good_membership(tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin, devices=1)
    before = read_superblock(paths[0])
    new = admin.sign(dataclasses.replace(before, generation=before.generation + 1, membership_gen=2,
                                         areas=tuple(allow_c(list(before.areas)))))
    data = new.encode()
    with open(paths[0], "r+b") as f:  # copy A of the new membership written half-way, copy B not at all
        f.seek(COPY_OFFSETS[0])
        f.write(data[:4096])
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.gen == 1 and [x.name for x in m.members] == ["a", "b"]
    assert any("unreadable" in r and "checksum" in r for r in m.refused)


def test_forged_membership_is_refused(tmp_path: Path) -> None:
    admin, mallory = AdminKey.generate(), AdminKey.generate()
    paths = store(tmp_path, admin, devices=1)
    sb = read_superblock(paths[0])
    # a denied server allows itself again: a valid checksum, signed by its own key
    forged = mallory.sign(dataclasses.replace(sb, generation=sb.generation + 1, membership_gen=9,
                                              areas=tuple(allow_c(list(sb.areas)))))
    assert not signed_by(forged, admin.public)
    with open(paths[0], "r+b") as f:
        f.seek(COPY_OFFSETS[0])
        f.write(forged.encode())
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.gen == 1 and [x.name for x in m.members] == ["a", "b"]  # copy B, the real one
    assert any("not signed by the store's administrator key" in r for r in m.refused)
    # the same with the admin key named but the signature not its own (entry edited after signing)
    tampered = dataclasses.replace(admin.sign(dataclasses.replace(sb, generation=sb.generation + 2)),
                                   areas=tuple(allow_c(list(sb.areas))))
    with open(paths[0], "r+b") as f:
        f.seek(COPY_OFFSETS[1])
        f.write(tampered.encode())
    with pytest.raises(DeviceMismatch, match="no superblock copy is signed"):
        read_membership(paths, store_uuid=U, admin_key=admin.public)
    # a machine trusting on first use takes the key the devices name: the forger's here, which is why
    # connect prints it and --admin-key pins it
    assert read_membership(paths, store_uuid=U, admin_key=None).admin_key == mallory.public


def test_replayed_older_membership_is_refused(tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin, devices=1)
    old = read_superblock(paths[0])
    change_membership(paths, store_uuid=U, admin=admin, change=allow_c)
    write_superblock(paths[0], old)  # a validly signed, older superblock written back
    with pytest.raises(DeviceMismatch, match="older than one this machine has seen"):
        read_membership(paths, store_uuid=U, admin_key=admin.public, min_gen=2)


def test_devices_of_another_store_or_missing_ones_are_named(tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    with pytest.raises(DeviceMismatch, match=r"device\(s\) \[1\] not given"):
        read_membership(paths[:1], store_uuid=U, admin_key=admin.public)
    with pytest.raises(DeviceMismatch, match="belongs to store"):
        read_membership(paths, store_uuid=uuid.uuid4().bytes, admin_key=admin.public)
    with pytest.raises(DeviceMismatch, match="like another path"):
        read_membership([paths[0], paths[0]], store_uuid=U, admin_key=admin.public)


def test_the_record_stands_in_for_rolled_back_and_torn_devices_only_where_it_may(tmp_path: Path) -> None:
    from kvstore.storage.membership import SeenRecord

    admin, mallory = AdminKey.generate(), AdminKey.generate()
    paths = store(tmp_path, admin)
    old = [read_superblock(p) for p in paths]
    record = SeenRecord(tmp_path / "s.membership")
    m2 = change_membership(paths, store_uuid=U, admin=admin, change=allow_c)
    record.note(m2)
    assert set(record.load()) == set(paths) and all(sb.membership_gen == 2 for sb in record.load().values())
    for p, sb in zip(paths, old):  # replayed
        write_superblock(p, sb)
    m = read_membership(paths, store_uuid=U, admin_key=admin.public, min_gen=2, seen=record.load())
    assert m.gen == 2 and m.rolled_back == (0, 1) and [x.name for x in m.members] == ["a", "b", "c"]
    assert m.damaged == (0, 1) and any("replayed or restored" in r for r in m.refused)
    # a record signed by another key counts for nothing
    forged = {p: mallory.sign(sb) for p, sb in record.load().items()}
    with pytest.raises(DeviceMismatch, match="older than one this machine has seen"):
        read_membership(paths, store_uuid=U, admin_key=admin.public, min_gen=2, seen=forged)
    # torn: only with torn_ok (the administrator's commands), and only while the blocks name the device
    change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a, seen=record.load())
    with open(paths[1], "r+b") as f:
        for off in COPY_OFFSETS:
            f.seek(off + 300)
            f.write(b"\xff")
    with pytest.raises(DeviceMismatch, match="checksum mismatch.*repair s"):
        read_membership(paths, store_uuid=U, admin_key=admin.public, seen=record.load())
    m = read_membership(paths, store_uuid=U, admin_key=admin.public, seen=record.load(), torn_ok=True)
    assert m.torn == (1,) and [x.name for x in m.members] == ["a", "b", "c"]
    m = change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a, seen=record.load())
    assert not m.damaged and m.gen == 4
    with open(paths[1], "r+b") as f:  # another device at that path
        f.write(bytes(16384))
    with pytest.raises(DeviceMismatch, match="not formatted for kvstore"):
        read_membership(paths, store_uuid=U, admin_key=admin.public, seen=record.load(), torn_ok=True)
    # the store re-created under the same paths (new uuid, key, generation 1): the record follows it
    admin2 = AdminKey.generate()
    U2 = uuid.uuid4().bytes
    for i, p in enumerate(paths):  # new files at the old paths: their generations start again at 1
        os.unlink(p)
        with open(p, "wb") as f:
            f.truncate(16 << 20)
        format_device(p, store_uuid=U2, store_name="s", page_size=1 << 16, device_index=i, device_count=2,
                      servers=[Area("a", 0, 0, 0, KEY_A, "127.0.0.1:7000")], salt=b"y" * 32, sign=admin2.sign,
                      areas=3, force=True)
    record.note(read_membership(paths, store_uuid=U2, admin_key=admin2.public))
    assert all(sb.store_uuid == U2 and sb.admin_key == admin2.public for sb in record.load().values())
    # a record that does not parse is no record
    (tmp_path / "s.membership").write_bytes(b"\x05\x00abc")
    assert record.load() == {}


def test_a_change_written_over_by_another_at_the_same_time_is_an_error(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two administrators' writes interleave device by device: the one whose write did not stick
    on every device says so (before: both reported success and one change was lost)."""
    import kvstore.storage.membership as mod

    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    real = mod.write_superblock
    calls = []

    def interleaved(path: str, sb: object) -> None:
        real(path, sb)  # type: ignore[arg-type]
        calls.append(path)
        if len(calls) == 1:  # the other administrator writes both devices between our two writes
            monkeypatch.setattr(mod, "write_superblock", real)
            change_membership(paths, store_uuid=U, admin=admin,
                              change=lambda a: [dataclasses.replace(a[1], flags=AREA_DENIED, public_key=b"")
                                                if i == 1 else x for i, x in enumerate(a)])
            monkeypatch.setattr(mod, "write_superblock", interleaved)

    monkeypatch.setattr(mod, "write_superblock", interleaved)
    with pytest.raises(DeviceMismatch, match="another membership change was written at the same time"):
        change_membership(paths, store_uuid=U, admin=admin, change=allow_c)


def test_two_tables_at_one_generation_are_a_split_that_a_change_ends(tmp_path: Path) -> None:
    """Two administrators' changes interleaved device by device can leave one generation with two
    area tables; the lowest device's is in force, the other device is flagged, the next change
    writes one table everywhere."""
    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    sbs = [read_superblock(p) for p in paths]
    for p, sb, name in zip(paths, sbs, ("q", "p")):
        areas = list(sb.areas)
        areas[2] = dataclasses.replace(areas[2], server=name, public_key=bytes([5] * 32), sync="127.0.0.1:7006")
        write_superblock(p, admin.sign(dataclasses.replace(sb, generation=sb.generation + 1, membership_gen=2,
                                                           areas=tuple(areas))))
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.split == (1,) and m.damaged == (1,) and [x.name for x in m.members][2] == "q"
    assert any("two changes were written at once" in r for r in m.refused)
    m = change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a)
    assert not m.split and all(sb.areas[2].server == "q" for sb in m.sbs)


def test_key_epochs_survive_membership_changes_and_a_split_on_them_is_found(tmp_path: Path) -> None:
    admin = AdminKey.generate()
    paths = store(tmp_path, admin)
    m = change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a,
                          rekey=lambda e: (e[0], (("team-a", 1),)))
    assert all((sb.key_epoch, sb.epochs) == (0, (("team-a", 1),)) for sb in m.sbs)
    old1 = read_superblock(paths[1])
    m = change_membership(paths, store_uuid=U, admin=admin, change=lambda a: a, rekey=lambda e: (e[0] + 1, ()))
    write_superblock(paths[1], old1)  # the writer died after device 0: device 1 lags with older epochs
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.lagging == (1,) and (m.newest.key_epoch, m.newest.epochs) == (1, ())
    m = change_membership(paths, store_uuid=U, admin=admin, change=allow_c)  # an allow keeps the newest epochs
    assert all((sb.key_epoch, sb.epochs) == (1, ()) for sb in m.sbs) and not m.damaged
    # the same generation with other epochs on one device (two administrators at once) is a split
    other = admin.sign(dataclasses.replace(read_superblock(paths[1]), key_epoch=5))
    write_superblock(paths[1], other)
    m = read_membership(paths, store_uuid=U, admin_key=admin.public)
    assert m.split == (1,) and (m.newest.key_epoch) == 1
