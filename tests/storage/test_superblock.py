from __future__ import annotations

import dataclasses
import struct
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import CorruptPage, DeviceMismatch
from kvstore.storage.device import format_device, read_superblock, write_superblock
from kvstore.storage.membership import AdminKey
from kvstore.storage.superblock import (AREA_DENIED, COPY_OFFSETS, DATA_OFFSET, MAGIC, MAX_AREAS, SUPERBLOCK_SIZE,
                                        Area, Superblock, areas_that_fit, plan_areas)

U = uuid.uuid4().bytes
ADMIN = AdminKey.generate()


def sb(**kw: object) -> Superblock:
    base = dict(store_uuid=U, store_name="s", generation=3, page_size=1 << 16, device_size=64 << 20,
                device_index=0, device_count=1, areas=plan_areas(64 << 20, 1 << 16, ["a", "b"]))
    base.update(kw)
    return Superblock(**base)  # type: ignore[arg-type]


def test_roundtrip() -> None:
    s = sb()
    assert Superblock.decode(s.encode()) == s
    assert len(s.encode()) == SUPERBLOCK_SIZE == 8192


@given(st.integers(0, SUPERBLOCK_SIZE - 1), st.integers(1, 255))
def test_any_flipped_byte_is_detected(pos: int, flip: int) -> None:
    data = bytearray(sb().encode())
    data[pos] ^= flip
    with pytest.raises(CorruptPage):
        Superblock.decode(bytes(data))


def test_plan_areas_split_equally_after_reserved_mib() -> None:
    areas = plan_areas(DATA_OFFSET + 10 * (4096 + 8192), 8192, ["a", "b", "c"])
    assert [a.slot_count for a in areas] == [3, 3, 3]
    assert areas[0].offset == DATA_OFFSET
    assert areas[1].offset == DATA_OFFSET + 3 * (4096 + 8192)


def test_too_small_device_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        plan_areas(DATA_OFFSET + 4096, 8192, ["a"])


def test_too_many_areas() -> None:
    with pytest.raises(ValueError, match="at most"):
        sb(areas=tuple(Area(f"s{i}", DATA_OFFSET, 0) for i in range(MAX_AREAS + 1))).encode()


def fmt(p: Path, **kw: object) -> Superblock:
    base: dict[str, object] = dict(store_uuid=U, store_name="s", page_size=1 << 16, device_index=0, device_count=1,
                                   servers=[Area("a", 0, 0)], salt=bytes(32), sign=ADMIN.sign)
    base.update(kw)
    return format_device(str(p), **base)  # type: ignore[arg-type]


def blank(tmp_path: Path, size: int = 64 << 20) -> Path:
    p = tmp_path / "d"
    with open(p, "wb") as f:
        f.truncate(size)
    return p


def test_torn_copy_falls_back_to_other(tmp_path: Path) -> None:
    p = blank(tmp_path)
    s1 = fmt(p)
    s2 = ADMIN.sign(dataclasses.replace(s1, generation=s1.generation + 1))
    write_superblock(str(p), s2)
    # tear copy A (as if the rewrite died half way): the reader takes copy B
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 50)
    assert read_superblock(str(p)) == s2
    # tear copy B too: no valid superblock is left
    with open(p, "r+b") as f:
        f.seek(COPY_OFFSETS[1] + 100)
        f.write(b"\xff" * 50)
    with pytest.raises(DeviceMismatch, match="not formatted"):
        read_superblock(str(p))


def test_format_refuses_other_store_without_force(tmp_path: Path) -> None:
    p = blank(tmp_path, 16 << 20)
    fmt(p, store_name="first")
    other = uuid.uuid4().bytes
    with pytest.raises(DeviceMismatch, match="already belongs to store 'first'.*--force"):
        fmt(p, store_uuid=other, store_name="second")
    assert read_superblock(str(p)).store_uuid == U  # nothing was lost
    s = fmt(p, store_uuid=other, store_name="second", force=True)
    assert s.generation == 2 and read_superblock(str(p)).store_uuid == other


def test_version_1_superblock_is_refused_with_what_to_do(tmp_path: Path) -> None:
    p = blank(tmp_path, 16 << 20)
    v1 = bytearray(4096)  # a version-1 superblock: same magic, version 1, 4 KiB
    struct.pack_into("<8sI", v1, 0, MAGIC, 1)
    with open(p, "r+b") as f:
        f.write(v1)
    with pytest.raises(DeviceMismatch, match="format version 1.*re-create the store"):
        read_superblock(str(p))
    with pytest.raises(DeviceMismatch, match="another format version.*--force"):
        fmt(p)
    assert fmt(p, force=True).store_uuid == U


def test_spare_areas_and_fixed_area_size() -> None:
    slot = 4096 + 8192
    areas = plan_areas(DATA_OFFSET + 12 * slot, 8192, ["a"], areas=3)
    assert [(x.server, x.slot_count, x.spare) for x in areas] == [("a", 4, False), ("", 4, True), ("", 4, True)]
    fixed = plan_areas(DATA_OFFSET + 12 * slot, 8192, ["a", "b"], areas=2, area_slots=5)
    assert [x.slot_count for x in fixed] == [5, 5] and fixed[1].offset == DATA_OFFSET + 5 * slot
    assert areas_that_fit(DATA_OFFSET + 12 * slot, 8192, 5) == 2
    with pytest.raises(ValueError, match="too small"):
        plan_areas(DATA_OFFSET + 12 * slot, 8192, ["a", "b", "c"], areas=3, area_slots=5)
    with pytest.raises(ValueError, match="cannot hold"):
        plan_areas(DATA_OFFSET + 12 * slot, 8192, ["a", "b"], areas=1)


def test_denied_flag_round_trips_and_unknown_flags_are_corrupt() -> None:
    s = sb(areas=(Area("a", DATA_OFFSET, 4), Area("b", DATA_OFFSET + 4 * (4096 + (1 << 16)), 4, AREA_DENIED)))
    back = Superblock.decode(s.encode())
    assert [a.denied for a in back.areas] == [False, True]
    bad = sb(areas=(Area("a", DATA_OFFSET, 4, 0x80),))
    with pytest.raises(CorruptPage, match="unknown flags"):
        Superblock.decode(bad.encode())


def test_membership_fields_round_trip() -> None:
    pub = bytes(range(32))
    s = sb(areas=(Area("a", DATA_OFFSET, 4, 0, pub, "10.0.0.1:7000", 5),
                  Area("", DATA_OFFSET + 4 * (4096 + (1 << 16)), 4)), membership_gen=5, salt=b"s" * 32,
           admin_key=b"k" * 32, signature=b"g" * 64)
    back = Superblock.decode(s.encode())
    assert back == s and back.areas[0].public_key == pub and back.areas[0].sync == "10.0.0.1:7000"
    assert back.areas[1].public_key == b"" and back.areas[1].spare
    with pytest.raises(ValueError, match="longer than 64 bytes"):
        sb(areas=(Area("a", DATA_OFFSET, 4, 0, pub, "h" * 60 + ":7000"),)).encode()


def test_key_epochs_round_trip_in_a_version_3_superblock_and_version_2_stays_without() -> None:
    from kvstore.storage.superblock import SUPERBLOCK_VERSION, SUPERBLOCK_VERSION_EPOCHS

    plain = sb().encode()
    assert struct.unpack_from("<I", plain, 8)[0] == SUPERBLOCK_VERSION
    s = sb(key_epoch=2, epochs=(("team-a", 1), (":default", 3)))
    data = s.encode()
    assert struct.unpack_from("<I", data, 8)[0] == SUPERBLOCK_VERSION_EPOCHS
    assert Superblock.decode(data) == s
    # the epochs are under the checksum and the signature like every other field
    signed = ADMIN.sign(s)
    assert signed.signed_bytes() != ADMIN.sign(dataclasses.replace(s, key_epoch=3)).signed_bytes()


def test_epochs_in_a_version_2_block_or_half_empty_entries_are_corrupt() -> None:
    import xxhash

    from kvstore.storage.superblock import CHECKSUM_OFFSET, EPOCH_TABLE_OFFSET

    def resum(buf: bytearray) -> bytes:
        struct.pack_into("<Q", buf, CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(bytes(buf[:CHECKSUM_OFFSET])))
        return bytes(buf)

    v2 = bytearray(sb().encode())
    struct.pack_into("<Q", v2, 120, 1)  # a key epoch an older writer could not have set
    with pytest.raises(CorruptPage, match="version 2"):
        Superblock.decode(resum(v2))
    v3 = bytearray(sb(key_epoch=1).encode())
    struct.pack_into("<32sQ", v3, EPOCH_TABLE_OFFSET, b"team-a", 0)
    with pytest.raises(CorruptPage, match="half empty"):
        Superblock.decode(resum(v3))
    with pytest.raises(ValueError, match="at most 6"):
        sb(epochs=tuple((f"t{i}", 1) for i in range(7))).encode()


def test_bump_epochs_never_gives_a_key_space_a_pair_it_had() -> None:
    from kvstore.storage.superblock import EPOCH_SLOTS, bump_epochs

    seen: dict[str, set[tuple[int, int]]] = {}
    key_epoch, table = 0, ()
    names = [f"t{i}" for i in range(EPOCH_SLOTS + 3)]

    def note() -> None:
        for n in names:
            pair = (key_epoch, dict(table).get(n, 0))
            if pair not in seen.setdefault(n, {pair}):
                assert False, f"{n} was given {pair} again"
            seen[n].add(pair)

    note()
    steps = [["t0"], ["t0"], ["t1", "t2"], None, ["t0"]] + [[n] for n in names] + [["t3"], None, ["t4"]]
    everyone_seen = False
    for step in steps:
        before = {n: (key_epoch, dict(table).get(n, 0)) for n in names}
        key_epoch, table, everyone = bump_epochs(key_epoch, table, step)
        assert len(table) <= EPOCH_SLOTS
        everyone_seen |= everyone and step is not None  # the table overflowed
        moved = {n for n in names if (key_epoch, dict(table).get(n, 0)) != before[n]}
        assert moved == set(names) if everyone else moved == set(step or ())
        # a pair once left is never taken again
        for n in names:
            pair = (key_epoch, dict(table).get(n, 0))
            assert pair == before[n] or pair not in seen[n]
            seen[n].add(pair)
    assert everyone_seen
