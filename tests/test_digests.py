"""The compiled key digests (kvstore/digests.py over _native/keys.c) are exactly hashlib's BLAKE2b."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.digests import check_keys, key_digests, key_id, salted_words


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=600), max_size=20), st.binary(min_size=1, max_size=64))
def test_batch_digests_equal_hashlib(keys: list[bytes], salt: bytes) -> None:
    ids, words = key_digests(keys, salt)
    assert words is not None and ids.shape == (len(keys), 32) and words.shape == (len(keys), 4)
    for i, k in enumerate(keys):
        want_id = hashlib.blake2b(k, digest_size=32).digest()
        assert bytes(ids[i]) == want_id
        assert words[i].tobytes() == hashlib.blake2b(want_id, digest_size=32, key=salt).digest()
    assert np.array_equal(salted_words(ids, salt), words)  # the service's half gives the same digests


def test_block_boundaries_and_single_key() -> None:
    salt = bytes(range(32))
    for n in (1, 127, 128, 129, 255, 256, 257, 1024):
        k = bytes((i * 7) & 0xFF for i in range(n))
        assert key_id(k) == hashlib.blake2b(k, digest_size=32).digest()
        ids, words = key_digests([k], salt)
        assert words is not None and words[0].tobytes() == hashlib.blake2b(bytes(ids[0]), digest_size=32,
                                                                           key=salt).digest()
    ids, words = key_digests([])
    assert ids.shape == (0, 32) and words is None


def test_large_batch_of_mixed_lengths() -> None:
    """Batches run in chunks of 256 keys, 8 single-block keys per pass and longer keys one by one:
    every key's digest lands at its own index whatever the mix."""
    rng = np.random.default_rng(7)
    keys = [rng.bytes(int(n)) for n in rng.choice([1, 32, 128, 129, 200, 1000], size=700)]
    salt = rng.bytes(32)
    ids, words = key_digests(keys, salt)
    assert words is not None
    for i, k in enumerate(keys):
        want = hashlib.blake2b(k, digest_size=32).digest()
        assert bytes(ids[i]) == want, i
        assert words[i].tobytes() == hashlib.blake2b(want, digest_size=32, key=salt).digest(), i


def test_bad_keys_are_named() -> None:
    with pytest.raises(TypeError, match=r"keys\[1\] must be bytes, got str"):
        check_keys([b"a", "b"])
    with pytest.raises(ValueError, match=r"keys\[2\] is empty"):
        check_keys([b"a", b"b", b""])
    assert check_keys(iter([b"x"])) == [b"x"]
    # the packer the hashing takes its input from checks the same way (it is what lookups use)
    with pytest.raises(TypeError, match=r"keys\[0\] must be bytes, got bytearray"):
        key_digests([bytearray(b"a")])
    with pytest.raises(ValueError, match=r"keys\[1\] is empty"):
        key_digests((b"a", b""), b"salt")
    with pytest.raises(TypeError):
        key_digests(5)  # type: ignore[arg-type]

    class Key(bytes):
        pass

    ids, _ = key_digests((Key(b"k"), b"k"))  # a bytes subclass is bytes
    assert bytes(ids[0]) == bytes(ids[1]) == hashlib.blake2b(b"k", digest_size=32).digest()
