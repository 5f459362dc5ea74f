"""A short run of scripts/torture.py: churn on two servers with worker kills; zero wrong pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SCRIPT = Path(__file__).parents[2] / "scripts" / "torture.py"


def test_churn_with_faults_returns_no_wrong_page(tmp_path: Path) -> None:
    out = tmp_path / "torture.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--minutes", "0.3", "--servers", "2", "--faults",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())["results"]
    assert rep["wrong"] == 0 and rep["client_failures"] == 0 and rep["leftovers"] == 0
    assert rep["verified"] > 200 and rep["misses"] > 0      # pages were read back, and churn evicted some
    assert rep["evictions"] > 100 and rep["kills"] >= 2 and rep["worker_restarts"] >= 2
