"""``mass-ctl kvcache quickstart``: the whole path on one machine in about a minute.

It creates a store on two sparse files in a temporary MASS_HOME, starts the
cache service as a child process, and replays a synthetic workload shaped like
real traffic: requests that share long document prefixes and end in a short
new question. Each request looks up its page chain, reads the cached prefix
(verifying every byte), "computes" the rest and saves it. Then it prints hit
rate and throughput, stops the service and removes everything it made.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._units import format_size
from .client import KVCacheClient
from .testing import ServiceProcess, make_store

DOCS = 8
QUESTION_PAGES = 4
REQUESTS = 64


def page_bytes(key: bytes, page_size: int) -> np.ndarray:
    """Deterministic page content for ``key`` (so every read can be checked byte for byte)."""
    seed = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.tile(seed, page_size // 64)


def chain(parent: bytes, tokens: bytes) -> bytes:
    """A page key chained on its parent, as engines key prefix pages."""
    return hashlib.blake2b(parent + tokens, digest_size=32).digest()


def run_quickstart(pages: int = 2048, page_size: int = 256 << 10) -> int:
    """Run the demo; returns the process exit code (0 when every byte read was right)."""
    doc_pages = max(4, pages // 16)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-quickstart-"))
    svc = None
    try:
        slots = (DOCS * doc_pages + REQUESTS * QUESTION_PAGES) // 2 + 64
        devs = []
        for i in range(2):
            p = tmp / f"device{i}.img"
            with open(p, "wb") as f:
                f.truncate((1 << 20) + slots * (4096 + page_size))
            devs.append(str(p))
        make_store(tmp, "quickstart", devs, page_size)
        print(f"store 'quickstart': 2 file-backed devices, {format_size(page_size)} pages, in {tmp}")
        svc = ServiceProcess(tmp, "quickstart").start()
        needed = hit = wrong = 0
        t_get = t_put = 0.0
        b_get = b_put = 0
        with KVCacheClient.connect("quickstart", home=tmp) as c:
            for r in range(REQUESTS):
                doc = r % DOCS
                keys = []
                k = b"quickstart-root"
                for j in range(doc_pages):
                    k = chain(k, b"doc%d/%d" % (doc, j))
                    keys.append(k)
                for j in range(QUESTION_PAGES):
                    k = chain(k, b"q%d/%d" % (r, j))
                    keys.append(k)
                needed += len(keys)
                n = c.lookup(keys)
                t0 = time.perf_counter()
                got = 0
                for s in range(0, n, c.max_batch):
                    batch = keys[s:min(n, s + c.max_batch)]
                    with c.get(batch) as views:
                        for key, v in zip(batch, views):
                            if v is None:
                                break  # evicted since lookup: recompute from here
                            if not np.array_equal(np.frombuffer(v, np.uint8), page_bytes(key, page_size)):
                                wrong += 1
                            got += 1
                            b_get += page_size
                    if got < s + len(batch):
                        break
                t_get += time.perf_counter() - t0
                hit += got
                todo = keys[got:]
                t0 = time.perf_counter()
                c.put(todo, [page_bytes(x, page_size) for x in todo], wait=(r == REQUESTS - 1))
                t_put += time.perf_counter() - t0
                b_put += len(todo) * page_size
        print(f"{REQUESTS} requests, {needed} pages needed: {hit} served from the store "
              f"(hit rate {hit / needed:.1%}), {needed - hit} computed and saved")
        print(f"loaded {format_size(b_get)} at {b_get / max(t_get, 1e-9) / 1e9:.2f} GB/s, "
              f"saved {format_size(b_put)} at {b_put / max(t_put, 1e-9) / 1e9:.2f} GB/s "
              "(timed in the client, including byte-for-byte checks of loads and generation of saved pages)")
        print(f"wrong pages: {wrong}")
        return 0 if wrong == 0 else 1
    finally:
        if svc is not None:
            svc.stop()
            left = svc.leftovers()
            if left:
                print(f"warning: shared memory left behind: {left}")
        shutil.rmtree(tmp, ignore_errors=True)
        print("stopped the service and removed the temporary store")
