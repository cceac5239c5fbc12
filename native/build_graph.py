"""Builder of `pyruntime._graph` (cffi, API mode): the native launch loop of native/mo_graph.h (its MO_CDEF section,
handed to cffi verbatim) compiled from native/mo_graph.c. pyruntime/stage/compute/cpu_graph.py runs a CPU stage's captured
graphs on it.

    pip install -e .                  # setup.py names this builder
    python native/build_graph.py      # or build it in place, next to pyruntime/ (for development)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_ring import HERE, build_inplace, make_ffi  # noqa: E402


def make_builder(relative: bool = True):
  return make_ffi("pyruntime._graph", [HERE / "mo_graph.h"], [HERE / "mo_graph.c"], relative)


ffibuilder = make_builder()

if __name__ == "__main__":
  print(build_inplace(make_builder(relative=False), "_graph", verbose="-v" in sys.argv))
