"""The LMCache L2 adapter inside the real LMCache (0.5.6, in .venv-lmcache), against a real kvstore service.

* LMCache's own adapter harness, ``lmcache bench l2 --no-skip-verify``, through the plugin
  route, with objects larger than a page (two pages each, the last one padded);
* ``lmcache server`` on 127.0.0.1 with the adapter as its L2, driven by ``lmcache bench
  server`` (real stores, lookups, retrieves); after ``lmcache kvcache clear`` empties
  LMCache's L1, the same requests are served from kvstore, and the server's checksums of
  the retrieved KV equal those of the first run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore import KVCacheClient
from kvstore.testing import free_port, make_store, wait_for

pytestmark = [pytest.mark.lmcache, pytest.mark.integration]

ROOT = Path(__file__).parents[2]
VENV = Path(os.environ.get("KVSTORE_LMCACHE_VENV", ROOT / ".venv-lmcache"))
LMCACHE = VENV / "bin" / "lmcache"

if not LMCACHE.exists():
    if os.environ.get("CI"):  # CI sets it up (scripts/setup): missing there is a failure, not a skip
        raise RuntimeError(f"{LMCACHE} is missing: scripts/setup makes it (unless KVSTORE_LMCACHE=none)")
    pytest.skip(f"LMCache environment not set up ({LMCACHE}; run scripts/setup)", allow_module_level=True)


def lm_env(home: Path) -> dict[str, str]:
    # LMCache hashes with Python's hash when vLLM is absent: fix the seed so runs agree
    return dict(os.environ, MASS_HOME=str(home), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false",
                LMCACHE_DISABLE_BANNER="1", PYTHONWARNINGS="ignore")


def adapter_json(store: str, home: Path) -> str:
    return json.dumps({"type": "plugin", "module_path": "kvstore.engines.lmcache", "class_name": "KVStoreL2Adapter",
                       "adapter_params": {"store": store, "mass_home": str(home)}})



def test_lmcache_l2_bench_verifies_bytes_through_the_plugin(home: Path, file_devices: Any, services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 800 * (4096 + (64 << 10)))
    make_store(home, "lm", devs, 64 << 10)
    services(home, "lm")
    out = home / "bench.json"
    r = subprocess.run([str(LMCACHE), "bench", "l2", "--l2-adapter", adapter_json("lm", home), "--no-skip-verify",
                        "--data-size-kb", "100", "--num-keys", "32", "--in-flight", "4", "--rounds", "2",
                        "--lookup-max-hit-rate", "1.0",
                        "--format", "json", "--output", str(out)],
                       env=lm_env(home), capture_output=True, text=True, timeout=300, cwd="/")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "All 128 keys data verified OK" in log, log[-4000:]
    assert re.search(r"\[Store\] Round \d+: [\d.]+ ms, success_keys=128/128", log), log[-4000:]  # 4 in flight
    text = out.read_text()
    assert "Load" in text and "Store" in text
    # the bytes went through kvstore: 100 KB objects are two 64 KiB pages each, 128 objects a round
    sv = status(home)["stats"]["service"]
    assert sv["pages_written"] >= 256 and sv["hits"] >= 256 and sv["validation_failures"] == 0
    # every lock was released (the board is refreshed once a second)
    assert wait_for(lambda: all(t["pinned"] == 0 for t in status(home)["tenants"].values()), 10)


def test_every_key_loads_its_own_bytes_in_lmcaches_adapter_machinery(home: Path, file_devices: Any,
                                                                    services: Any) -> None:
    """``lmcache bench l2 --no-skip-verify`` cannot tell a key from another round's (its objects repeat
    a byte pattern and only the last round is checked). tests/engines/lmcache_verify_keys.py drives
    the adapter through LMCache's own factory, keys, memory objects and event fds with random bytes
    per key: 3 rounds of 40 keys of 100 KB (two pages each), loaded in random order, each compared
    with its own key's bytes; four load tasks in flight at once (the adapter reads queued tasks as
    one stream), each asking also for a key never stored, which must be its only miss, and one
    task a wave asking also for a stored key into a read-only buffer, which must fail alone; each
    task's keys looked up and locked first, found exactly where stored. A
    deliberately wrong adapter (each load asks for another key) fails it."""
    devs = file_devices.make(1, (1 << 20) + 600 * (4096 + (64 << 10)))
    make_store(home, "lm", devs, 64 << 10)
    services(home, "lm")
    script = Path(__file__).parent / "lmcache_verify_keys.py"
    res = {}
    for mode in ("right", "wrong"):
        r = subprocess.run([str(VENV / "bin" / "python"), str(script), adapter_json("lm", home), "--keys", "40",
                            "--rounds", "3", "--size-kb", "100", "--in-flight", "4"]
                           + (["--wrong-key"] if mode == "wrong" else []),
                           env=lm_env(home), capture_output=True, text=True, timeout=300, cwd="/")
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        res[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    status = {m: res[m].pop("status") for m in res}
    # 120 keys in load tasks of 16 (the last of 8): 8 tasks, each with one absent key, in 2 waves
    # of 4, each with one read-only object
    assert res["right"] == {"stored": 120, "loaded": 120, "verified": 120, "mismatched": 0, "missed": 0,
                            "absent": 8, "absent_found": 0, "readonly": 2, "readonly_found": 0,
                            "lookup_wrong": 0}, res
    assert res["wrong"]["verified"] == 0 and res["wrong"]["mismatched"] + res["wrong"]["missed"] == 120, res
    assert res["wrong"]["absent_found"] == 0 and res["wrong"]["readonly_found"] == 0, res
    assert res["wrong"]["lookup_wrong"] == 0, res
    # the adapter's counters in LMCache's status API: objects and bytes stored and loaded, failures
    st = status["right"]
    assert (st["stored_objects"], st["stored_bytes"], st["store_failed_objects"]) == (120, 120 * 100 * 1024, 0), st
    assert (st["loaded_objects"], st["loaded_bytes"], st["load_failed_objects"]) == (120, 120 * 100 * 1024, 10), st
    assert st["store_s"] > 0 and st["load_s"] > 0
    # the wrong adapter's loads are counted as what they were: loads of the keys it asked for
    assert status["wrong"]["loaded_objects"] + status["wrong"]["load_failed_objects"] == 130, status["wrong"]
    assert status["wrong"]["load_failed_objects"] == res["wrong"]["missed"] + 10, status["wrong"]


def run_bench_server(home: Path, rpc: str, http: str, retrieves: int, matched: int) -> list[str]:
    """3 requests of 512 tokens; each is looked up and stored or retrieved (cold), then retrieved
    again (warm) and checksummed by the server against what the client wrote. Half a second
    between requests: LMCache stores asynchronously, and a warm lookup right after a cold
    store can find it unfinished (then it stores again and checksums nothing)."""
    r = subprocess.run([str(LMCACHE), "bench", "server", "--rpc-url", rpc, "--url", http, "--mode", "cpu",
                        "--transfer-mode", "lmcache_driven", "--kvcache-shape-spec", "(2,128,16,2,64):float16:4",
                        "--num-blocks", "128", "--num-tokens", "512", "--start", "0", "--end", "3", "--interval", "0.5"],
                       env=lm_env(home), capture_output=True, text=True, timeout=300, cwd="/")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert out.count("RETRIEVE: retrieved (512 tokens") == retrieves, out[-4000:]
    # the bench compares a request's cold checksum (of what it wrote) with its warm one
    assert re.search(rf"Checksum OK:\s+{matched}\n", out) and re.search(r"Checksum FAIL:\s+0\n", out), out[-4000:]
    return re.findall(r"CHECKSUM: ([0-9a-f]+)", out)


def status(home: Path) -> dict[str, Any]:
    """The local service's entry of ``mass-ctl kvcache status --json``."""
    with KVCacheClient.connect("lm", home=home) as c:  # the service is up
        c.ping()
    from kvstore.tui.source import read_service

    return read_service(home, "lm", "local")


def stats(home: Path) -> dict[str, Any]:
    return dict(status(home)["stats"]["service"])


def test_lmcache_server_loads_back_from_kvstore_after_its_l1_is_cleared(home: Path, file_devices: Any,
                                                                       services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 400 * (4096 + (256 << 10)))
    make_store(home, "lm", devs, 256 << 10)
    services(home, "lm")
    port, http_port = free_port(), free_port()
    rpc, http = f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    log = home / "lmcache-server.log"
    srv = subprocess.Popen([str(LMCACHE), "server", "--host", "127.0.0.1", "--port", str(port), "--http-host",
                            "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", "0.25", "--eviction-policy",
                            "LRU", "--chunk-size", "256", "--l2-adapter", adapter_json("lm", home)],
                           env=lm_env(home), stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd="/")
    try:
        assert wait_for(lambda: srv.poll() is not None or "Uvicorn running" in log.read_text(), 120), \
            log.read_text()[-3000:]
        assert srv.poll() is None, log.read_text()[-3000:]
        first = run_bench_server(home, rpc, http, retrieves=3, matched=3)  # cold: stored, warm: from L1
        assert len(first) == 6 and first[0::2] == first[1::2]  # cold (as written) and warm, per request
        written = first[0::2]
        # stores reached kvstore: 3 requests x 2 chunks, each chunk 512 KiB = two 256 KiB pages
        assert wait_for(lambda: stats(home)["pages_written"] >= 12, 30)
        reads_before = stats(home)["hits"]
        r = subprocess.run([str(LMCACHE), "kvcache", "clear", "--url", http], env=lm_env(home), capture_output=True,
                           text=True, timeout=60, cwd="/")
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
        second = run_bench_server(home, rpc, http, retrieves=6, matched=0)  # cold: from kvstore
        assert second == written  # the KV LMCache retrieved after the clear came back from kvstore intact
        assert stats(home)["hits"] >= reads_before + 12
        assert stats(home)["validation_failures"] == 0
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait(10)
    # LMCache's locks were released when its server stopped: nothing stays pinned
    assert wait_for(lambda: all(t["pinned"] == 0 for t in status(home)["tenants"].values()), 10)


def test_locked_objects_survive_an_area_turned_over_and_unlock_releases_them(home: Path, file_devices: Any,
                                                                            services: Any) -> None:
    """LMCache's lookup-and-lock pins: 8 locked objects load back after 400 other pages went through a
    64-slot area; the 8 unlocked ones stored beside them do not; nested locks release at the last unlock;
    an unlock raced into a lookup of the same object leaves it locked and pinned.
    Then the service stops under the adapter: its next tasks complete as failed, none hangs."""
    devs = file_devices.make(1, (1 << 20) + 64 * (4096 + (64 << 10)))
    make_store(home, "lk", devs, 64 << 10)
    services(home, "lk")
    r = subprocess.run([str(VENV / "bin" / "python"), str(Path(__file__).with_name("lmcache_locks.py")), "--store",
                        "lk", "--home", str(home)], env=lm_env(home), capture_output=True, text=True, timeout=300,
                       cwd="/")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stored"] and out["found"] == [8, 1]
    assert out["pinned_locked"] == 8
    assert out["loaded_locked"] == 8  # pinned: never retired, byte-exact
    assert out["loaded_free"] == 0  # the area turned over several times: unpinned pages were reused
    assert out["pinned_after_one_unlock"] == 1 and out["pinned_after_unlock"] == 0
    # an unlock on another thread raced into a lookup of the same object (an outside review's
    # race): the object stays locked once and pinned, no unpin is sent for it
    assert out["race"] == {"found": 2, "sent": [["pin", 1]], "locks": [1, 1], "pinned": 2, "pinned_after": 0}, out
    # with the service gone, a store and a load complete as failed at once (LMCache recomputes)
    gone = out["after_service_gone"]
    assert gone["store_ok"] is False and gone["loaded"] == 0 and gone["seconds"] < 10


def test_a_stalled_service_never_holds_lmcaches_thread_and_leaves_no_pin(home: Path, file_devices: Any,
                                                                         services: Any) -> None:
    """The outside review's stalls (tests/engines/lmcache_stall.py): with the service stopped, lookups
    and unlocks on the lookups' connection never wait long in LMCache's thread, though its request
    slots fill; once it runs again every lock is released (an unpin that could not be posted was
    kept and posted on the same connection, after its pins); an adapter closed right after a
    lookup the read lane answered leaves nothing pinned."""
    devs = file_devices.make(1, (1 << 20) + 200 * (4096 + (64 << 10)))
    make_store(home, "st", devs, 64 << 10)
    services(home, "st")
    r = subprocess.run([str(VENV / "bin" / "python"), str(Path(__file__).with_name("lmcache_stall.py")), "--store",
                        "st", "--home", str(home)], env=lm_env(home), capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).parent))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stored"]
    assert out["slowest_call_s"] < 2.0, out  # calls on it wait at most LOOKUP_WAIT_S for the service
    assert out["locks_left"] == 0 and out["pinned_after_stall"] == 0, out
    assert out["pinned_after_close"] == 0 and out["pinned_after_quick_close"] == 0, out
