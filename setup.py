"""Only here to hook kvstore's compiled parts into setuptools.

Everything else lives in pyproject.toml. Two extensions: the cffi build of the
libaio/atomics/hashing helper, and a small CPython extension that checks and
packs client keys (cffi cannot take Python objects).
"""
from setuptools import Extension, setup

setup(
    cffi_modules=["kvstore/ioworkers/_aio_build.py:ffibuilder"],
    ext_modules=[Extension("kvstore._keypack", ["kvstore/_keypack.c"], extra_compile_args=["-O2"])],
)
