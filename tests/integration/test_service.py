"""Real services (supervisor + I/O worker processes) on file-backed and loop devices."""

from __future__ import annotations

import gc
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.config import ServiceConfig
from kvstore.errors import ServiceLost, StoreNotFound
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.service.checkpoint import checkpoint_path
from kvstore.testing import make_store, wait_for

pytestmark = pytest.mark.integration

PS = 16 << 10
SLOT = 4096 + PS


def dev_size(slots: int) -> int:
    return (1 << 20) + slots * SLOT


def stats(svc) -> object:  # type: ignore[no-untyped-def]
    seg = Segment.attach(svc.prefix + "stats")
    try:
        return StatsBlock.attach(seg.buf).snapshot()
    finally:
        seg.close()


def own_slots(svc) -> int:  # type: ignore[no-untyped-def]
    """The service's own slots, once its gauges are published (a tick after it answers: read at
    once, they can still be 0)."""
    assert wait_for(lambda: stats(svc).service.own_slots > 0, 30)  # type: ignore[attr-defined]
    return int(stats(svc).service.own_slots)  # type: ignore[attr-defined]




def keys_of(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}/{i}".encode() for i in range(n)]


def check_batch(keys: list[bytes], batch) -> tuple[int, int, int]:  # type: ignore[no-untyped-def]
    """(hits, misses, wrong) of a get batch against the content derived from each key."""
    hits = misses = wrong = 0
    for k, v in zip(keys, batch):
        if v is None:
            misses += 1
        elif np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, len(v))):
            hits += 1
        else:
            wrong += 1
    return hits, misses, wrong


@pytest.mark.slow
def test_10000_pages_roundtrip_two_devices(devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    devs = devices.make(2, dev_size(5100))
    make_store(home, "big", devs, PS)
    svc = services(home, "big")
    keys = keys_of("big", 10_000)
    with KVCacheClient.connect("big", home=home) as c:
        r = c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
        assert (r.stored, r.skipped, r.dropped) == (10_000, 0, 0)
        assert c.lookup(keys) == 10_000
        total = [0, 0, 0]
        for s in range(0, len(keys), c.max_batch):
            with c.get(keys[s:s + c.max_batch]) as b:
                for i, x in enumerate(check_batch(keys[s:s + c.max_batch], b)):
                    total[i] += x
        assert total == [10_000, 0, 0]
        assert c.free_buffers() == c.max_batch  # every buffer came back
    st = stats(svc)
    assert st.devices[0].writes > 4000 and st.devices[1].writes > 4000  # round-robin over both devices
    assert st.service.pages_written == 10_000


def test_restart_rebuilds_from_headers(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    devs = file_devices.make(2, dev_size(300))
    make_store(home, "rb", devs, PS)
    svc = services(home, "rb")
    keys = keys_of("rb", 500)
    with KVCacheClient.connect("rb", home=home) as c:
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 500
    assert svc.stop() == 0
    checkpoint_path(home, "rb", "local").unlink()  # the scan is what this test is about
    seen = len(svc.log.read_text())
    svc2 = services(home, "rb")
    assert "rebuilt location table from slot headers" in svc2.log.read_text()[seen:]
    with KVCacheClient.connect("rb", home=home) as c:
        assert c.lookup(keys) == 500
        for s in range(0, 500, c.max_batch):
            with c.get(keys[s:s + c.max_batch]) as b:
                h, m, w = check_batch(keys[s:s + c.max_batch], b)
                assert (m, w) == (0, 0)
        # new writes after a restart get higher generations and do not clobber old pages
        more = keys_of("rb2", 50)
        assert c.put(more, [page_bytes(k, PS) for k in more], wait=True).stored == 50
        with c.get(keys[:10] + more[:10]) as b:
            assert check_batch(keys[:10] + more[:10], b) == (20, 0, 0)
    assert wait_for(lambda: stats(svc2).service.slots_valid == 550)
    assert wait_for(lambda: stats(svc2).service.pins == 0)  # every read unpinned its slot


def test_kill_worker_during_load(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    devs = file_devices.make(2, dev_size(400))
    make_store(home, "kw", devs, PS)
    svc = services(home, "kw")
    stop = threading.Event()
    result = {"hits": 0, "misses": 0, "wrong": 0, "calls": 0, "errors": 0, "max_call": 0.0}

    def load() -> None:
        rng = random.Random(1)
        with KVCacheClient.connect("kw", home=home, timeout=20) as c:
            n = 0
            while not stop.is_set():
                keys = keys_of(f"kw{n}", 16)
                n += 1
                t0 = time.monotonic()
                try:
                    c.put(keys, [page_bytes(k, PS) for k in keys], wait=rng.random() < 0.5)
                    old = keys_of(f"kw{rng.randrange(n)}", 16)
                    with c.get(old) as b:
                        h, m, w = check_batch(old, b)
                    result["hits"] += h
                    result["misses"] += m
                    result["wrong"] += w
                except Exception:
                    result["errors"] += 1
                result["calls"] += 1
                result["max_call"] = max(result["max_call"], time.monotonic() - t0)

    def progressed(calls: int, hits: int) -> bool:
        return result["calls"] >= calls and result["hits"] >= hits

    t = threading.Thread(target=load)
    t.start()
    try:
        # each kill lands once the load has made progress since the last (not after a guessed
        # time: on a busy machine a second may hold a handful of calls)
        assert wait_for(lambda: progressed(8, 40), timeout=60), f"no progress before the kills: {result}"
        for i in range(3):
            pids = svc.worker_pids()
            assert all(p in svc.children() for p in pids)
            os.kill(pids[i % 2], signal.SIGKILL)
            c0, h0 = result["calls"], result["hits"]
            assert wait_for(lambda: progressed(c0 + 8, h0 + 40), timeout=60), f"no progress after a kill: {result}"
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive(), "a client call hung"
    st = stats(svc)
    assert st.service.worker_restarts >= 3
    assert result["wrong"] == 0
    assert result["hits"] > 100 and result["calls"] > 20
    assert result["max_call"] < 20  # bounded: no call waited for its timeout
    with KVCacheClient.connect("kw", home=home) as c:  # still serving after the restarts
        keys = keys_of("after", 8)
        assert c.put(keys, [page_bytes(k, PS) for k in keys], wait=True).stored == 8
        with c.get(keys) as b:
            assert check_batch(keys, b) == (8, 0, 0)


def test_eviction_smaller_store_than_working_set(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    devs = file_devices.make(2, dev_size(40))  # 80 slots for 1,000 distinct pages
    make_store(home, "ev", devs, PS, service=ServiceConfig(client_buffers=16, max_clients=2))
    svc = services(home, "ev")
    rng = random.Random(7)
    tot = [0, 0, 0]
    with KVCacheClient.connect("ev", home=home) as c:
        for r in range(1000 // 16):
            keys = keys_of(f"ev{r}", 16)
            c.put(keys, [page_bytes(k, PS) for k in keys], wait=rng.random() < 0.3)
            old = keys_of(f"ev{rng.randrange(r + 1)}", 16)
            with c.get(old) as b:
                for i, x in enumerate(check_batch(old, b)):
                    tot[i] += x
    hits, misses, wrong = tot
    assert wrong == 0
    assert hits > 0 and misses > 0
    st = stats(svc)
    assert st.service.evictions > 500
    assert st.service.own_slots_valid <= 80


def test_bad_input_gets_clear_errors(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    devs = file_devices.make(1, dev_size(64))
    make_store(home, "bad", devs, PS, service=ServiceConfig(client_buffers=8, max_clients=2))
    svc = services(home, "bad")
    with KVCacheClient.connect("bad", home=home) as c:
        with pytest.raises(ValueError, match=r"pages\[1\] has 100 bytes; this store's page_size is 16384"):
            c.put([b"a", b"b"], [bytes(PS), bytes(100)])
        with pytest.raises(TypeError, match=r"keys\[0\] must be bytes, got str"):
            c.put(["a"], [bytes(PS)])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="2 keys but 1 pages"):
            c.put([b"a", b"b"], [bytes(PS)])
        with pytest.raises(ValueError, match="get of 9 keys exceeds max_batch 8"):
            c.get(keys_of("x", 9))
        with pytest.raises(TypeError, match="no buffer interface"):
            c.put([b"a"], [object()])
        # nothing was stored by the refused calls, and no buffer leaked
        assert c.lookup([b"a", b"b"]) == 0 and c.free_buffers() == 8
        # a put larger than a batch is split, and still works
        ks = keys_of("split", 20)
        assert c.put(ks, [page_bytes(k, PS) for k in ks], wait=True).stored == 20
    with pytest.raises(StoreNotFound, match="store 'nope' not found"):
        KVCacheClient.connect("nope", home=home)
    # third client over max_clients=2 is refused with the reason
    with KVCacheClient.connect("bad", home=home), KVCacheClient.connect("bad", home=home):
        with pytest.raises(Exception, match="maximum of 2 clients"):
            KVCacheClient.connect("bad", home=home)
    # a client whose service died: ServiceLost, not a hang
    c = KVCacheClient.connect("bad", home=home, timeout=30)
    svc.kill()
    t0 = time.monotonic()
    with pytest.raises(ServiceLost, match="is gone"):
        c.lookup([b"a"])
    assert time.monotonic() - t0 < 5
    c.close()
    with pytest.raises(StoreNotFound, match="no service of store 'bad' runs here"):
        KVCacheClient.connect("bad", home=home)
    # restart after the crash: leftovers are cleaned and the pages are back
    services(home, "bad")
    with KVCacheClient.connect("bad", home=home) as c:
        assert c.lookup(ks) == 20


def test_writes_finishing_after_an_unwaited_put_do_not_touch_the_next_call(home: Path, file_devices,  # type: ignore[no-untyped-def]
                                                                           services) -> None:
    """A put without wait is answered at once; its writes complete later, during the client's next
    calls on the same connection, and must not overwrite those calls' results (a lost hit)."""
    ps = 256 << 10  # slow enough writes to still be finishing during the next calls
    devs = file_devices.make(2, (1 << 20) + 600 * (4096 + ps))
    make_store(home, "s", devs, ps)
    services(home, "s")
    with KVCacheClient.connect("s", home=home) as c:
        stored = keys_of("stored", 16)
        assert c.put(stored, [page_bytes(k, ps) for k in stored], wait=True).stored == len(stored)
        lost = 0
        for r in range(100):
            fresh = keys_of(f"fresh{r}", 4)
            c.put(fresh, [page_bytes(k, ps) for k in fresh])  # answered before its writes finish
            assert c.lookup(stored) == len(stored)
            with c.get(stored) as b:
                h, m, w = check_batch(stored, b)
            assert w == 0
            lost += m
        assert lost == 0, f"{lost} hits reported as misses"


def runnable_seconds(pid: int) -> float:
    """Seconds process ``pid``'s main thread has been running or waiting for a CPU: a loop that
    polls (even one that yields the core to CPU hogs) is runnable all the time, one that sleeps
    is not. Its CPU time where the kernel keeps no schedstat."""
    try:
        run, wait = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
        return (int(run) + int(wait)) / 1e9
    except (OSError, ValueError):
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_supervisor_sleeps(home: Path, file_devices, services) -> None:  # type: ignore[no-untyped-def]
    """Once requests stop, the supervisor sleeps on its doorbell between its 20 ms ticks: a loop
    that went on polling (yielding or not) would stay runnable the whole time."""
    devs = file_devices.make(1, dev_size(64))
    make_store(home, "idle", devs, PS, service=ServiceConfig(client_buffers=8, max_clients=2))
    svc = services(home, "idle")
    with KVCacheClient.connect("idle", home=home) as c:
        for i in range(50):  # one-page saves and lookups, the requests a poll would follow
            k = [b"idle/%d" % i]
            assert c.put(k, [page_bytes(k[0], PS)], wait=True).stored == 1
            assert c.lookup(k) == 1
        time.sleep(0.5)
        t0, r0 = time.monotonic(), runnable_seconds(svc.proc.pid)
        time.sleep(2.0)
        share = (runnable_seconds(svc.proc.pid) - r0) / (time.monotonic() - t0)
    assert share < 0.5, f"the idle supervisor was runnable {share:.0%} of the time"


def test_max_clients_gets_the_open_files_it_needs(file_devices, home: Path, services) -> None:  # type: ignore[no-untyped-def]
    """Each connection holds three descriptors in the supervisor and two in each worker. Started with
    a soft limit of 256 open files (a hard one of 4096), a service for 300 clients raises its own
    limit and serves all 300 at once, on both devices; with a hard limit below what 300 need it
    refuses to start, saying why (without, the 278th client failed with EMFILE)."""
    from kvstore.errors import KVStoreError
    from kvstore.service.runtime import FD_MARGIN
    from kvstore.testing import ServiceProcess

    n = 300
    devs = file_devices.make(2, dev_size(2 * n))
    make_store(home, "fd", devs, PS, service=ServiceConfig(client_buffers=2, max_clients=n))
    with pytest.raises(KVStoreError, match=r"max_clients = 300 needs 1156 open files.*at most 512"):
        ServiceProcess(home, "fd", wrap=["prlimit", "--nofile=256:512", "--"], start_timeout=60).start()
    svc = services(home, "fd", wrap=["prlimit", "--nofile=256:4096", "--"])
    limits = Path(f"/proc/{svc.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    assert line.split()[3:5] == [str(3 * n + FD_MARGIN), "4096"], line
    clients = []
    try:
        for i in range(n):
            clients.append(KVCacheClient.connect("fd", home=home, timeout=30))
        keys = [b"fd/%d" % i for i in range(n)]
        for c, k in zip(clients, keys):
            assert c.put([k], [page_bytes(k, PS)], wait=True).stored == 1
        for c, k in zip(reversed(clients), keys):
            with c.get([k]) as got:
                assert got[0] is not None and bytes(got[0]) == bytes(page_bytes(k, PS))
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("ndev", [1, 3])
def test_a_client_costs_its_process_the_open_files_the_readme_names(file_devices, home: Path, services,
                                                                    ndev: int) -> None:  # type: ignore[no-untyped-def]
    """README's limits: a client holds 5 + devices descriptors while connected (its socket, the
    doorbell's write end, its wake-up's read end, its own segment and the control segment that
    Python's mmap keeps open, each device worker's wake-up write end); close() gives back the
    socket and the wake-ups at once, the two mappings once the client object is gone (its own
    arrays over them live as long as it does)."""
    devs = file_devices.make(ndev, dev_size(64))
    make_store(home, f"fds{ndev}", devs, PS)
    services(home, f"fds{ndev}")

    def nfds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = nfds()
    c = KVCacheClient.connect(f"fds{ndev}", home=home)
    try:
        ks = keys_of("f", 8)
        c.put(ks, [page_bytes(k, PS) for k in ks], wait=True)
        with c.get(ks) as b:
            assert check_batch(ks, b) == (8, 0, 0)
        held = nfds() - before
    finally:
        c.close()
    assert held == 5 + ndev, f"a client holds {held} descriptors with {ndev} device(s)"
    assert nfds() == before + 2
    del b, c
    gc.collect()
    assert nfds() == before
