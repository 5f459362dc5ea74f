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
