"""Requests are owned: a call that times out during a stall of the service is never executed
with the next call's keys or buffers, and every buffer comes back (issue: request ownership)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.errors import Timeout
from kvstore.quickstart import page_bytes
from kvstore.testing import make_store, wait_for

from .test_service import PS, check_batch, dev_size, keys_of

pytestmark = pytest.mark.integration


def test_timed_out_calls_during_a_stall_store_nothing_phantom(file_devices, home: Path,  # type: ignore[no-untyped-def]
                                                                services) -> None:
    """The reproduction from the issue, with the public API only."""
    devs = file_devices.make(1, dev_size(200))
    make_store(home, "own", devs, PS, service=ServiceConfig(client_buffers=64, max_clients=2))
    svc = services(home, "own")
    a, b, c_ = keys_of("A", 16), keys_of("B", 16), keys_of("C", 8)
    with KVCacheClient.connect("own", home=home, timeout=10) as c:
        assert c.put(a, [page_bytes(k, PS) for k in a], wait=True).stored == 16
        with c.get(a) as got:
            assert check_batch(a, got) == (16, 0, 0)
        os.kill(svc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                c.put(b, [page_bytes(k, PS) for k in b], timeout=0.2)
            with pytest.raises(Timeout):
                c.get(c_, timeout=0.2)
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        # keys C were never put: no lookup, no get may find them, whatever the service did late
        assert c.lookup(c_) == 0
        with c.get(c_) as got:
            assert got.hits == 0
        with c.get(a) as got:
            assert check_batch(a, got) == (16, 0, 0)
        # B was put but timed out: each page is either stored with B's bytes or absent
        with c.get(b) as got:
            assert check_batch(b, got)[2] == 0
        # every buffer comes back once the service has answered what it held
        assert wait_for(lambda: c.free_buffers() == c.max_batch, timeout=10), c.free_buffers()
        # and the client stays usable
        more = keys_of("D", 8)
        assert c.put(more, [page_bytes(k, PS) for k in more], wait=True).stored == 8
