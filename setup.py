"""Build hook: cffi compiles the UCP shim (API mode) at install time."""

from setuptools import setup

setup(cffi_modules=["src/rdma_kv/transport/_build.py:ffibuilder"])
