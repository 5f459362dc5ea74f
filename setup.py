"""Only here to hook the cffi build of kvstore's libaio/atomics helper into setuptools.

Everything else lives in pyproject.toml.
"""
from setuptools import setup

setup(cffi_modules=["kvstore/ioworkers/_aio_build.py:ffibuilder"])
