"""``mass-ctl kvcache quickstart``: the whole path on one machine in about a minute.

It creates a store of two GPU servers, ``gpu-a`` and ``gpu-b``, on two sparse
files in a temporary MASS_HOME, starts both cache services as child processes
(they replicate page locations over CurveZMQ on 127.0.0.1), and replays a
synthetic workload shaped like real traffic: requests that share long document
prefixes and end in a short new question. Each request looks up its page
chain, reads the cached prefix (verifying every byte), "computes" the rest and
saves it. The first half of the requests goes to gpu-a, which starts cold; the
second half to gpu-b, like returning users landing on another server: gpu-b
loads what gpu-a saved. It prints both servers' figures, stops the services and
removes everything it made.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._units import format_size
from .client import KVCacheClient
from .testing import ServiceProcess, free_port_pair, make_store, wait_for

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


@dataclass
class _Tally:
    requests: int = 0
    needed: int = 0
    hit: int = 0
    wrong: int = 0
    t_get: float = 0.0
    t_put: float = 0.0
    b_get: int = 0
    b_put: int = 0

    def __add__(self, o: _Tally) -> _Tally:
        return _Tally(*(getattr(self, f) + getattr(o, f) for f in self.__dataclass_fields__))


def _request_keys(doc: int, r: int, doc_pages: int) -> list[bytes]:
    keys = []
    k = b"quickstart-root"
    for j in range(doc_pages):
        k = chain(k, b"doc%d/%d" % (doc, j))
        keys.append(k)
    for j in range(QUESTION_PAGES):
        k = chain(k, b"q%d/%d" % (r, j))
        keys.append(k)
    return keys


def _serve(c: KVCacheClient, keys: list[bytes], page_size: int, t: _Tally, wait: bool) -> None:
    """One request: load the stored prefix (checking every byte), save the rest."""
    t.requests += 1
    t.needed += len(keys)
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
                    t.wrong += 1
                got += 1
                t.b_get += page_size
        if got < s + len(batch):
            break
    t.t_get += time.perf_counter() - t0
    t.hit += got
    todo = keys[got:]
    t0 = time.perf_counter()
    c.put(todo, [page_bytes(x, page_size) for x in todo], wait=wait)
    t.t_put += time.perf_counter() - t0
    t.b_put += len(todo) * page_size


def _report(name: str, t: _Tally) -> None:
    print(f"  {name}: {t.requests} requests, {t.needed} pages needed: {t.hit} loaded from the store "
          f"(hit rate {t.hit / max(t.needed, 1):.1%}), {t.needed - t.hit} computed and saved")
    if t.b_get:
        print(f"    loaded {format_size(t.b_get)} at {t.b_get / max(t.t_get, 1e-9) / 1e9:.2f} GB/s "
              f"({t.t_get / max(t.requests, 1) * 1e3:.1f} ms per request)")
    if t.b_put:
        print(f"    saved {format_size(t.b_put)} at {t.b_put / max(t.t_put, 1e-9) / 1e9:.2f} GB/s")


def run_quickstart(pages: int = 2048, page_size: int = 256 << 10) -> int:
    """Run the demo; returns the process exit code (0 when every byte read was right)."""
    doc_pages = max(4, pages // 16)
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-quickstart-"))
    svcs: list[ServiceProcess] = []
    try:
        # each server's area must hold every document plus its half of the questions
        slots = (DOCS * doc_pages + REQUESTS * QUESTION_PAGES) // 2 + 64
        devs = []
        for i in range(2):
            p = tmp / f"device{i}.img"
            with open(p, "wb") as f:
                f.truncate((1 << 20) + 2 * slots * (4096 + page_size))
            devs.append(str(p))
        names = ["gpu-a", "gpu-b"]
        make_store(tmp, "quickstart", devs, page_size, [f"{n}=127.0.0.1:{free_port_pair()}" for n in names])
        print(f"store 'quickstart': servers gpu-a and gpu-b, 2 file-backed devices, {format_size(page_size)} "
              f"pages, in {tmp}")
        svcs = [ServiceProcess(tmp, "quickstart", n).start() for n in names]
        # per server: (first request of each document, the later ones)
        tallies = {n: (_Tally(), _Tally()) for n in names}
        half = REQUESTS // 2
        with KVCacheClient.connect("quickstart", server="gpu-a", home=tmp) as c:
            for r in range(half):
                _serve(c, _request_keys(r % DOCS, r, doc_pages), page_size, tallies["gpu-a"][r >= DOCS],
                       wait=r == half - 1)
        t_saved = time.perf_counter()
        with KVCacheClient.connect("quickstart", server="gpu-b", home=tmp) as c:
            # locations travel asynchronously: wait (with a deadline) until gpu-b knows gpu-a's documents
            docs = [k for d in range(DOCS) for k in _request_keys(d, -1, doc_pages)[:doc_pages]]
            seen = wait_for(lambda: all(c.contains(docs)), timeout=30)
            lag = time.perf_counter() - t_saved
            for r in range(half, REQUESTS):
                _serve(c, _request_keys(r % DOCS, r, doc_pages), page_size, tallies["gpu-b"][r >= half + DOCS],
                       wait=r == REQUESTS - 1)
        print(f"gpu-a starts cold; gpu-b then serves the same documents (returning users on another server)"
              f"{'' if seen else ' [gpu-b had not learned every location within 30 s]'}:")
        for n in names:
            _report(n, tallies[n][0] + tallies[n][1])
        print(f"  gpu-b knew all {len(docs)} document pages gpu-a saved {lag * 1e3:.0f} ms after gpu-a's last save "
              "(including connecting a client)")
        cold, cached = tallies["gpu-a"][0], tallies["gpu-b"][0]
        print(f"cold versus cached, the first request for each of the {DOCS} documents:")
        print(f"  on gpu-a, nothing stored yet: {cold.hit} of {cold.needed} pages loaded, "
              f"{cold.needed - cold.hit} computed")
        print(f"  on gpu-b, saved by gpu-a:     {cached.hit} of {cached.needed} pages loaded "
              f"({cached.t_get / max(cached.requests, 1) * 1e3:.1f} ms per request), "
              f"{cached.needed - cached.hit} computed (the new question)")
        wrong = sum(t.wrong for pair in tallies.values() for t in pair)
        print(f"wrong pages: {wrong}")
        return 0 if wrong == 0 else 1
    finally:
        for svc in svcs:
            svc.stop()
            left = svc.leftovers()
            if left:
                print(f"warning: shared memory left behind: {left}")
        shutil.rmtree(tmp, ignore_errors=True)
        print("stopped the services and removed the temporary store")
