"""Builders of the ring's two extensions from the real C sources in native/.

`pyruntime._ring` (cffi, API mode): the whole API.  The Python-visible declarations are the
sections of native/mo_ring.h (the ring) and native/mo_ring_extra.h (binding shortcuts, test and
fuzz entry points) between the markers `MO_CDEF_BEGIN` and `MO_CDEF_END`, handed to cffi
verbatim; the library itself is native/mo_ring.c and native/mo_ring_extra.c, compiled into the
extension.  Nothing in C is pasted into this file.

`pyruntime._ringfast` (CPython, optional): the per-record hot calls over the same handles
(native/mo_fast.c, which includes mo_ring.c and mo_ring_extra.c).  When it cannot be built, pyruntime.transport.ring runs on
cffi alone.

The C benchmark loops (native/mo_ring_bench.h) are in neither: native/ringbench.py builds them, with
make_ffi() below, into a cffi extension of their own for bench/ and the tests.

    pip install -e .                  # setup.py names both builders
    python native/build_ring.py       # or build both in place, next to pyruntime/ (for development)
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADERS = [HERE / "mo_ring.h", HERE / "mo_ring_extra.h"]  # cdef order: the core declares the types
SOURCES = [HERE / "mo_ring.c", HERE / "mo_ring_extra.c"]


def cdef_section(header: Path) -> str:
  """The declarations between the MO_CDEF markers of a header (comments included: cffi strips them)."""
  m = re.search(r"(/\*\s*MO_CDEF_BEGIN.*?)/\*\s*MO_CDEF_END\s*\*/", header.read_text(), re.S)
  if not m: raise RuntimeError(f"{header}: no MO_CDEF_BEGIN ... MO_CDEF_END section")
  return m.group(1)


CFLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wno-unused-function"]


def make_ffi(module: str, headers: list[Path], sources: list[Path], relative: bool) -> FFI:
  """A cffi builder of `module`: the cdef sections of `headers` (the last one is #included; it
  includes the others), the library compiled from `sources`."""
  def path(p: Path) -> str:
    if not relative: return str(p)
    try: return os.path.relpath(p)
    except ValueError: return str(p)
  ffi = FFI()
  ffi.cdef("\n".join(cdef_section(h) for h in headers))
  ffi.set_source(
    module,
    f'#include "{headers[-1].name}"\n',
    sources=[path(s) for s in sources],
    include_dirs=[path(HERE)],
    depends=[path(p) for p in headers + sources],
    extra_compile_args=CFLAGS,
  )
  return ffi


def make_builder(relative: bool = True) -> FFI:
  """setuptools wants source paths relative to the project root (the cwd of setup.py);
  ffi.compile() changes directory, so the in-place build uses absolute ones."""
  return make_ffi("pyruntime._ring", HEADERS, SOURCES, relative)  # mo_ring_extra.h includes mo_ring.h


FAST_SOURCE = HERE / "mo_fast.c"


def fast_extension(relative: bool = True):
  """The optional CPython extension: a failed build is a warning, not an error (optional=True)."""
  from setuptools import Extension
  def path(p: Path) -> str: return os.path.relpath(p) if relative else str(p)
  return Extension(
    "pyruntime._ringfast",
    sources=[path(FAST_SOURCE)],
    include_dirs=[path(HERE)],
    depends=[path(p) for p in HEADERS + SOURCES],
    extra_compile_args=[*CFLAGS, "-fvisibility=hidden"],
    optional=True,
  )


def build_fast_inplace(verbose: bool = False) -> Path | None:
  """Build pyruntime/_ringfast*.so next to the package; None (and a message) if that fails."""
  from setuptools import Distribution
  root = HERE.parent
  cwd = os.getcwd()
  os.chdir(root)  # build_ext --inplace resolves the package directory from the cwd
  try:
    dist = Distribution({"name": "pyruntime-ringfast", "ext_modules": [fast_extension(relative=True)]})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True
    dist.verbose = int(verbose)
    dist.run_command("build_ext")
    built = sorted((root / "pyruntime").glob("_ringfast*.so"))
  except Exception as e:  # noqa: BLE001 -- optional: cffi alone still works
    print(f"pyruntime._ringfast not built ({type(e).__name__}: {e}); the ring runs on cffi alone", file=sys.stderr)
    return None
  finally:
    os.chdir(cwd)
  return built[-1] if built else None


def build_inplace(builder: FFI, stem: str, verbose: bool = False) -> Path:
  """Compile a cffi builder (with absolute paths) and put the extension next to the package as pyruntime/STEM.*.so."""
  import shutil
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    built = Path(builder.compile(tmpdir=tmp, verbose=verbose))
    pkg = HERE.parent / "pyruntime"
    for old in pkg.glob(f"{stem}.*.so"): old.unlink()  # a stale build of another ABI tag would shadow ours
    shutil.copy2(built, dest := pkg / built.name)
  return dest


ffibuilder = make_builder()

if __name__ == "__main__":
  print(build_inplace(make_builder(relative=False), "_ring", verbose="-v" in sys.argv))
  fast = build_fast_inplace(verbose="-v" in sys.argv)
  if fast: print(fast)
