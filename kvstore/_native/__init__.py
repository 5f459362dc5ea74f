"""kvstore's compiled core: the lowest layer, importing nothing else of kvstore.

``kvstore.h`` declares every structure and constant shared between the C units and with
Python, once. The C units (``aio.c``: libaio and shm atomics; ``keys.c``: BLAKE2b key
digests and the lock-free key-index reader; ``worker.c``: one turn of an I/O worker;
``copy.c``: a page copied and checksummed) compile separately into one cffi extension,
``_lib`` (``build.py``); ``lib.py`` is its typed wrapper (``FFI``, ``LIB``, ``const``),
``aio.py`` the libaio context the workers and the start-up scan use. ``keypack.c`` is a
small CPython extension (``_keypack``) that checks and packs client keys in one pass
(cffi cannot take Python objects).
"""

# the compiled core first: in a checkout that was never built, this is the import that fails,
# with the reason and what to do (lib.py), before any other module of the package asks for it
from . import lib as lib  # noqa: E402
