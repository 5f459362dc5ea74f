"""Fixtures: a temporary MASS_HOME, devices (plain files, or loop devices when root), services.

Every fixture cleans up what it made, and checks that the code under test did
too: no shm segment or semaphore under the test's MASS_HOME, no loop device,
no process of a stopped service.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from kvstore.shm.segment import home_prefix, leftovers, pid_alive
from kvstore.testing import ServiceProcess


# The machines are shared and noisy: Hypothesis must judge correctness, not speed.
settings.register_profile("kvstore", deadline=None, derandomize=False)
settings.load_profile("kvstore")


def _loop_ok() -> str | None:
    """None if loop devices can be attached here, else the reason why not."""
    if os.geteuid() != 0:
        return "loop devices need root"
    if shutil.which("losetup") is None:
        return "losetup is not installed"
    return None


LOOP_REASON = _loop_ok()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, pyproject.toml): a worker per core, at most 4. The tests wait on
    services half the time, so two workers on two cores keep them busy; more than 4 would run
    several real vLLM engines (2-3 GiB each) at once for little gain."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first (a stable sort): pytest-xdist hands out modules in this order (with
    ``--no-loadscope-reorder``; its default order is by test count, which puts the real engines,
    a few long tests a module, last), and the longest ones started last would leave the other
    workers idle."""
    items.sort(key=lambda it: not any(it.get_closest_marker(m) for m in ("vllm", "sglang", "lmcache", "slow")))


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A fresh MASS_HOME; after the test no shm object of it may remain."""
    h = tmp_path / "mass"
    h.mkdir()
    yield h
    left = leftovers(home_prefix(h))
    assert not left, f"shared memory left behind: {left}"


class Devices:
    """Makes sparse backing files and, for kind 'loop', attaches them as loop devices."""

    def __init__(self, root: Path, kind: str) -> None:
        self.root = root
        self.kind = kind
        self.loops: list[str] = []
        self.files: list[Path] = []

    def make(self, n: int, size: int) -> list[str]:
        out = []
        for _ in range(n):
            f = self.root / f"dev{len(self.files)}.img"
            with open(f, "wb") as fh:
                fh.truncate(size)
            self.files.append(f)
            if self.kind == "loop":
                r = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", str(f)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    pytest.skip(f"losetup failed here: {r.stderr.strip()}")
                self.loops.append(r.stdout.strip())
                out.append(r.stdout.strip())
            else:
                out.append(str(f))
        return out

    def close(self) -> None:
        for d in self.loops:
            subprocess.run(["losetup", "-d", d], check=False)
        r = subprocess.run(["losetup", "-j", str(self.root / "dev0.img")], capture_output=True, text=True) \
            if self.loops else None
        assert r is None or not r.stdout.strip(), f"loop device still attached: {r.stdout}"


@pytest.fixture(params=["file", "loop"])
def devices(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Devices]:
    """Device factory, once with plain files and once with loop devices (skipped without root)."""
    if request.param == "loop" and LOOP_REASON:
        pytest.skip(LOOP_REASON)
    d = Devices(tmp_path, request.param)
    yield d
    d.close()


@pytest.fixture
def file_devices(tmp_path: Path) -> Iterator[Devices]:
    """Device factory with plain files only (for tests whose subject is not the device kind)."""
    d = Devices(tmp_path, "file")
    yield d
    d.close()


@pytest.fixture
def services() -> Iterator[Callable[..., ServiceProcess]]:
    """Start services; each is stopped at the end and must leave no process or shm behind."""
    started: list[tuple[ServiceProcess, list[int]]] = []

    def start(home: Path, store: str, server: str = "local", **kw: Any) -> ServiceProcess:
        s = ServiceProcess(home, store, server, **kw).start()
        started.append((s, s.children()))
        return s

    yield start
    bad = []
    for s, kids in started:  # stop every one before judging any: a failed check must not leak the rest
        kids += [k for k in s.children() if k not in kids]
        rc = s.stop()
        if rc not in (s.expected_exit, -9):
            bad.append(f"service exited with {rc}; see {s.log}")
    assert not bad, bad
    for s, _kids in started:
        assert not s.leftovers(), f"shm left behind: {s.leftovers()}"
    deadline = time.monotonic() + 10
    for _s, kids in started:
        for k in kids:
            while pid_alive(k) and not _zombie(k) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not pid_alive(k) or _zombie(k), f"worker process {k} outlived its service"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
