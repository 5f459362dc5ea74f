"""Starting mass-ctl in a child Python process so that it imports the installed kvstore.

``python -m`` puts the current directory first on ``sys.path``; started from inside
a source checkout, a child would import the checkout's uncompiled tree (no
``kvstore._native._lib``) instead of the installed package. Children therefore
start in ``/``, with ``PYTHONSAFEPATH`` set and relative ``PYTHONPATH`` entries made
absolute, and are given absolute paths only.
"""

from __future__ import annotations

import os
import sys


def cli_command(*args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], str]:
    """(argv, environment, working directory) to run ``mass-ctl ARGS`` in a child process."""
    e = dict(os.environ if env is None else env)
    e["PYTHONSAFEPATH"] = "1"  # Python 3.11+: no cwd or script directory on sys.path
    if e.get("PYTHONPATH"):
        e["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in e["PYTHONPATH"].split(os.pathsep) if p)
    return [sys.executable, "-m", "kvstore.cli", *args], e, "/"
