"""cffi build script for ``kvstore._native._lib``: kvstore's compiled core as one extension.

Compiled out-of-line at install time (``setup.py`` names it in ``cffi_modules``), so
importing kvstore never needs a compiler. The C units (``aio.c``: libaio and shm atomics;
``keys.c``: BLAKE2b key digests and the lock-free index reader; ``worker.c``: an I/O
worker's turn; ``copy.c``: a page copied and checksummed; ``direct.c``: a client's direct
reads posted) compile separately, each
including ``internal.h``, which includes ``kvstore.h``: the one header of every shared
struct and constant. cffi reads the same ``kvstore.h`` for its declarations, so the
structs Python sees (``ffi.offsetof``) and the integer constants it takes
(``LIB.KV_*``) are those the C units were compiled with. ``lib.py`` is the typed wrapper.
"""

from __future__ import annotations

import os
from pathlib import Path

import cffi

HERE = Path(__file__).parent
UNITS = ["aio.c", "keys.c", "worker.c", "copy.c", "direct.c"]

# what cffi needs of libaio.h to parse kvstore.h: the types, opaque
PRELUDE = """
typedef struct io_context *io_context_t;
struct iocb { ...; };
struct io_event { ...; };
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(PRELUDE + (HERE / "kvstore.h").read_text())
ffibuilder.set_source(
    "kvstore._native._lib",
    '#include "internal.h"\n',
    sources=[os.path.relpath(HERE / u) for u in UNITS],  # setuptools wants them relative
    include_dirs=[str(HERE)],
    depends=[str(HERE / h) for h in ("kvstore.h", "internal.h")],
    libraries=["aio", "xxhash"],
    extra_compile_args=["-O2", "-std=gnu11"],
)

if __name__ == "__main__":  # pragma: no cover - manual rebuild: python kvstore/_native/build.py
    ffibuilder.compile(verbose=True)
