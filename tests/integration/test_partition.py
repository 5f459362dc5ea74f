"""Servers in network namespaces joined by a bridge: cut one off under load, heal, converge."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.quickstart import page_bytes
from kvstore.testing import Network, ServiceProcess, make_store

pytestmark = pytest.mark.integration
PS = 16 << 10


def _netns_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        Network(1, tag=f"kvp{os.getpid() % 1000}").close()
    except Exception as e:
        return f"cannot make network namespaces here: {e}"
    return None


REASON = _netns_reason()


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_partition_heal_converges_without_wrong_pages(home: Path, file_devices: Any) -> None:
    names = ["a", "b", "c"]
    # areas large enough that nothing is evicted: convergence is then "every page everywhere"
    devs = file_devices.make(2, (1 << 20) + 3 * 1500 * (4096 + PS))
    with Network(3) as net:
        make_store(home, "m", devs, PS, [f"{n}={net.ip(i)}:7400" for i, n in enumerate(names)])
        svcs: list[ServiceProcess] = []
        try:
            for i, n in enumerate(names):
                svcs.append(ServiceProcess(home, "m", n, netns=net.hosts[i]).start())
            _run(home, names, net, svcs)
        finally:
            for sv in svcs:
                sv.stop()
        for sv in svcs:
            assert not sv.leftovers()


def _run(home: Path, names: list[str], net: Network, svcs: list[ServiceProcess]) -> None:
    """Load on all three, partition c, heal, then check convergence and every byte."""
    stop = threading.Event()
    wrong = [0]
    written: dict[str, list[bytes]] = {n: [] for n in names}
    errors: list[str] = []

    def work(n: str) -> None:
        rng = random.Random(n)
        try:
            with KVCacheClient.connect("m", server=n, home=home) as c:
                i = 0
                while not stop.is_set() and i < 300:  # <= 2,400 pages per server
                    keys = [f"{n}/{i}/{j}".encode() for j in range(8)]
                    i += 1
                    c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
                    written[n].extend(keys)
                    other = rng.choice(names)
                    if written[other]:
                        ks = rng.sample(written[other], min(8, len(written[other])))
                        with c.get(ks) as b:
                            for k, v in zip(ks, b):
                                if v is not None and not np.array_equal(np.frombuffer(v, np.uint8),
                                                                        page_bytes(k, PS)):
                                    wrong[0] += 1
                    time.sleep(0.01)
        except Exception as e:  # surfaced by the assertion below
            errors.append(f"{n}: {e!r}")

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        net.cut(2)            # c is partitioned; everyone keeps writing and reading
        time.sleep(0.2)
        a_at_cut = len(written["a"])
        time.sleep(2.8)
        cut_view = {n: len(written[n]) for n in names}
        # the partition is real: what a wrote since the cut has not reached c
        since_cut = written["a"][a_at_cut:cut_view["a"]]
        assert since_cut
        with KVCacheClient.connect("m", server="c", home=home) as cc:
            assert not any(cc.contains(since_cut[:1024]))
        net.heal(2)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert all(cut_view[n] > 0 for n in names)
    # after the heal every server converges on every page, with a bounded wait
    deadline = time.monotonic() + 30
    for n in names:
        with KVCacheClient.connect("m", server=n, home=home) as c:
            for owner in names:
                keys = written[owner]
                while True:
                    found = sum(c.contains(keys[s:s + 1024]).count(True) for s in range(0, len(keys), 1024))
                    if found == len(keys) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                assert found == len(keys), f"{n} sees {found}/{len(keys)} of {owner}'s pages"
                for s in range(0, len(keys), c.max_batch):
                    ks = keys[s:s + c.max_batch]
                    with c.get(ks) as b:
                        for k, v in zip(ks, b):
                            assert v is not None and np.array_equal(np.frombuffer(v, np.uint8),
                                                                    page_bytes(k, PS))
    assert wrong[0] == 0
