"""One client process of scripts/bench/compare.py: save or load pages through one system.

    python worker.py SYSTEM OP FIRST COUNT PAGE_SIZE BATCH ARGS_JSON

Prints one JSON line: seconds (the timed part), bytes (only pages actually saved, or
loaded with the right bytes), wrong (pages whose bytes differ), missing (pages a
system did not save or did not return), lat_us (single-page loads, when asked),
max_rss_kib. Page i holds pool[i % 8] with pool[j] seeded by j; every system checks
every loaded byte inside its timed loop (the same cost per byte for all of them).
Loads go in one random order (seeded by FIRST), the same for every system, so that no
system is measured reading its device sequentially while fio reads randomly.
Runs under kvstore's environment (system kvstore, file) or the peers'
environment (redis, mooncake); imports only what its system needs.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np


def pool(ps: int) -> list[np.ndarray]:
    return [np.random.default_rng(j).integers(0, 256, ps, dtype=np.uint8) for j in range(8)]


def barrier() -> None:
    """Tell the parent we are set up, and wait for its go: all clients' timed parts overlap."""
    print("ready", flush=True)
    sys.stdin.readline()


def main() -> None:
    system, op, first, count, ps, batch, args = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]), json.loads(sys.argv[7])
    pages = pool(ps)
    idx = list(range(first, first + count))
    if op == "load":  # the same random order for every system (fio's side is randread)
        np.random.default_rng(first).shuffle(idx)
    out = {"system": system, "op": op, "bytes": 0, "wrong": 0, "missing": 0}
    lat: list[float] = []
    if op == "clear":  # between rounds: drop what the previous round stored
        if system == "redis":
            import redis

            redis.Redis(host="127.0.0.1", port=args["port"]).flushall()
        elif system == "mooncake":
            from mooncake.store import MooncakeDistributedStore

            st = MooncakeDistributedStore()
            st.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{args['port']}")
            st.remove_all()
            st.close()
        print(json.dumps({"cleared": True}))
        return
    if system == "kvstore":
        sys.path.insert(0, args["repo"])
        from kvstore import KVCacheClient

        with KVCacheClient.connect(args["store"], home=args["home"], timeout=120) as c:
            keys = [b"p/%d" % i for i in idx]
            barrier()
            t0 = time.perf_counter()
            if op == "save":
                for s in range(0, count, batch):
                    last = s + batch >= count
                    r = c.put(keys[s:s + batch], [pages[i % 8] for i in idx[s:s + batch]], wait=last)
                    out["missing"] += r.dropped
            else:
                # pipelined (get_many: the next batches are read while this one is checked)
                for s, v in c.get_many(keys):
                    for i, x in zip(idx[s:s + len(v)], v):
                        if x is None:
                            out["missing"] += 1
                        else:
                            out["wrong"] += int(not np.array_equal(np.frombuffer(x, np.uint8), pages[i % 8]))
            out["seconds"] = time.perf_counter() - t0
            if op == "load" and args.get("latency"):
                for i in idx[:args["latency"]]:
                    t = time.perf_counter()
                    with c.get([b"p/%d" % i]):
                        pass
                    lat.append(time.perf_counter() - t)
    elif system.startswith("file"):
        d = args["dir"]
        direct = system == "file-direct"
        flags = os.O_DIRECT if direct else 0
        import mmap

        buf = mmap.mmap(-1, ps)
        barrier()
        t0 = time.perf_counter()
        for i in idx:
            path = f"{d}/{i}"
            if op == "save":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
                if direct:
                    buf[:] = pages[i % 8].tobytes()
                    os.write(fd, buf)
                else:
                    os.write(fd, pages[i % 8])
                os.close(fd)
            else:
                try:
                    fd = os.open(path, os.O_RDONLY | flags)
                except FileNotFoundError:
                    out["missing"] += 1
                    continue
                n = os.readv(fd, [buf])
                os.close(fd)
                if n != ps or not np.array_equal(np.frombuffer(buf, np.uint8), pages[i % 8]):
                    out["wrong"] += 1
        out["seconds"] = time.perf_counter() - t0
        if op == "load" and args.get("latency"):
            for i in idx[:args["latency"]]:
                if args.get("cold"):
                    fd = os.open(f"{d}/{i}", os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                t = time.perf_counter()
                fd = os.open(f"{d}/{i}", os.O_RDONLY | flags)
                os.readv(fd, [buf])
                os.close(fd)
                lat.append(time.perf_counter() - t)
    elif system == "redis":
        import redis

        r = redis.Redis(host="127.0.0.1", port=args["port"])
        r.ping()
        barrier()
        t0 = time.perf_counter()
        for s in range(0, count, batch):
            p = r.pipeline(transaction=False)
            chunk = idx[s:s + batch]
            if op == "save":
                for i in chunk:
                    p.set(b"p/%d" % i, pages[i % 8].tobytes())
                p.execute()
            else:
                for i in chunk:
                    p.get(b"p/%d" % i)
                for i, v in zip(chunk, p.execute()):
                    if v is None:
                        out["missing"] += 1
                    elif v != pages[i % 8].tobytes():
                        out["wrong"] += 1
        out["seconds"] = time.perf_counter() - t0
        if op == "load" and args.get("latency"):
            for i in idx[:args["latency"]]:
                t = time.perf_counter()
                r.get(b"p/%d" % i)
                lat.append(time.perf_counter() - t)
    elif system == "mooncake":
        from mooncake.store import MooncakeDistributedStore

        st = MooncakeDistributedStore()
        rc = st.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{args['port']}")
        if rc != 0:
            raise SystemExit(f"mooncake client setup failed: {rc}")
        nb = min(batch, count)
        area = np.zeros(nb * ps, dtype=np.uint8)
        if st.register_buffer(area.ctypes.data, area.nbytes) != 0:
            raise SystemExit("mooncake register_buffer failed")
        barrier()
        t0 = time.perf_counter()
        for s in range(0, count, nb):
            chunk = idx[s:s + nb]
            ptrs = [area.ctypes.data + j * ps for j in range(len(chunk))]
            keys = ["p/%d" % i for i in chunk]
            if op == "save":
                for j, i in enumerate(chunk):  # the engine's copy into the registered buffer
                    area[j * ps:(j + 1) * ps] = pages[i % 8]
                rs = st.batch_put_from(keys, ptrs, [ps] * len(chunk))
                out["missing"] += sum(1 for x in rs if x != 0)
            else:
                rs = st.batch_get_into(keys, ptrs, [ps] * len(chunk))
                for j, (i, x) in enumerate(zip(chunk, rs)):
                    if x != ps:
                        out["missing"] += 1
                    elif not np.array_equal(area[j * ps:(j + 1) * ps], pages[i % 8]):
                        out["wrong"] += 1
        out["seconds"] = time.perf_counter() - t0
        if op == "load" and args.get("latency"):
            for i in idx[:args["latency"]]:
                t = time.perf_counter()
                st.batch_get_into(["p/%d" % i], [area.ctypes.data], [ps])
                lat.append(time.perf_counter() - t)
        st.close()
    else:
        raise SystemExit(f"unknown system {system}")
    out["bytes"] = (count - out["missing"] - out["wrong"]) * ps  # only what was really saved or loaded
    out["lat_us"] = [x * 1e6 for x in lat]
    out["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
