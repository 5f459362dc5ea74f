"""A small JSON notice board in shared memory: per-tenant usage for ``status`` and the dashboard.

Layout (docs/FORMAT.md "Notice board"): u64 ``version`` (odd while the writer
is writing), u64 ``length``, then ``length`` bytes of UTF-8 JSON, at most
``BOARD_BYTES - 16``. One writer (the supervisor); readers retry while the
version is odd or changed under them (a seqlock), so they never see a torn text.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .._native.lib import FFI, LIB

BOARD_BYTES = 64 << 10


class Board:
    """Writer and reader views of one board."""

    def __init__(self, buf: Any) -> None:
        self._base = FFI.from_buffer(buf)
        self._version = FFI.cast("uint64_t *", self._base)
        self._words = np.frombuffer(buf, dtype="<u8", count=2)
        self._data = np.frombuffer(buf, dtype=np.uint8, count=BOARD_BYTES - 16, offset=16)

    def write(self, obj: Any) -> None:
        """Publish ``obj`` as JSON (truncated to nothing if it does not fit)."""
        text = json.dumps(obj, sort_keys=True).encode()
        if len(text) > len(self._data):
            text = b"{}"
        v = int(self._version[0])
        LIB.kv_store_release_u64(self._version, v + 1)
        self._data[:len(text)] = np.frombuffer(text, np.uint8)
        self._words[1] = len(text)
        LIB.kv_store_release_u64(self._version, v + 2)

    def read(self, tries: int = 100) -> Any:
        """The last published object, or ``None`` if the writer kept it busy."""
        for _ in range(tries):
            v1 = int(LIB.kv_load_acquire_u64(self._version))
            if v1 % 2:
                continue
            n = int(self._words[1])
            text = self._data[:min(n, len(self._data))].tobytes()
            if int(LIB.kv_load_acquire_u64(self._version)) == v1:
                return json.loads(text) if text else None
        return None
