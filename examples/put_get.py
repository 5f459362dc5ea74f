"""Save two pages and read them back through the local cache service.

Run against a store whose service is up, e.g. (in two shells):

    mass-ctl kvcache create demo --device /tmp/demo.img --device-size 256MiB --page-size 256KiB --server local
    mass-ctl kvcache connect demo
    python examples/put_get.py demo
"""

import sys

import numpy as np

from kvstore import KVCacheClient

store = sys.argv[1] if len(sys.argv) > 1 else "demo"
with KVCacheClient.connect(store) as c:
    keys = [b"example/page/0", b"example/page/1"]
    pages = [np.full(c.page_size, i, dtype=np.uint8) for i in range(2)]
    print("put:", c.put(keys, pages, wait=True))
    print("leading keys available:", c.lookup(keys))
    with c.get(keys + [b"example/missing"]) as views:
        for k, v in zip(keys, views):
            assert v is not None and bytes(v) == bytes(pages[keys.index(k)])
        print("hits:", views.hits, "of", len(views))
