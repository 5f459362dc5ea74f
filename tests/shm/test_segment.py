from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstore.shm.segment import Segment, create_semaphore, leftovers, remove_leftovers, unlink_semaphore


def test_owner_only_and_cleanup() -> None:
    prefix = f"kvs.test.{os.getpid()}."
    seg = Segment.create(prefix + "a", 8192)
    sem = create_semaphore(prefix + "s")
    try:
        mode = stat.S_IMODE(os.stat(Path("/dev/shm") / (prefix + "a")).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(os.stat(Path("/dev/shm") / ("sem." + prefix + "s")).st_mode) == 0o600
        assert leftovers(prefix) == sorted([prefix + "a", "sem." + prefix + "s"])
        # a crashed service's leftovers: the next start removes them by prefix
        assert set(remove_leftovers(prefix)) == {prefix + "a", "sem." + prefix + "s"}
        assert leftovers(prefix) == []
    finally:
        sem.close()
        seg.close()
        seg.unlink()
        unlink_semaphore(prefix + "s")
