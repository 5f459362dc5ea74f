"""Requests are owned: a call that times out during a stall of the service is never executed
with the next call's keys or buffers, and every buffer comes back (issue: request ownership)."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.digests import key_id
from kvstore.config import ServiceConfig
from kvstore.errors import Timeout, ViewsInUse
from kvstore.quickstart import page_bytes
from kvstore.ipc import connection as P
from kvstore.ipc import lease as A
from kvstore.testing import make_store, wait_for

from .test_service import PS, check_batch, dev_size, keys_of, stats

pytestmark = pytest.mark.integration


def test_timed_out_calls_during_a_stall_store_nothing_phantom(file_devices, home: Path,  # type: ignore[no-untyped-def]
                                                                services) -> None:
    """The reproduction from the issue, with the public API only."""
    devs = file_devices.make(1, dev_size(200))
    make_store(home, "own", devs, PS, service=ServiceConfig(client_buffers=64, max_clients=2))
    svc = services(home, "own")
    # B: three sub-batches of a put (a quarter lease each), one posted ahead of the next
    a, b, c_ = keys_of("A", 16), keys_of("B", 40), keys_of("C", 8)
    with KVCacheClient.connect("own", home=home, timeout=10) as c:
        assert c.put(a, [page_bytes(k, PS) for k in a], wait=True).stored == 16
        with c.get(a) as got:
            assert check_batch(a, got) == (16, 0, 0)
        os.kill(svc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout):
                c.put(b, [page_bytes(k, PS) for k in b], timeout=0.2)
            with c.get(c_, timeout=0.2) as got:  # gets need no supervisor: an answer, not a timeout
                assert got.hits == 0
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        # keys C were never put: no lookup, no get may find them, whatever the service did late
        assert c.lookup(c_) == 0
        with c.get(c_) as got:
            assert got.hits == 0
        with c.get(a) as got:
            assert check_batch(a, got) == (16, 0, 0)
        # B was put but timed out: each page is either stored with B's bytes or absent
        for s in range(0, len(b), 16):
            with c.get(b[s:s + 16]) as got:
                assert check_batch(b[s:s + 16], got)[2] == 0
        # every buffer comes back once the service has answered what it held
        assert wait_for(lambda: c.free_buffers() == c.max_batch, timeout=60), c.free_buffers()
        # and the client stays usable
        more = keys_of("D", 8)
        assert c.put(more, [page_bytes(k, PS) for k in more], wait=True).stored == 8


STALL_SCRIPT = Path(__file__).parents[2] / "scripts" / "stall_torture.py"


@pytest.mark.slow
def test_stall_torture_no_wrong_or_phantom_page(tmp_path: Path) -> None:
    """The service stopped and resumed at random while two client processes put and get with short
    timeouts (and ask for keys never put): no wrong page, no phantom, every buffer back."""
    out = tmp_path / "stall.json"
    r = subprocess.run([sys.executable, str(STALL_SCRIPT), "--seconds", "12", "--clients", "2", "--keys", "200",
                        "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())["results"]
    assert rep["stalls"] >= 10 and rep["timeouts"] > 0          # the adversary was present
    assert rep["hits"] > 100 and rep["sweep_hits"] > 0            # and pages were really read
    assert (rep["wrong"], rep["phantom"], rep["sweep_wrong"], rep["sweep_phantom"], rep["leaked"]) == (0,) * 5
    assert rep["client_failures"] == 0 and rep["leftovers"] == 0


def _raw_hello(sock_path: Path, tenant: str = "") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(sock_path))
    P.send_frame(s, {"v": P.VERSION, "op": "hello", "tenant": tenant})
    assert P.recv_frame(s)["ok"]
    return s


def test_trickling_and_garbage_handshakes_do_not_delay_a_healthy_client(file_devices, home: Path,  # type: ignore[no-untyped-def]
                                                                          services) -> None:
    devs = file_devices.make(1, dev_size(64))
    make_store(home, "tr", devs, PS, service=ServiceConfig(client_buffers=8, max_clients=4))
    svc = services(home, "tr")
    stop = threading.Event()
    closed_by_service = [0]

    def trickle() -> None:
        """Starts a valid hello and sends it one byte every 0.3 s, over and over."""
        frame = P.encode_frame({"v": P.VERSION, "op": "hello", "tenant": "", "pad": "x" * 200})
        while not stop.is_set():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(svc.sock))
                for byte in frame:
                    if stop.wait(0.3):
                        return
                    try:
                        s.send(bytes([byte]))
                    except OSError:
                        closed_by_service[0] += 1
                        break

    threads = [threading.Thread(target=trickle) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        with KVCacheClient.connect("tr", home=home, timeout=5) as c:
            time.sleep(0.5)  # the tricklers are in their handshakes now
            lat = sorted(c.ping() for _ in range(400))
            p99 = lat[int(len(lat) * 0.99) - 1]
            assert p99 < 0.010, f"ping p99 {p99 * 1e3:.2f} ms beside trickling handshakes"
            # garbage: an oversized frame, a frame that is not a map, bytes after a valid hello
            for junk in (struct.pack("<I", P.MAX_FRAME + 1) + b"x", P.encode_frame({"v": 2})[:4] + b"\xc1" * 10):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(5)
                    s.connect(str(svc.sock))
                    s.sendall(junk)
                    reply = P.recv_frame(s)
                    assert reply["ok"] is False and reply["kind"] == "protocol"
            s = _raw_hello(svc.sock)
            s.sendall(b"\x00garbage after the hello")
            assert s.recv(10) == b""  # the service ended that connection
            s.close()
            assert c.ping() < 5  # and still serves the healthy one
            assert wait_for(lambda: closed_by_service[0] >= 2, timeout=60)  # tricklers dropped at the deadline
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert wait_for(lambda: stats(svc).service.handshakes_dropped >= 4)


def test_lying_client_is_refused_and_changes_nobody_elses_pages(file_devices, home: Path,  # type: ignore[no-untyped-def]
                                                                  services) -> None:
    """Out-of-range buffer ids, another client's buffer ids, buffers of its own request still in
    flight, oversized counts, wrong sequence numbers: refused; the good client's pages stay."""
    devs = file_devices.make(1, dev_size(100))
    make_store(home, "ly", devs, PS, service=ServiceConfig(client_buffers=8, max_clients=4))
    svc = services(home, "ly")
    good_keys = keys_of("good", 8)
    with KVCacheClient.connect("ly", home=home) as good, KVCacheClient.connect("ly", home=home) as evil:
        assert good.put(good_keys, [page_bytes(k, PS) for k in good_keys], wait=True).stored == 8
        ch = evil._chan
        lease = list(evil._lease)
        seq = [100]

        def post(d: P.Descriptor, op: int, bufs: list[int], count: int | None = None, seq_in_desc: int | None = None,
                 lengths: int = PS) -> int:
            n = len(bufs) if count is None else count
            seq[0] += 1
            d.keys[:len(bufs)] = np.frombuffer(b"".join(key_id(k) for k in good_keys[:len(bufs)]),
                                               np.uint8).reshape(-1, 32)
            d.bufs[:len(bufs)] = bufs
            d.lengths[:len(bufs)] = lengths
            for b in bufs:
                if b in lease:
                    evil._arena.set_state(b, A.SERVICE)
            h = d.head
            h["seq"] = seq[0] if seq_in_desc is None else seq_in_desc
            h["op"], h["count"], h["flags"] = op, n, 0
            d.set_cancel(0)
            d.set_state(P.D_POSTED)
            ch.requests.put_nowait((seq[0], d.index, 0))
            evil._doorbell.post()
            return seq[0]

        def answer_of(d: P.Descriptor) -> int:
            assert wait_for(lambda: d.state == P.D_ANSWERED, timeout=60)
            st = int(d.head["status"][0])
            d.set_state(P.D_FREE)
            return st

        d0, d1 = ch.desc[0], ch.desc[1]
        good_lease = list(good._lease)
        cases = [
            ("another client's buffers", dict(op=P.OP_PUT, bufs=good_lease[:2])),
            ("out-of-range buffer ids", dict(op=P.OP_GET, bufs=[-1, 10**6])),
            ("the same buffer twice", dict(op=P.OP_PUT, bufs=[lease[0], lease[0]])),
            ("an oversized count", dict(op=P.OP_GET, bufs=lease[:1], count=evil.max_batch + 1)),
            ("a count of zero", dict(op=P.OP_LOOKUP, bufs=[], count=0)),
            ("an unknown op", dict(op=77, bufs=lease[:1])),
            ("a sequence number that is not the record's", dict(op=P.OP_LOOKUP, bufs=lease[:1], seq_in_desc=5)),
        ]
        for what, kw in cases:
            post(d0, **kw)  # type: ignore[arg-type]
            assert answer_of(d0) in (P.S_BAD_REQUEST, P.S_TOO_LARGE), what
        for b in lease:
            evil._arena.set_state(b, A.FREE)
        # buffers still held by one of its own requests cannot be named by another
        os.kill(svc.pid, signal.SIGSTOP)
        try:
            post(d0, P.OP_PUT, lease[:2], lengths=PS)
            post(d1, P.OP_GET, lease[:2])
        finally:
            os.kill(svc.pid, signal.SIGCONT)
        assert answer_of(d0) == P.S_OK
        assert answer_of(d1) == P.S_BAD_REQUEST
        # a record naming a descriptor that is not posted, or one that does not exist: dropped
        before = stats(svc).service.requests_rejected
        ch.requests.put_nowait((999, 3, 0))
        ch.requests.put_nowait((1000, P.NDESC + 5, 0))
        evil._doorbell.post()
        assert wait_for(lambda: stats(svc).service.requests_rejected >= before + 2)
        # nobody else's pages changed, and the good client is served as before
        with good.get(good_keys) as got:
            assert check_batch(good_keys, got) == (8, 0, 0)
        assert good.free_buffers() == good.max_batch


def test_views_never_change_under_their_reader(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    """An array or slice made from a view keeps its buffer out of use after release (and close
    refuses while one lives); the view itself is invalid after release."""
    devs = file_devices.make(1, dev_size(100))
    make_store(home, "vw", devs, PS, service=ServiceConfig(client_buffers=4, max_clients=2))
    services(home, "vw")
    keys = keys_of("vw", 40)
    c = KVCacheClient.connect("vw", home=home)
    assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 40
    with c.get(keys[:2]) as b:
        view = b[0]
        arr = np.frombuffer(b[0], np.uint8)       # an export of the view
        part = b[1][100:200]                      # a slice of the other view
    with pytest.raises(ValueError):
        bytes(view)                               # the view itself was released
    assert c.free_buffers() == 2                  # both buffers stay out while arr and part live
    for s in range(2, 40, 2):                     # cycle the two other buffers many times
        with c.get(keys[s:s + 2]) as b2:
            assert check_batch(keys[s:s + 2], b2) == (2, 0, 0)
    assert np.array_equal(arr, page_bytes(keys[0], PS))          # unchanged
    assert bytes(part) == page_bytes(keys[1], PS).tobytes()[100:200]
    with pytest.raises(ViewsInUse):
        c.close()                                 # closing would let another client reuse them
    assert c.lookup(keys[:1]) == 1                # still open and usable
    del arr
    assert c.free_buffers() == 3
    del part
    assert c.free_buffers() == 4
    c.close()
