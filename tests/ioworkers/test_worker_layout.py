"""The compiled worker (ioworkers/_worker.c) reads and writes ring records through C structs:
their sizes and field offsets must be the numpy dtypes' of the protocol modules."""

from __future__ import annotations

from kvstore.ioworkers.aio import FFI, LIB
from kvstore.ipc.iorings import IO_COMPLETION, IO_REQUEST
from kvstore.ipc.connection import DIRECT_REQ


def test_c_record_layouts_are_the_dtypes() -> None:
    out = FFI.new("int64_t[32]")
    LIB.kv_wk_layout(out)
    got = list(out)

    def expect(dtype, fields):  # type: ignore[no-untyped-def]
        return [dtype.itemsize] + [dtype.fields[f][1] for f in fields]

    want = (expect(IO_REQUEST, ["op", "buf", "offset", "length", "gen", "d0", "area", "flags", "slot",
                                "payload_len", "csum", "conn_gen"])
            + expect(DIRECT_REQ, ["buf", "area", "payload_len", "slot", "gen", "d0"])
            + expect(IO_COMPLETION, ["result", "status", "kind", "latency_ns", "gen", "where"]))
    assert got[:len(want)] == want
    # the digest words are contiguous in both (the C struct has them as one array)
    for dt in (IO_REQUEST, DIRECT_REQ):
        assert [dt.fields[f"d{i}"][1] for i in range(4)] == [dt.fields["d0"][1] + 8 * i for i in range(4)]
