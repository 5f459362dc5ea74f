"""Only here to hook kvstore's compiled parts into setuptools.

Everything else lives in pyproject.toml. Both extensions live in ``kvstore/_native``: the
cffi build of the compiled core (``build.py``: libaio, atomics, key digests and index, the
I/O worker's turn, the checksumming copy), and a small CPython extension that checks and
packs client keys (cffi cannot take Python objects).
"""
from setuptools import Extension, setup

setup(
    cffi_modules=["kvstore/_native/build.py:ffibuilder"],
    ext_modules=[Extension("kvstore._native._keypack", ["kvstore/_native/keypack.c"], extra_compile_args=["-O2"])],
)
