from setuptools import setup

# The ring's C sources live in native/; native/build_ring.py hands them to cffi.
setup(cffi_modules=["native/build_ring.py:ffibuilder"])
