import os
import sys

from setuptools import setup

# The ring's C sources live in native/; native/build_ring.py hands them to cffi (pyruntime._ring)
# and describes the optional CPython fast path (pyruntime._ringfast); native/build_graph.py builds
# the CPU's native launch loop (pyruntime._graph).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "native"))
from build_ring import fast_extension  # noqa: E402

setup(cffi_modules=["native/build_ring.py:ffibuilder", "native/build_graph.py:ffibuilder"], ext_modules=[fast_extension()])
