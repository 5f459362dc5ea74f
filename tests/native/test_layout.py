"""Every structure the compiled core shares with Python is declared once, in kvstore/_native/kvstore.h:
the numpy dtypes, the slot header's field list and docs/FORMAT.md must say what it says.

A field changed in the header fails here until the dtypes, ``storage/header.py`` and the
format document agree (the offsets come from the C compiler, through cffi)."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore._native.lib import FFI, LIB
from kvstore.ipc import lease as A
from kvstore.ipc import iorings
from kvstore.ipc.connection import DIRECT_REQ
from kvstore.ipc.iorings import IO_COMPLETION, IO_REQUEST
from kvstore.shm import slots as S
from kvstore.storage import header as H
from kvstore.storage.superblock import FORMAT_VERSION

ROOT = Path(__file__).parents[2]


def c_offset(struct_name: str, field: str) -> int:
    """A dtype field's offset in the C struct (``d0``..``d3`` are the C array ``d``)."""
    m = re.fullmatch(r"d([0-3])", field)
    if m:
        return int(FFI.offsetof(struct_name, "d")) + 8 * int(m.group(1))
    return int(FFI.offsetof(struct_name, field))


@pytest.mark.parametrize("struct_name,dtype", [
    ("struct kv_io_request", IO_REQUEST),
    ("struct kv_direct_request", DIRECT_REQ),
    ("struct kv_completion", IO_COMPLETION),
    ("struct kv_slot", S.SLOT_DTYPE),
])
def test_record_dtypes_are_the_c_structs(struct_name: str, dtype: np.dtype[Any]) -> None:
    assert FFI.sizeof(struct_name) == dtype.itemsize
    assert dtype.fields is not None
    for name, (_dt, off, *_rest) in dtype.fields.items():
        if name == "pad":
            continue
        assert c_offset(struct_name, name) == off, (struct_name, name)


def test_the_slot_header_field_list_is_the_c_struct_and_the_format_document() -> None:
    # the struct format and the scan's dtype derive from the one field list ...
    offs, o = [], 0
    for name, fmt, subs in H.HEADER_FIELDS:
        offs.append((name, o, struct.calcsize("<" + fmt)))
        assert H.HEADER_DTYPE.fields is not None
        assert H.HEADER_DTYPE.fields[subs[0][0]][1] == o, name
        o += struct.calcsize("<" + fmt)
    assert o == H.HEADER_SIZE == FFI.sizeof("struct kv_slot_header") == 128
    # ... which is what the I/O worker writes and validates
    c_fields = dict(FFI.typeof("struct kv_slot_header").fields)
    assert list(c_fields) == [name for name, _o, _s in offs]
    for name, off, size in offs:
        assert c_fields[name].offset == off and FFI.sizeof(c_fields[name].type) == size, name
    assert H.FIELDS_SIZE == LIB.KV_FIELDS_SIZE == FFI.offsetof("struct kv_slot_header", "hcsum")
    assert H.HEADER_BLOCK == LIB.KV_HEADER_BLOCK and FORMAT_VERSION == LIB.KV_FORMAT_VERSION
    # ... and what docs/FORMAT.md's table says, row by row
    doc = (ROOT / "docs" / "FORMAT.md").read_text()
    section = doc[doc.index("### Slot header"):]
    section = section[:section.index("\n### ", 5)]
    rows = [(int(a), int(b)) for a, b in re.findall(r"^\| (\d+) \| (\d+) \|", section, re.M)]
    assert rows == [(off, size) for _n, off, size in offs]


def test_an_encoded_header_reads_back_through_the_derived_dtype() -> None:
    h = H.SlotHeader(bytes(range(16)), 3, 5, 77, 123456789, bytes(range(100, 132)), 4096, 0xABCDEF, 42)
    rec = np.frombuffer(h.encode(), dtype=H.HEADER_DTYPE)[0]
    assert (int(rec["device"]), int(rec["area"]), int(rec["slot"]), int(rec["gen"]), int(rec["length"])) == \
        (3, 5, 77, 123456789, 4096)
    assert np.array([rec[f"d{i}"] for i in range(4)], dtype="<u8").tobytes() == bytes(range(100, 132))
    assert H.SlotHeader.decode(h.encode()) == h


def test_python_constants_are_the_headers() -> None:
    """Python takes these from the compiled module; the table makes a constant that stops doing so
    (a literal that drifts from kvstore.h) fail, and names every one of them."""
    pairs = {
        "KV_OP_READ": iorings.OP_READ, "KV_OP_WRITE": iorings.OP_WRITE, "KV_F_CSUM": iorings.F_CSUM,
        "KV_ST_OK": iorings.ST_OK, "KV_ST_IO_ERROR": iorings.ST_IO_ERROR, "KV_ST_BAD_HEADER": iorings.ST_BAD_HEADER,
        "KV_ST_BAD_CHECKSUM": iorings.ST_BAD_CHECKSUM, "KV_ST_WORKER_LOST": iorings.ST_WORKER_LOST,
        "KV_ST_REFUSED": iorings.ST_REFUSED, "KV_ST_STALE": iorings.ST_STALE,
        "KV_K_SUPERVISOR": iorings.K_SUPERVISOR, "KV_K_DIRECT": iorings.K_DIRECT, "KV_MAX_DEPTH": iorings.WPINS,
        "KV_A_FREE": A.FREE, "KV_A_CLIENT": A.CLIENT, "KV_A_SERVICE": A.SERVICE, "KV_A_QUARANTINE": A.QUARANTINE,
        "KV_A_DIRECT": A.DIRECT, "KV_A_READING": A.READING,
        "KV_SLOT_EMPTY": S.EMPTY, "KV_SLOT_WRITING": S.WRITING, "KV_SLOT_VALID": S.VALID, "KV_SLOT_RETIRED": S.RETIRED,
        "KV_HEADER_BLOCK": H.HEADER_BLOCK, "KV_FIELDS_SIZE": H.FIELDS_SIZE, "KV_FORMAT_VERSION": FORMAT_VERSION,
        "KV_NBAD": len(FFI.new("struct kv_worker *").bad),
    }
    declared = re.findall(r"^#define (KV_\w+) (\d+)", (ROOT / "kvstore/_native/kvstore.h").read_text(), re.M)
    assert sorted(n for n, _ in declared) == sorted(pairs), "a constant of kvstore.h without its Python twin"
    for name, value in declared:
        assert getattr(LIB, name) == int(value) == pairs[name], name


def test_no_c_unit_redefines_what_the_header_declares() -> None:
    declared = set(re.findall(r"^#define (KV_\w+)", (ROOT / "kvstore/_native/kvstore.h").read_text(), re.M))
    declared |= set(re.findall(r"^struct (kv_\w+) \{", (ROOT / "kvstore/_native/kvstore.h").read_text(), re.M))
    for unit in sorted((ROOT / "kvstore/_native").glob("*.c")):
        text = unit.read_text()
        again = set(re.findall(r"^#define (KV_\w+)", text, re.M)) | set(re.findall(r"^struct (kv_\w+) \{", text, re.M))
        assert not again & declared, (unit.name, again & declared)
