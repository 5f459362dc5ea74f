"""docs/FORMAT.md and the code must agree on every size and offset it lists."""

from __future__ import annotations

import re
from pathlib import Path

from kvstore.crdt.log import SYNC_REC
from kvstore.crdt.register import REGISTER_DTYPE
from kvstore.ipc.iorings import IO_COMPLETION, IO_REQUEST, WCONN as CONN_DTYPE
from kvstore.ipc.connection import DESC_HEAD, DIRECT_REQ, REQ
from kvstore.service.checkpoint import HEAD_DTYPE
from kvstore.shm.index import ENTRY_DTYPE
from kvstore.shm.slots import SLOT_DTYPE
from kvstore.storage import header, superblock

DOC = (Path(__file__).parents[2] / "docs" / "FORMAT.md").read_text()


def documented(name: str) -> int:
    m = re.search(rf"<!-- size:{name} (\d+) -->", DOC)
    assert m, f"docs/FORMAT.md does not state the size of {name}"
    return int(m.group(1))


def test_sizes_match() -> None:
    assert documented("superblock") == superblock.SUPERBLOCK_SIZE
    assert documented("superblock_head") == superblock.HEAD_SIZE
    assert documented("area_entry") == superblock.AREA_SIZE
    assert documented("slot_header") == header.HEADER_SIZE
    assert documented("slot_entry") == SLOT_DTYPE.itemsize
    assert documented("index_entry") == ENTRY_DTYPE.itemsize
    assert documented("io_request") == IO_REQUEST.itemsize
    assert documented("io_completion") == IO_COMPLETION.itemsize
    assert documented("client_req") == REQ.itemsize
    assert documented("client_desc") == DESC_HEAD.itemsize
    assert documented("register") == REGISTER_DTYPE.itemsize
    assert documented("sync_rec") == SYNC_REC.itemsize
    assert documented("direct_req") == DIRECT_REQ.itemsize
    assert documented("conn_entry") == CONN_DTYPE.itemsize
    assert documented("checkpoint_head") == HEAD_DTYPE.itemsize


def test_field_offsets_match() -> None:
    for dt, name in [(IO_REQUEST, "io_request"), (SLOT_DTYPE, "slot_entry"), (REQ, "client_req"), (DESC_HEAD, "client_desc"),
                     (REGISTER_DTYPE, "register"), (SYNC_REC, "sync_rec"), (IO_COMPLETION, "io_completion"),
                     (DIRECT_REQ, "direct_req"), (CONN_DTYPE, "conn_entry"), (HEAD_DTYPE, "checkpoint_head")]:
        for field, (_t, off) in dt.fields.items():  # type: ignore[union-attr]
            if field == "pad":
                continue
            assert re.search(rf"\|\s*{off}\s*\|[^|]*\|\s*`?{field}`?\s*\|", DOC), f"{name}.{field} at {off}"
