"""A random-weight Llama (grouped-query attention, seeded, no download) through the store:
the reused prefix must give the same logits and the same greedy tokens as recomputation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvstore import KVCacheClient  # noqa: E402
from kvstore.engines.transformers import KVStoreCache, generate_with_store, prefill  # noqa: E402
from kvstore.testing import free_port_pair, make_store, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

PAGE_TOKENS = 16
MODEL_ID = "tiny-llama-gqa@seed0"


def tiny_model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(cfg).eval()


PAGE_BYTES = 4 * 2 * 2 * PAGE_TOKENS * 32 * 4  # layers x (k, v) x kv heads x tokens x head dim x fp32


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model()


def prompt(n: int, seed: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (1, n), generator=g)


@pytest.fixture
def store(home: Path, file_devices: Any, services: Any) -> Path:
    devs = file_devices.make(1, (1 << 20) + 400 * (4096 + PAGE_BYTES))
    make_store(home, "llm", devs, PAGE_BYTES)
    services(home, "llm")
    return home


@pytest.mark.parametrize("prefix,total", [(64, 80), (70, 90), (48, 49)])
def test_logits_match_recomputation(model: Any, store: Path, prefix: int, total: int) -> None:
    """Page-aligned and unaligned prefixes: the remainder's logits equal full recomputation."""
    ids = prompt(total)
    with KVCacheClient.connect("llm", home=store) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        _, cache, _ = prefill(model, ids[:, :prefix])
        saved = kv.save(ids[:, :prefix], cache, wait=True)
        assert saved is not None and saved.stored == prefix // PAGE_TOKENS
        full_logits, _, n0 = prefill(model, ids)
        assert n0 == 0
        warm_logits, _, n = prefill(model, ids, kv)
        assert n == (prefix // PAGE_TOKENS) * PAGE_TOKENS and n > 0
        diff = (warm_logits[0] - full_logits[0, n:]).abs().max().item()
        assert diff <= 1e-4, diff


def test_greedy_32_tokens_identical_and_reused(model: Any, store: Path) -> None:
    ids = prompt(100, seed=2)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    with KVCacheClient.connect("llm", home=store) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        cold = generate_with_store(model, ids, kv, max_new_tokens=32, do_sample=False)
        assert cold.cached_tokens == 0 and torch.equal(cold.sequences, ref)
        assert wait_for(lambda: kv.lookup(ids) == 96)
        warm = generate_with_store(model, ids, kv, max_new_tokens=32, do_sample=False)
        assert warm.cached_tokens == 96 and warm.computed_tokens == 4
        assert torch.equal(warm.sequences, ref)
        # a different model id shares nothing
        other = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id="another-model")
        assert other.lookup(ids) == 0




SAVER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from engines.test_transformers import tiny_model, prompt, PAGE_TOKENS, MODEL_ID
    from kvstore import KVCacheClient
    from kvstore.engines.transformers import KVStoreCache, prefill
    model = tiny_model()
    ids = prompt(120, seed=3)
    with KVCacheClient.connect("llm", home={home!r}, server={server!r}) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        _, cache, _ = prefill(model, ids)
        print(kv.save(ids, cache, wait=True).stored)
""")


def test_one_process_saves_another_reuses(model: Any, store: Path) -> None:
    code = SAVER.format(tests=str(Path(__file__).parents[1]), home=str(store), server="local")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "7", r.stderr
    ids = prompt(120, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    with KVCacheClient.connect("llm", home=store) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        warm = generate_with_store(model, ids, kv, max_new_tokens=32, do_sample=False)
    assert warm.cached_tokens == 112 and torch.equal(warm.sequences, ref)


def test_two_servers_of_a_store(model: Any, home: Path, file_devices: Any, services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 2 * 200 * (4096 + PAGE_BYTES))
    make_store(home, "llm", devs, PAGE_BYTES, [f"a=127.0.0.1:{free_port_pair()}", f"b=127.0.0.1:{free_port_pair()}"])
    services(home, "llm", "a")
    services(home, "llm", "b")
    code = SAVER.format(tests=str(Path(__file__).parents[1]), home=str(home), server="a")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "7", r.stderr
    ids = prompt(120, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    with KVCacheClient.connect("llm", home=home, server="b") as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        assert wait_for(lambda: kv.lookup(ids) == 112)
        warm = generate_with_store(model, ids, kv, max_new_tokens=32, do_sample=False)
    assert warm.cached_tokens == 112 and torch.equal(warm.sequences, ref)


def test_load_errors_fall_back_to_recompute(model: Any, home: Path, file_devices: Any, services: Any) -> None:
    devs = file_devices.make(1, (1 << 20) + 100 * (4096 + PAGE_BYTES))
    make_store(home, "llm", devs, PAGE_BYTES)
    svc = services(home, "llm")
    ids = prompt(80, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    with KVCacheClient.connect("llm", home=home) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        _, cache, _ = prefill(model, ids)
        assert kv.save(ids, cache, wait=True).stored == 5
        # corrupt the third page's payload on the device: that page and everything after it is recomputed
        from kvstore.storage.device import read_superblock

        sb = read_superblock(devs[0])
        offs = [sb.areas[0].offset + s * sb.slot_size for s in range(sb.areas[0].slot_count)]
        with open(devs[0], "r+b") as f:
            # the slots were filled in order: flip a byte in slot 2's payload
            f.seek(offs[2] + 4096 + 100)
            b = f.read(1)
            f.seek(offs[2] + 4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        warm = generate_with_store(model, ids, kv, max_new_tokens=16, do_sample=False, save=False)
        assert warm.cached_tokens == 32 and torch.equal(warm.sequences, ref)
        # the service dies: loading returns nothing, generation is still right
        svc.kill()
        dead = generate_with_store(model, ids, kv, max_new_tokens=16, do_sample=False)
        assert dead.cached_tokens == 0 and dead.saved is None and torch.equal(dead.sequences, ref)
    # the restarted service cleans up after the crash and serves the intact prefix again
    services(home, "llm")
    with KVCacheClient.connect("llm", home=home) as c:
        kv = KVStoreCache(c, model, page_tokens=PAGE_TOKENS, model_id=MODEL_ID)
        again = generate_with_store(model, ids, kv, max_new_tokens=16, do_sample=False, save=False)
        assert again.cached_tokens == 32 and torch.equal(again.sequences, ref)


def test_page_too_large_for_store_is_a_clear_error(model: Any, store: Path) -> None:
    with KVCacheClient.connect("llm", home=store) as c:
        with pytest.raises(ValueError, match="--page-size >= 65536"):
            KVStoreCache(c, model, page_tokens=32, model_id=MODEL_ID)
