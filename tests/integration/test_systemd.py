"""The systemd unit: its command line is mass-ctl's, SIGTERM under load stops the service cleanly
(exit 0, nothing left behind, no wrong page), and the unit's command starts it again warm."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import KVCacheClient
from kvstore.cli import build_parser
from kvstore.errors import KVStoreError
from kvstore.quickstart import page_bytes
from kvstore.shm.segment import leftovers, name_prefix, pid_alive
from kvstore.testing import make_store, wait_for

pytestmark = pytest.mark.integration

UNIT = Path(__file__).parents[2] / "scripts" / "systemd" / "kvstore@.service"
PS = 16 << 10


def unit() -> dict[str, dict[str, str]]:
    """The unit file as section -> key -> value (the last one of a repeated key)."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        k, _, v = line.partition("=")
        out[section][k] = v
    return out


def exec_start(store: str) -> list[str]:
    """ExecStart for instance ``store``, with this environment's mass-ctl."""
    argv = unit()["Service"]["ExecStart"].replace("%i", store).split()
    assert argv[0].endswith("/mass-ctl")
    return [str(Path(sys.executable).parent / "mass-ctl"), *argv[1:]]


def test_unit_runs_connect_restarts_on_failure_and_stops_with_sigterm() -> None:
    u = unit()
    sv = u["Service"]
    assert sv["Restart"] == "on-failure" and sv["KillSignal"] == "SIGTERM" and sv["KillMode"] == "mixed"
    assert int(sv["TimeoutStopSec"]) >= 30 and sv["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert sv["RestartPreventExitStatus"].split() == ["2", "3"]  # bad usage, no such store: futile to retry
    args = build_parser().parse_args(exec_start("s")[1:])  # mass-ctl accepts the unit's command line
    assert (args.cmd, args.store, args.daemon) == ("connect", "s", False)  # foreground: systemd supervises
    assert u["Install"]["WantedBy"] == "multi-user.target"


def start(home: Path, log: Path) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(exec_start("u"), env=dict(os.environ, MASS_HOME=str(home)), stdout=log.open("ab"),
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd="/")
    pidf = home / "run" / "u" / "local.pid"
    assert wait_for(lambda: p.poll() is not None or (pidf.exists() and pidf.read_text().strip() == str(p.pid)
                                                     and (home / "run" / "u" / "local.sock").exists()), 60), \
        log.read_text()
    assert p.poll() is None, log.read_text()
    return p


def test_sigterm_under_load_stops_cleanly_and_starts_again_warm(home: Path, devices: Any) -> None:
    devs = devices.make(1, (1 << 20) + 6000 * (4096 + PS))  # room for every page: nothing evicted
    make_store(home, "u", devs, PS)
    log = home / "unit.log"
    p = start(home, log)
    workers = [int(x) for x in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    assert workers
    acked: dict[bytes, int] = {}  # key -> thread that saw its put stored (written and indexed)
    lock = threading.Lock()
    wrong: list[bytes] = []
    ended: list[str] = []
    hits = [0]

    def load(t: int) -> None:
        rnd = random.Random(t)
        try:
            with KVCacheClient.connect("u", home=home, timeout=10) as c:
                for i in range(10**6):
                    if i < 120:  # 120 batches of 8 pages per thread, then reads only
                        keys = [f"t{t}/{i}/{j}".encode() for j in range(8)]
                        r = c.put(keys, [page_bytes(k, PS) for k in keys], wait=True)
                        if r.stored == len(keys):
                            with lock:
                                acked.update((k, t) for k in keys)
                    with lock:
                        mine = [k for k, who in acked.items() if who == t]
                    want = rnd.sample(mine, min(8, len(mine)))
                    with c.get(want) as got:
                        for k, v in zip(want, got):
                            if v is None:
                                continue
                            if not np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, PS)):
                                wrong.append(k)
                            hits[0] += 1
        except (KVStoreError, OSError) as e:  # the service went away under the call: expected here
            ended.append(type(e).__name__)

    threads = [threading.Thread(target=load, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    assert wait_for(lambda: len(acked) >= 400 and hits[0] >= 200, 60)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)  # what `systemctl stop` sends (KillSignal), to the main process only
    rc = p.wait(60)
    stop_s = time.monotonic() - t0
    for th in threads:
        th.join(30)
    assert rc == 0, log.read_text()[-3000:]
    assert stop_s < float(unit()["Service"]["TimeoutStopSec"])
    assert len(ended) == 3 and not wrong
    assert wait_for(lambda: not any(pid_alive(w) for w in workers), 10)  # its I/O workers are gone too
    assert not leftovers(name_prefix(home, "u", "local"))
    assert not (home / "run" / "u" / "local.pid").exists() and not (home / "run" / "u" / "local.sock").exists()
    assert '"service stopped"' in log.read_text()
    # started again by the unit's command: warm, every acknowledged page is there, byte for byte
    p = start(home, log)
    try:
        keys = sorted(acked)
        good = 0
        with KVCacheClient.connect("u", home=home) as c:
            assert c.lookup(keys) == len(keys)
            for s in range(0, len(keys), c.max_batch):
                with c.get(keys[s:s + c.max_batch]) as got:
                    good += sum(v is not None and np.array_equal(np.frombuffer(v, np.uint8), page_bytes(k, PS))
                                for k, v in zip(keys[s:s + c.max_batch], got))
        assert good == len(keys)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    assert not leftovers(name_prefix(home, "u", "local"))
