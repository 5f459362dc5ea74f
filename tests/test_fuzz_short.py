"""A short run of scripts/fuzz.py over every target (the script runs them for minutes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "fuzz.py"


@pytest.mark.slow
def test_fuzz_every_decoder_briefly(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = {x["target"]: x for x in json.loads(out.read_text())["results"]}
    assert set(res) == {"ipc", "peer", "superblock", "header"}
    assert res["ipc"]["inputs"] > 100 and res["ipc"]["unanswered"] == 0 and res["ipc"]["unconsumed"] == 0
    assert res["ipc"]["answered"] > 30
    for t in ("peer", "superblock", "header"):
        assert res[t]["inputs"] > 1000 and res[t]["rejected"] > res[t]["inputs"] // 2
    assert max(x["max_rss_mib"] for x in res.values()) < 1024
