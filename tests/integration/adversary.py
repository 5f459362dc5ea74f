"""A hostile local client, stdlib only: it speaks the documented hello, then maps and writes the
shared memory itself (never through ``KVCacheClient``). The tests run it as another Unix user
(``nobody`` in the access group) and as the service's own user with another tenant.

Usage: ``python3 adversary.py SOCKET TENANT ATTACK [SECONDS]``; prints one JSON object.

Everything it knows of the layout is what docs/FORMAT.md says (the offsets are recomputed
here from it, not imported), so the tests also check that the documented format is the one
that runs.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import select
import socket
import stat
import struct
import sys
import threading
import time

SHM = "/dev/shm/"


# ---- just enough msgpack for the hello --------------------------------------------------------
def pack(obj: object) -> bytes:
    if isinstance(obj, dict):
        out = bytes([0x80 | len(obj)])
        for k, v in obj.items():
            out += pack(k) + pack(v)
        return out
    if isinstance(obj, str):
        b = obj.encode()
        return bytes([0xA0 | len(b)]) + b
    if isinstance(obj, int) and 0 <= obj < 128:
        return bytes([obj])
    raise TypeError(type(obj))


def unpack(b: bytes, i: int = 0) -> tuple[object, int]:
    t = b[i]
    if t <= 0x7F:
        return t, i + 1
    if t >= 0xE0:
        return t - 256, i + 1
    if 0x80 <= t <= 0x8F or t in (0xDE, 0xDF):
        if t <= 0x8F:
            n, i = t & 0x0F, i + 1
        elif t == 0xDE:
            n, i = struct.unpack_from(">H", b, i + 1)[0], i + 3
        else:
            n, i = struct.unpack_from(">I", b, i + 1)[0], i + 5
        d = {}
        for _ in range(n):
            k, i = unpack(b, i)
            v, i = unpack(b, i)
            d[k] = v
        return d, i
    if 0x90 <= t <= 0x9F or t in (0xDC, 0xDD):
        if t <= 0x9F:
            n, i = t & 0x0F, i + 1
        elif t == 0xDC:
            n, i = struct.unpack_from(">H", b, i + 1)[0], i + 3
        else:
            n, i = struct.unpack_from(">I", b, i + 1)[0], i + 5
        arr = []
        for _ in range(n):
            v, i = unpack(b, i)
            arr.append(v)
        return arr, i
    if 0xA0 <= t <= 0xBF or t in (0xD9, 0xDA, 0xDB):
        if t <= 0xBF:
            n, i = t & 0x1F, i + 1
        else:
            w = {0xD9: 1, 0xDA: 2, 0xDB: 4}[t]
            n, i = int.from_bytes(b[i + 1:i + 1 + w], "big"), i + 1 + w
        return b[i:i + n].decode(), i + n
    if t in (0xC4, 0xC5, 0xC6):
        w = {0xC4: 1, 0xC5: 2, 0xC6: 4}[t]
        n, i = int.from_bytes(b[i + 1:i + 1 + w], "big"), i + 1 + w
        return bytes(b[i:i + n]), i + n
    if t in (0xCC, 0xCD, 0xCE, 0xCF):
        w = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}[t]
        return int.from_bytes(b[i + 1:i + 1 + w], "big"), i + 1 + w
    if t in (0xD0, 0xD1, 0xD2, 0xD3):
        w = {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}[t]
        return int.from_bytes(b[i + 1:i + 1 + w], "big", signed=True), i + 1 + w
    if t == 0xC0:
        return None, i + 1
    if t in (0xC2, 0xC3):
        return t == 0xC3, i + 1
    raise ValueError(f"msgpack type {t:#x}")


def hello(path: str, tenant: str) -> tuple[socket.socket, dict, list[int]]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    # KVS_HELLO_V=3 speaks to a service of the previous version (to show what it let through)
    body = pack({"v": int(os.environ.get("KVS_HELLO_V", "6")), "op": "hello", "tenant": tenant})
    s.sendall(struct.pack("<I", len(body)) + body)
    head, fds, _flags, _addr = socket.recv_fds(s, 1 << 17, 4)  # the segment comes as a descriptor
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (n,) = struct.unpack_from("<I", head)
    data = head[4:]
    while len(data) < n:
        data += s.recv(n - len(data))
    msg, _ = unpack(data)
    assert isinstance(msg, dict)
    return s, msg, list(fds)


# ---- the layout, as docs/FORMAT.md gives it --------------------------------------------------
def r64(n: int) -> int:
    return (n + 63) // 64 * 64


def pow2(n: int) -> int:
    c = 1
    while c < n:
        c *= 2
    return c


class Conn:
    """Offsets of one connection segment (docs/FORMAT.md "Connection segment")."""

    def __init__(self, mb: int, ndev: int) -> None:
        self.req_ring = 0
        o = r64(128 + 8 * 16)
        o += 8 * r64(64 + mb * (32 + 12 + 8))
        o += r64(8 * 37)
        cap = pow2(2 * mb)
        self.cap = cap
        self.direct = []
        for _ in range(ndev):
            self.direct.append(o)
            o += r64(128 + cap * 64)
        self.pins = o
        o += r64(8 * mb)
        self.dseq = o
        o += r64(8 * mb)
        self.ddev = o
        o += r64(4 * mb)
        self.wstat = o
        o += r64(4 * mb)
        self.wseq = o


def open_map(name: str, write: bool) -> tuple[mmap.mmap | None, str]:
    """Map a segment, as writable as asked; (None, why) when the kernel refuses."""
    try:
        fd = os.open(SHM + name, os.O_RDWR if write else os.O_RDONLY)
    except OSError as e:
        return None, e.strerror or str(e)
    try:
        size = os.fstat(fd).st_size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, size, prot=prot), ""
    finally:
        os.close(fd)


def u64(m: mmap.mmap, off: int) -> int:
    return struct.unpack_from("<Q", m, off)[0]


def put64(m: mmap.mmap, off: int, v: int) -> None:
    struct.pack_into("<Q", m, off, v & ((1 << 64) - 1))


def slot_table(ctl: mmap.mmap, n: int) -> list[tuple[int, int, bytes, int, int]]:
    """(gid, gen, digest, length, state) of every slot."""
    out = []
    for g in range(n):
        gen, d0, d1, d2, d3, length, state = struct.unpack_from("<QQQQQIB", ctl, 48 * g)
        out.append((g, gen, struct.pack("<QQQQ", d0, d1, d2, d3), length, state))
    return out


def locate(areas: list[list[int]], gid: int) -> tuple[int, int, int]:
    for dev, counts in enumerate(areas):
        for area, c in enumerate(counts):
            if gid < c:
                return dev, area, gid
            gid -= c
    raise IndexError(gid)


def closed_by_service(s: socket.socket, wait_s: float) -> bool:
    """Whether the service closed our socket within ``wait_s``."""
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


# ---- attacks ----------------------------------------------------------------------------------
def post_reads(m: mmap.mmap, lay: Conn, dev: int, recs: list[tuple[int, int, int, int, bytes]],
               gen: int, states_off: int) -> list[int]:
    """Post direct reads (buf, area, slot, gen, 32-byte id) as the protocol says; the seqs."""
    ring = lay.direct[dev]
    tail = u64(m, ring + 64)
    seqs = []
    for j, (b, area, slot, g, ident) in enumerate(recs):
        seq = 1000 + j
        struct.pack_into("<Q", m, lay.dseq + 8 * b, seq)
        struct.pack_into("<q", m, lay.pins + 8 * b, -1)
        # hand the buffer over: DIRECT tagged with our generation (its state word is in our segment)
        struct.pack_into("<I", m, states_off + 4 * b, 4 | (gen & 0xFFFFFF) << 8)
        rec = struct.pack("<QHHIQQ", seq, b, area, 0, slot, g) + ident
        off = ring + 128 + ((tail + j) % lay.cap) * 64
        m[off:off + 64] = rec
        seqs.append(seq)
    put64(m, ring + 64, tail + len(recs))
    return seqs


def results(m: mmap.mmap, lay: Conn, bufs: list[int], seqs: list[int], wait_s: float) -> list[int | None]:
    deadline = time.monotonic() + wait_s
    out: list[int | None] = [None] * len(bufs)
    while time.monotonic() < deadline and None in out:
        for j, b in enumerate(bufs):
            if out[j] is None and u64(m, lay.wseq + 8 * b) == seqs[j]:
                out[j] = struct.unpack_from("<i", m, lay.wstat + 4 * b)[0]
        time.sleep(0.01)
    return out


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def steal_wakes(prefix: str, own_sem: str, seconds: float) -> dict:
    """Wait, for ``seconds``, on each wake-up under /dev/shm named for this service that opens
    for waiting; count what was taken."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sem_open.restype = ctypes.c_void_p
    libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    names = sorted(n for n in os.listdir(SHM) if n.startswith(prefix) or n.startswith("sem." + prefix))
    seen, waitable, refused = [], [], {}
    stolen = [0]
    lock = threading.Lock()
    end = time.monotonic() + seconds
    threads = []

    def on_sem(sem: int) -> None:
        while time.monotonic() < end:
            t = time.clock_gettime(time.CLOCK_REALTIME) + 0.01
            ts = _Timespec(int(t), int((t % 1) * 1e9))
            if libc.sem_timedwait(sem, ctypes.byref(ts)) == 0:
                with lock:
                    stolen[0] += 1

    def on_fifo(fd: int) -> None:
        p = select.poll()
        p.register(fd, select.POLLIN)
        while time.monotonic() < end:
            if p.poll(10):
                try:
                    got = len(os.read(fd, 65536))
                except BlockingIOError:
                    continue
                with lock:
                    stolen[0] += got
        os.close(fd)

    for n in names:
        try:
            st = os.stat(SHM + n)
        except FileNotFoundError:
            continue
        if n.startswith("sem."):
            if n == "sem." + own_sem:
                continue
            seen.append(n)
            sem = libc.sem_open(("/" + n[4:]).encode(), 0)
            if not sem:
                refused[n] = os.strerror(ctypes.get_errno())
                continue
            waitable.append(n)
            threads.append(threading.Thread(target=on_sem, args=(sem,), daemon=True))
        elif stat.S_ISFIFO(st.st_mode):
            seen.append(n)
            for flags in (os.O_RDONLY, os.O_RDWR):
                try:
                    fd = os.open(SHM + n, flags | os.O_NONBLOCK)
                except OSError as e:
                    refused[n] = e.strerror or str(e)
                    continue
                waitable.append(n)
                threads.append(threading.Thread(target=on_fifo, args=(fd,), daemon=True))
                break
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 5)
    time.sleep(max(0.0, end - time.monotonic()))  # the attack lasts its time, stolen or not
    return {"wakes_seen": seen, "wakes_waitable": waitable, "wakes_refused": refused, "stolen": stolen[0]}


def main() -> None:
    path, tenant, attack = sys.argv[1], sys.argv[2], sys.argv[3]
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 3.0
    s, h, fds = hello(path, tenant)
    rep: dict = {"ok": h.get("ok"), "error": h.get("error")}
    if not h.get("ok"):
        print(json.dumps(rep))
        return
    areas = h["areas"]
    nslots = h["slots"]
    mb, gen = h["max_batch"], h["generation"]
    lay = Conn(mb, len(areas))
    assert len(fds) in (1, 2), fds  # the segment, and (version 4) this client's own wake-up
    seg = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
    for fd in fds:
        os.close(fd)
    ctl_rw, ctl_why = open_map(h["control"], True)
    rep["control_writable"] = ctl_rw is not None
    ctl, _ = open_map(h["control"], False)
    assert ctl is not None
    prefix = h["segment"][:-len("c%d" % h["client_id"])]
    for what in ("w0", "sync"):
        m, why = open_map(prefix + what, True)
        rep[f"{what}_writable"] = m is not None
    # every other connection's segment (its rings, descriptors, buffers): can we open one?
    rep["other_connections_readable"] = sum(
        1 for i in range(h["max_clients"])
        if i != h["client_id"] and os.path.exists(SHM + prefix + f"c{i}") and open_map(prefix + f"c{i}", False)[0])
    rep["other_connections_seen"] = sum(1 for i in range(h["max_clients"])
                                        if i != h["client_id"] and os.path.exists(SHM + prefix + f"c{i}"))
    rep["salt"] = h["salt"].hex()
    table = slot_table(ctl, nslots)
    valid = [e for e in table if e[4] == 2]
    rep["valid_seen"] = len(valid)

    if attack == "steal":
        # the first version's attack: name each slot with the digest the slot table shows
        pick = valid[:min(8, mb)]
        recs = []
        for j, (g, sgen, digest, _length, _st) in enumerate(pick):
            dev, area, slot = locate(areas, g)
            recs.append((j, area, slot, sgen, digest))
        seqs = post_reads(seg, lay, 0, recs, gen, h["states_offset"])
        got = results(seg, lay, list(range(len(recs))), seqs, seconds)
        rep["statuses"] = got
        rep["hits"] = sum(1 for x in got if x == 0)
        rep["disconnected"] = closed_by_service(s, seconds)
    elif attack == "lie":
        # the right generation, the digest with one bit flipped: a read that must fail, aimed at
        # deleting the page (a failed validation used to be taken as evidence against the slot)
        pick = valid[:min(mb, 100)]
        recs = []
        for j, (g, sgen, digest, _length, _st) in enumerate(pick):
            dev, area, slot = locate(areas, g)
            recs.append((j, area, slot, sgen, bytes([digest[0] ^ 1]) + digest[1:]))
        seqs = post_reads(seg, lay, 0, recs, gen, h["states_offset"])
        got = results(seg, lay, list(range(len(recs))), seqs, seconds)
        rep["statuses"] = got
        rep["hits"] = sum(1 for x in got if x == 0)
        rep["disconnected"] = closed_by_service(s, seconds)
    elif attack == "tails":
        # impossible tails on every ring we write, then sit still holding the connection
        for ring in lay.direct:
            put64(seg, ring + 64, u64(seg, ring) + (1 << 62))
        put64(seg, lay.req_ring + 64, u64(seg, lay.req_ring) + (1 << 62))
        rep["disconnected"] = closed_by_service(s, seconds)
    elif attack == "hold":
        # mark the whole lease as being read (and some quarantined), then leave
        off = h["states_offset"]
        for b in range(mb):
            state = 3 if b % 4 == 0 else 5 | (gen & 0xFFFFFF) << 8
            struct.pack_into("<I", seg, off + 4 * b, state)
        for b in range(mb):
            struct.pack_into("<q", seg, lay.pins + 8 * b, b % max(1, nslots))
        s.close()
        rep["left"] = True
    elif attack == "pinall":
        # name every slot of the store in our pin words and sit there (the first version's
        # service kept every slot so named from reuse: another tenant's writes stopped)
        for b in range(mb):
            struct.pack_into("<q", seg, lay.pins + 8 * b, b % max(1, nslots))
        rep["disconnected"] = closed_by_service(s, seconds)
    elif attack == "wakes":
        # wait on every wake-up of this service we can open for waiting, and so take the wake-ups
        # meant for the supervisor, the I/O workers and the other clients: a version-3 service's
        # named semaphores (group read-write), or the read end of a FIFO
        rep.update(steal_wakes(prefix, h.get("sem", ""), seconds))
        rep["disconnected"] = closed_by_service(s, 0.1)
    elif attack == "idle":
        rep["disconnected"] = closed_by_service(s, seconds)
    else:
        raise SystemExit(f"unknown attack {attack}")
    print(json.dumps(rep))


if __name__ == "__main__":
    main()
