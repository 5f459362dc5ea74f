from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import KeyNamespace, page_keys

NS = KeyNamespace("m@1", "float16", 32, 8, 128, 16)


def test_whole_pages_only_and_prefix_stability() -> None:
    toks = list(range(100))
    keys = page_keys(NS, toks)
    assert len(keys) == 6 and all(len(k) == 32 for k in keys)
    assert page_keys(NS, toks[:64]) == keys[:4]  # equal prefixes, equal keys
    assert page_keys(NS, np.array(toks, dtype=np.int32)) == keys  # any int sequence


def test_any_earlier_change_changes_every_later_key() -> None:
    toks = list(range(96))
    keys = page_keys(NS, toks)
    for pos in (0, 17, 95):
        t2 = list(toks)
        t2[pos] += 1
        k2 = page_keys(NS, t2)
        first = pos // 16
        assert k2[:first] == keys[:first]
        assert all(a != b for a, b in zip(k2[first:], keys[first:]))


@pytest.mark.parametrize("field,value", [("model_id", "m@2"), ("dtype", "bfloat16"), ("num_layers", 40),
                                         ("kv_heads", 4), ("head_dim", 64), ("tp_rank", 1), ("adapter_id", "lora"),
                                         ("tenant", "b"), ("layer_start", 8)])
def test_namespace_changes_every_key(field: str, value: object) -> None:
    kw = {field: value}
    if field == "tp_rank":
        kw["tp_size"] = 2
    ns2 = dataclasses.replace(NS, **kw)  # type: ignore[arg-type]
    a, b = page_keys(NS, range(64)), page_keys(ns2, range(64))
    assert all(x != y for x, y in zip(a, b))


def test_extra_keys_and_bad_namespace() -> None:
    assert page_keys(NS, range(32), [b"img1", b""]) != page_keys(NS, range(32), [b"img2", b""])
    with pytest.raises(ValueError, match="extra has 1 entries for 2 pages"):
        page_keys(NS, range(32), [b"x"])
    with pytest.raises(ValueError, match="page_tokens must be >= 1"):
        dataclasses.replace(NS, page_tokens=0)
    with pytest.raises(ValueError, match="layer range"):
        dataclasses.replace(NS, layer_start=40)


def test_equal_in_separate_processes() -> None:
    code = ("from kvstore.keys import KeyNamespace, page_keys;"
            "print(page_keys(KeyNamespace('m@1','float16',32,8,128,16), range(48))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": ""}).stdout.strip() for s in (1, 2)}
    assert outs == {page_keys(NS, range(48))[-1].hex()}
