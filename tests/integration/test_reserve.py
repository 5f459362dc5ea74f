"""reserve()/commit(): pages filled in place in the buffers the device is written from, never changing
after they are sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient, PageReservation
from kvstore.errors import ClosedError, ViewsInUse
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store

pytestmark = pytest.mark.integration

PS = 16 << 10


@pytest.fixture
def store(home: Path, file_devices: Any, services: Any) -> Path:
    make_store(home, "rs", file_devices.make(1, (1 << 20) + 256 * (4096 + PS)), PS)
    services(home, "rs")
    return home


def test_filled_in_place_then_committed_reads_back(store: Path) -> None:
    keys = [b"r/%d" % i for i in range(10)]
    with KVCacheClient.connect("rs", home=store) as c:
        free = c.free_buffers()
        with c.reserve(12) as r:
            assert isinstance(r, PageReservation) and len(r) == 12
            for i, k in enumerate(keys):
                np.frombuffer(r[i], np.uint8)[:] = page_bytes(k, PS)  # the engine's one copy
            res = r.commit(keys, wait=True)  # the 2 pages not used go back
        assert res.stored == 10 and res.dropped == 0
        with c.get(keys) as got:
            assert all(np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, PS)) for k, v in zip(keys, got))
        assert c.free_buffers() == free
        with c.reserve(1) as r:  # a key the store holds is skipped, as with put
            assert r.commit(keys[:1], wait=True).skipped == 1


def test_commit_refuses_while_something_made_from_a_view_lives(store: Path) -> None:
    with KVCacheClient.connect("rs", home=store) as c:
        free = c.free_buffers()
        r = c.reserve(2)
        arr = np.frombuffer(r[0], np.uint8)  # e.g. a tensor the engine still writes through
        arr[:] = 7
        np.frombuffer(r[1], np.uint8)[:] = 9
        with pytest.raises(ViewsInUse, match="drop them"):
            r.commit([b"a", b"b"], wait=True)
        assert c.contains([b"a", b"b"]) == [False, False]  # nothing was sent
        arr[:] = 8  # still the engine's page: it may change it
        del arr
        assert r.commit([b"a", b"b"], wait=True).stored == 2
        with c.get([b"a", b"b"]) as got:
            assert bytes(got[0]) == bytes([8]) * PS and bytes(got[1]) == bytes([9]) * PS
        with pytest.raises(ClosedError):
            r[0]
        with pytest.raises(ClosedError):
            r.commit([b"c"])
        assert c.free_buffers() == free


def test_released_reservation_gives_its_buffers_back_once_its_arrays_are_gone(store: Path) -> None:
    with KVCacheClient.connect("rs", home=store) as c:
        free = c.free_buffers()
        r = c.reserve(3)
        kept = np.frombuffer(r[2], np.uint8)
        r.release()
        assert c.free_buffers() == free - 1  # the page behind `kept` stays out of use
        with pytest.raises(ViewsInUse):
            c.close()
        del kept
        assert c.free_buffers() == free
        with pytest.raises(ValueError, match="between 1 and max_batch"):
            c.reserve(c.max_batch + 1)
        with pytest.raises(ValueError, match="keys for 1 reserved"):
            c.reserve(1).commit([b"x", b"y"])


def test_the_clients_checksum_is_used_and_a_lying_one_is_a_miss(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """put computes each page's checksum while copying it in and the worker writes that one into
    the slot header; a client that lies about it stores a page that every read rejects."""
    import kvstore.client as client_mod

    keys = [b"sum/%d" % i for i in range(4)]
    with KVCacheClient.connect("rs", home=store) as c:
        assert c.put(keys[:2], [page_bytes(k, PS) for k in keys[:2]], wait=True).stored == 2
        real = client_mod._copy_summed
        monkeypatch.setattr(client_mod, "_copy_summed", lambda dst, src: real(dst, src) ^ 1)
        assert c.put(keys[2:], [page_bytes(k, PS) for k in keys[2:]], wait=True).stored == 2
        with c.get(keys) as got:
            assert [v is not None for v in got] == [True, True, False, False]
            assert all(np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, PS)) for k, v in zip(keys[:2], got[:2]))
