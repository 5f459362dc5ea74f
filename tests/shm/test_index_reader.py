"""The lock-free index reader (clients' lookups) against the writer's own lookup, and against a
writer that rebuilds the table under it in another process."""

from __future__ import annotations

import mmap
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.digests import key_digests, pack_keys
from kvstore.shm.control import ControlLayout
from kvstore.shm.index import IndexReader, KeyIndex
from kvstore.shm.slots import RETIRED, VALID

from .test_index import words_of

N = 64


def _fill(slots: np.ndarray, gid: int, w: np.ndarray) -> None:
    slots[gid]["d0"], slots[gid]["d1"], slots[gid]["d2"], slots[gid]["d3"] = (int(x) for x in w)
    slots[gid]["state"] = VALID


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ins", "retire", "rebuild"]), st.integers(0, N - 1)), max_size=150),
       st.booleans())
def test_reader_agrees_with_the_writer(ops: list[tuple[str, int]], collide: bool) -> None:
    lay = ControlLayout.of(N)
    buf = bytearray(lay.nbytes)
    slots = lay.slot_table(buf)
    ix = KeyIndex(lay.index_entries(buf), slots, init=True, seq=lay.index_seq(buf))
    reader = IndexReader(lay.index_seq(buf), lay.index_entries(buf), slots, lay.ref_bits(buf))
    for op, k in ops:
        if op == "ins" and slots[k]["state"] != VALID:
            _fill(slots, k, words_of(k, collide))
            ix.insert(words_of(k, collide), k)
        elif op == "retire":
            slots[k]["state"] = RETIRED
        elif op == "rebuild":
            ix.rebuild()
    allw = np.stack([words_of(k, collide) for k in range(N)])
    got = reader.lookup(allw)
    assert got is not None
    assert np.array_equal(got, ix.lookup(allw))
    # a hit sets the slot's CLOCK reference bit, and only a hit does
    assert np.array_equal(lay.ref_bits(buf) == 1, np.isin(np.arange(N), got[got >= 0]))
    assert lay.index_seq(buf)[0] == 2 * ix.rebuilds  # even: no rebuild in progress


SALT = b"tenant salt 0123"


@settings(max_examples=120, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=0, max_size=150, unique=True),
       st.lists(st.booleans(), min_size=150, max_size=150))
def test_one_pass_lookup_of_keys_agrees_with_digests_then_lookup(keys: list[bytes], stored: list[bool]) -> None:
    """``lookup_keys`` (hashing and probing in one pipelined pass) against the two steps it fuses,
    for keys of every length (one block, several blocks), batches that are not whole groups, and
    the prefix mode that stops after the first miss."""
    n_slots = max(len(keys), 1)
    lay = ControlLayout.of(n_slots)
    buf = bytearray(lay.nbytes)
    slots = lay.slot_table(buf)
    ix = KeyIndex(lay.index_entries(buf), slots, init=True, seq=lay.index_seq(buf))
    _, words = key_digests(keys, SALT)
    assert words is not None
    gid = 0
    for k in range(len(keys)):
        if stored[k]:
            _fill(slots, gid, words[k])
            ix.insert(words[k], gid)
            gid += 1
    reader = IndexReader(lay.index_seq(buf), lay.index_entries(buf), slots)
    want = reader.lookup(words)
    assert want is not None
    blob, lens = pack_keys(keys)
    got = reader.lookup_keys(blob, lens, SALT)
    assert got is not None
    assert got[1] == len(keys) and np.array_equal(got[0], want)
    first_miss = int(np.argmin(want >= 0)) if not (want >= 0).all() else len(keys)
    got = reader.lookup_keys(blob, lens, SALT, prefix=True)
    assert got is not None
    out, done = got
    assert min(first_miss + 1, len(keys)) <= done <= len(keys)
    assert np.array_equal(out[:done], want[:done]) and (out[done:] == -1).all()
    # another tenant's salt finds none of them
    other = reader.lookup_keys(blob, lens, b"another salt")
    assert other is not None and (other[0] < 0).all()


def _rebuild_forever(buf: mmap.mmap, lay: ControlLayout) -> None:
    slots = lay.slot_table(buf)
    ix = KeyIndex(lay.index_entries(buf), slots, init=False, seq=lay.index_seq(buf))
    while True:
        ix.rebuild()
        time.sleep(0.002)  # rebuilds back to back would starve every reader (they are rare in a service)


@pytest.mark.parametrize("one_pass", [False, True], ids=["digests-then-probe", "one-pass-keys"])
def test_rebuild_in_another_process_never_shows_as_a_miss(one_pass: bool) -> None:
    """The adversary: a writer process that does little but rebuild the table (each rebuild
    empties it, then refills it). A reader must never report a present key missing, through the
    probe of digests or the one-pass lookup of keys (full and prefix); the same reader without
    the seqlock does (so the race is really there)."""
    n = 20_000
    lay = ControlLayout.of(n)
    buf = mmap.mmap(-1, lay.nbytes)  # MAP_SHARED|MAP_ANONYMOUS: shared with the child
    slots = lay.slot_table(buf)
    keys = [b"key/%d" % i for i in range(n)]
    _, words = key_digests(keys, SALT)
    assert words is not None
    slots["d0"], slots["d1"], slots["d2"], slots["d3"] = words.T
    slots["state"] = VALID
    KeyIndex(lay.index_entries(buf), slots, init=True, seq=lay.index_seq(buf)).rebuild()
    reader = IndexReader(lay.index_seq(buf), lay.index_entries(buf), slots)
    unguarded = IndexReader(np.zeros(1, "<u8"), lay.index_entries(buf), slots)  # a seq that never moves
    # the one-pass path hashes what it looks up: a fifth of the keys keeps a lookup about as long
    # as the other path's probe of all of them (a lookup of all 20,000, ~1.5 ms, overlaps most of
    # the adversary's rebuilds, which come every ~2 ms, and gives up too often to answer 20 times)
    asked = n // 5
    blob, lens = pack_keys(keys[:asked])

    def look(r: IndexReader, prefix: bool) -> np.ndarray | None:
        if not one_pass:
            return r.lookup(words)
        got = r.lookup_keys(blob, lens, SALT, prefix=prefix)
        if got is None:
            return None
        assert got[1] == asked  # every key present: a prefix lookup goes to the end too
        return got[0]

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _rebuild_forever(buf, lay)
        finally:
            os._exit(0)
    try:
        seen_unguarded_miss = False
        answered = gave_up = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (seen_unguarded_miss and answered >= 20):
            got = look(reader, answered % 2 == 1)
            if got is None:
                gave_up += 1
            else:
                answered += 1
                assert (got >= 0).all(), f"{int((got < 0).sum())} present keys reported missing"
            u = look(unguarded, False)
            assert u is not None
            seen_unguarded_miss |= bool((u < 0).any())
        assert seen_unguarded_miss, "the rebuild never overlapped a lookup: the test proves nothing"
        assert answered >= 20, (answered, gave_up)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _churn_forever(buf: mmap.mmap, lay: ControlLayout, first: int, count: Any) -> None:
    """The supervisor's side of eviction churn: retire slots and fill them with new keys, indexing
    each one (inserts reuse garbage entries, also on the probe paths of keys that stay)."""
    slots = lay.slot_table(buf)
    ix = KeyIndex(lay.index_entries(buf), slots, init=False, seq=lay.index_seq(buf))
    rng = np.random.default_rng(os.getpid())
    n = 0
    while True:
        gid = int(rng.integers(first, len(slots)))
        if slots[gid]["state"] == VALID:
            slots[gid]["state"] = RETIRED
        else:
            w = rng.integers(0, 2**64, 4, dtype=np.uint64, endpoint=False)
            _fill(slots, gid, w)  # the slot holds the key before its entry is published
            ix.insert(w, gid)
        n += 1
        count[0] = n


def test_inserts_in_another_process_never_hide_a_present_key() -> None:
    """The adversary: a writer process retiring and refilling slots as fast as it can, each refill
    an insert that may take a garbage entry on a present key's probe path (or rebuild the table at
    3/4 use). A reader looking up the keys that stay must find every one, every time."""
    n, stable = 4096, 1024
    lay = ControlLayout.of(n)
    buf = mmap.mmap(-1, lay.nbytes)
    slots = lay.slot_table(buf)
    ix = KeyIndex(lay.index_entries(buf), slots, init=True, seq=lay.index_seq(buf))
    words = np.stack([words_of(k, False) for k in range(stable)])
    for k in range(stable):
        _fill(slots, k, words[k])
    ix.index_slots(np.arange(stable))
    count = np.frombuffer(mmap.mmap(-1, 8), dtype=np.uint64)
    reader = IndexReader(lay.index_seq(buf), lay.index_entries(buf), slots)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _churn_forever(buf, lay, stable, count)
        finally:
            os._exit(0)
    try:
        answered = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            got = reader.lookup(words)
            if got is not None:
                answered += 1
                assert np.array_equal(got, np.arange(stable)), f"{int((got < 0).sum())} present keys missing"
        assert answered > 100 and int(count[0]) > 10_000, (answered, int(count[0]))  # both really ran
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
