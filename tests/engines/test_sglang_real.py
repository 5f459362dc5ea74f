"""The SGLang HiCache backend inside SGLang's own storage layer (0.5.23, in .venv-sglang).

A full SGLang server does not run on these machines (its kernel package has CUDA builds
only), so the parts HiCache's storage path uses run for real on the CPU, in SGLang's
environment (``sglang_roundtrip.py``): its KV pool and host pool, its backend factory
loading the plugin ("dynamic"), and the v1 zero-copy calls HiCache's controller makes.
Two kvstore services of one store stand for two GPU servers: what one writes, the other
reads back byte for byte.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore.testing import free_port_pair, make_store, wait_for

pytestmark = [pytest.mark.sglang, pytest.mark.integration]

ROOT = Path(__file__).parents[2]
VENV = Path(os.environ.get("KVSTORE_SGLANG_VENV", ROOT / ".venv-sglang"))
PYTHON = VENV / "bin" / "python"
SCRIPT = Path(__file__).with_name("sglang_roundtrip.py")

if not PYTHON.exists():
    if os.environ.get("CI"):  # CI sets it up (scripts/setup): missing there is a failure, not a skip
        raise RuntimeError(f"{PYTHON} is missing: scripts/setup makes it (unless KVSTORE_SGLANG=none)")
    pytest.skip(f"SGLang environment not set up ({VENV}; run scripts/setup)", allow_module_level=True)


def roundtrip(home: Path, mode: str, server: str, store: str = "sg", pages: int = 40,
              tenant: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PYTHON), str(SCRIPT), mode, "--store", store, "--server", server, "--home", str(home),
                           "--pages", str(pages), "--tenant", tenant], capture_output=True, text=True, timeout=300,
                          cwd="/", env=dict(os.environ, PYTHONWARNINGS="ignore"))


def result(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_sglang_pages_written_on_one_server_are_read_back_exactly_on_another(home: Path, file_devices: Any,
                                                                              services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 2 * 200 * (4096 + (64 << 10)))
    make_store(home, "sg", devs, 64 << 10, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
    services(home, "sg", "a")
    services(home, "sg", "b")
    w = result(roundtrip(home, "write", "a"))
    assert w["backend"] == "KVStoreHiCacheStorage"  # SGLang's factory built ours
    assert w["exists_before"] == 0 and w["set"] == [True] * 40 and w["exists_after"] == 40
    assert w["exists_other_model_id"] == 0  # model_id (a weights identity) is in every key
    # SGLang's storage metrics: one backup batch of 40 pages, taken in by SGLang's own collector
    bm = w["backup_metrics"]
    assert bm["backup_pgs"] == [40] and bm["prefetch_pgs"] == [] and bm["bandwidth_positive"]
    assert bm["collector"]["sglang:backup_pgs_count"] == 1 and bm["collector"]["sglang:backup_pgs_sum"] == 40
    # clear (SGLang's /hicache/storage-backend/clear): no page saved before is found again by that
    # backend, and what it saves afterwards is found under its new keys
    assert w["exists_after_clear"] == 0 and w["set_after_clear"] == [True] * 2
    assert w["exists_after_clear_and_set"] == 2
    assert w["exists_peer_after_one_clear"] == 2  # ranks that got the same clears share keys (MLA ranks do)

    def read_on_b() -> dict[str, Any]:
        return result(roundtrip(home, "read", "b"))

    got: dict[str, Any] = {}
    assert wait_for(lambda: got.update(read_on_b()) or got["exists"] == 40, 30, 0.5)  # replication to b
    assert got["got"] == [True] * 40
    pm = got["prefetch_metrics"]
    assert pm["prefetch_pgs"] == [40] and pm["backup_pgs"] == [] and pm["bandwidth_positive"]
    assert pm["collector"]["sglang:prefetch_pgs_count"] == 1
    assert got["digests"] == w["digests"]  # byte-exact, page by page, in a fresh host pool
    assert got["exists_with_gap"] == 20  # leading hits only: a missing page ends the prefix
    assert got["exists_other_layout"] == 0 and got["exists_other_model"] == 0  # other layouts, other key space
    # a store whose pages cannot hold one SGLang page is refused at registration, with the size needed
    small = file_devices.make(1, (1 << 20) + 64 * (4096 + (16 << 10)))
    make_store(home, "tiny", small, 16 << 10, ["c"])
    services(home, "tiny", "c")
    r = roundtrip(home, "write", "c", store="tiny", pages=2)
    assert r.returncode != 0 and "create a store with --page-size >= 32768" in r.stderr, r.stderr[-3000:]
    # a hybrid model's extra pools (here a sliding-window pool) are refused at attach, naming them
    h = result(roundtrip(home, "hybrid", "a"))
    assert h["refused"] and "['swa']" in h["refused"] and "batch_*_v2" in h["refused"], h


def test_the_readmes_tenant_example_works_as_written(home: Path, file_devices: Any, services: Any) -> None:
    """README: map the Unix user SGLang runs as to a tenant in MASS_HOME/stores/STORE.toml, name it in the
    extra config. Before the mapping the tenant is refused; after it, its pages are its own."""
    devs = file_devices.make(1, (1 << 20) + 100 * (4096 + (64 << 10)))
    make_store(home, "ten", devs, 64 << 10, ["t"])
    svc = services(home, "ten", "t")
    r = roundtrip(home, "write", "t", store="ten", pages=4, tenant="team-a")
    assert r.returncode != 0 and "team-a" in r.stderr, r.stderr[-3000:]  # not granted yet
    svc.stop()
    me = pwd.getpwuid(os.getuid()).pw_name
    toml = home / "stores" / "ten.toml"
    text = toml.read_text()
    assert text.count("\n[tenants]\n") == 1  # the README says: add the line to this table
    toml.write_text(text.replace("\n[tenants]\n", f'\n[tenants]\nteam-a = ["user:{me}"]\nteam-b = ["user:{me}"]\n'))
    services(home, "ten", "t")
    w = result(roundtrip(home, "write", "t", store="ten", pages=4, tenant="team-a"))
    assert w["set"] == [True] * 4 and w["exists_after"] == 4
    # another tenant's key space does not hold team-a's pages ...
    assert result(roundtrip(home, "read", "t", store="ten", pages=4, tenant="team-b"))["exists"] == 0
    # ... team-a's does, byte for byte
    got = result(roundtrip(home, "read", "t", store="ten", pages=4, tenant="team-a"))
    assert got["exists"] == 4 and got["digests"] == w["digests"]
