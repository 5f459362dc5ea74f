from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import CorruptPage, DeviceMismatch
from kvstore.storage.device import format_device, read_superblock, set_area, verify_device, write_superblock
from kvstore.storage.superblock import (AREA_DENIED, DATA_OFFSET, MAX_AREAS, Area, Superblock, areas_that_fit,
                                        plan_areas)

U = uuid.uuid4().bytes


def sb(**kw: object) -> Superblock:
    base = dict(store_uuid=U, store_name="s", generation=3, page_size=1 << 16, device_size=64 << 20,
                device_index=0, device_count=1, areas=plan_areas(64 << 20, 1 << 16, ["a", "b"]))
    base.update(kw)
    return Superblock(**base)  # type: ignore[arg-type]


def test_roundtrip() -> None:
    s = sb()
    assert Superblock.decode(s.encode()) == s
    assert len(s.encode()) == 4096


@given(st.integers(0, 4095), st.integers(1, 255))
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


def test_torn_copy_falls_back_to_other(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "d"
    p.write_bytes(b"")
    with open(p, "r+b") as f:
        f.truncate(64 << 20)
    s1 = format_device(str(p), store_uuid=U, store_name="s", page_size=1 << 16, device_index=0,
                       device_count=1, servers=["a"])
    s2 = Superblock(**{**s1.__dict__, "generation": s1.generation + 1})
    write_superblock(str(p), s2)
    # tear copy A (as if the rewrite died half way): the reader takes copy B
    with open(p, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 50)
    assert read_superblock(str(p)) == s2
    # tear copy B too: no valid superblock is left
    with open(p, "r+b") as f:
        f.seek(4096 + 100)
        f.write(b"\xff" * 50)
    with pytest.raises(DeviceMismatch, match="not formatted"):
        read_superblock(str(p))


def test_format_refuses_other_store_without_force(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "d"
    with open(p, "wb") as f:
        f.truncate(16 << 20)
    kw = dict(page_size=1 << 16, device_index=0, device_count=1, servers=["a"])
    format_device(str(p), store_uuid=U, store_name="first", **kw)  # type: ignore[arg-type]
    other = uuid.uuid4().bytes
    with pytest.raises(DeviceMismatch, match="already belongs to store 'first'.*--force"):
        format_device(str(p), store_uuid=other, store_name="second", **kw)  # type: ignore[arg-type]
    assert read_superblock(str(p)).store_uuid == U  # nothing was lost
    s = format_device(str(p), store_uuid=other, store_name="second", force=True, **kw)  # type: ignore[arg-type]
    assert s.generation == 2 and read_superblock(str(p)).store_uuid == other


def test_verify_reports_what_differs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "d"
    with open(p, "wb") as f:
        f.truncate(16 << 20)
    format_device(str(p), store_uuid=U, store_name="s", page_size=1 << 16, device_index=0, device_count=2,
                  servers=["a"])
    good = dict(store_uuid=U, page_size=1 << 16, device_index=0, device_count=2, servers=["a"])
    verify_device(str(p), **good)  # type: ignore[arg-type]
    for bad, msg in [({"store_uuid": uuid.uuid4().bytes}, "belongs to store"),
                     ({"device_index": 1}, "out of order"),
                     ({"page_size": 1 << 17}, "page size"),
                     ({"servers": ["a", "b"]}, "areas")]:
        with pytest.raises(DeviceMismatch, match=msg):
            verify_device(str(p), **{**good, **bad})  # type: ignore[arg-type]
    with pytest.raises(DeviceMismatch, match="does not exist"):
        verify_device(str(tmp_path / "nope"), **good)  # type: ignore[arg-type]


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


def test_set_area_names_a_spare_and_flags_a_denied_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "d"
    with open(p, "wb") as f:
        f.truncate(16 << 20)
    s0 = format_device(str(p), store_uuid=U, store_name="s", page_size=1 << 16, device_index=0, device_count=1,
                       servers=["a"], areas=2)
    good = dict(store_uuid=U, page_size=1 << 16, device_index=0, device_count=1)
    verify_device(str(p), servers=["a"], **good)  # type: ignore[arg-type]
    s1 = set_area(str(p), store_uuid=U, index=1, server="b", denied=False)
    assert s1.generation == s0.generation + 1 and s1.areas[1].server == "b"
    assert s1.areas[1].offset == s0.areas[1].offset and s1.areas[1].slot_count == s0.areas[1].slot_count
    verify_device(str(p), servers=["a", "b"], **good)  # type: ignore[arg-type]
    set_area(str(p), store_uuid=U, index=1, server="b", denied=True)
    assert read_superblock(str(p)).areas[1].denied
    with pytest.raises(DeviceMismatch, match="denied"):
        verify_device(str(p), servers=["a", "b"], **good)  # type: ignore[arg-type]
    verify_device(str(p), servers=["a", "b"], denied=["b"], **good)  # type: ignore[arg-type]
    with pytest.raises(DeviceMismatch, match="no area 2"):
        set_area(str(p), store_uuid=U, index=2, server="c", denied=False)
    with pytest.raises(DeviceMismatch, match="not this one"):
        set_area(str(p), store_uuid=uuid.uuid4().bytes, index=1, server="c", denied=False)
