"""cffi (API mode) builder of `pyruntime._ring` from the real C sources in native/.

The Python-visible declarations are the section of native/mo_ring.h between the markers
`MO_CDEF_BEGIN` and `MO_CDEF_END`, handed to cffi verbatim; the library itself is
native/mo_ring.c, compiled into the extension.  Nothing in C is pasted into this file.

    pip install -e .                  # setup.py names this builder in cffi_modules
    python native/build_ring.py       # or build in place, next to pyruntime/ (for development)
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = HERE / "mo_ring.h"
SOURCE = HERE / "mo_ring.c"


def cdef_section(header_text: str) -> str:
  """The declarations between the MO_CDEF markers of the header (comments included: cffi strips them)."""
  m = re.search(r"(/\*\s*MO_CDEF_BEGIN.*?)/\*\s*MO_CDEF_END\s*\*/", header_text, re.S)
  if not m: raise RuntimeError(f"{HEADER}: no MO_CDEF_BEGIN ... MO_CDEF_END section")
  return m.group(1)


def make_builder(relative: bool = True) -> FFI:
  """setuptools wants source paths relative to the project root (the cwd of setup.py);
  ffi.compile() changes directory, so the in-place build uses absolute ones."""
  def path(p: Path) -> str:
    if not relative: return str(p)
    try: return os.path.relpath(p)
    except ValueError: return str(p)
  ffi = FFI()
  ffi.cdef(cdef_section(HEADER.read_text()))
  ffi.set_source(
    "pyruntime._ring",
    '#include "mo_ring.h"\n',
    sources=[path(SOURCE)],
    include_dirs=[path(HERE)],
    depends=[path(HEADER), path(SOURCE)],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wno-unused-function"],
  )
  return ffi


ffibuilder = make_builder()

if __name__ == "__main__":
  import shutil
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    built = Path(make_builder(relative=False).compile(tmpdir=tmp, verbose="-v" in sys.argv))
    pkg = HERE.parent / "pyruntime"
    for old in pkg.glob("_ring.*.so"): old.unlink()  # a stale build of another ABI tag would shadow ours
    dest = pkg / built.name
    shutil.copy2(built, dest)
  print(dest)
