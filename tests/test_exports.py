"""The public API: everything in ``__all__`` is importable and documented (after trio's test)."""

from __future__ import annotations

import inspect

import kvstore


def test_all_is_importable_and_documented() -> None:
    for name in kvstore.__all__:
        obj = getattr(kvstore, name)
        assert inspect.getdoc(obj), f"kvstore.{name} has no docstring"
    public = {n for n, v in vars(kvstore).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public == set(kvstore.__all__)


def test_client_methods_documented() -> None:
    for name, fn in inspect.getmembers(kvstore.KVCacheClient, inspect.isfunction):
        if not name.startswith("_"):
            assert fn.__doc__, f"KVCacheClient.{name} has no docstring"
