"""The C benchmark loops (native/mo_ring_bench.h) over pyruntime's rings, for bench/ring.py and the
tests.  They are not shipped: pyruntime._ring does not carry them.  This module builds them, with
native/mo_ring.c, into a cffi extension of their own, `_ringbench`, the first time one is needed.

    sys.path.insert(0, "native"); import ringbench          # (a checkout: native/ is not in the wheel)
    with Arena.create([RingSpec(1 << 20, 64)]) as arena:
      with ringbench.Producer(arena, 0) as p, ringbench.Consumer(arena, 0) as c:
        p.produce(1000, 64)                                  # records 0..999, in C, the GIL released
        c.consume(1000)                                      # c.done == 1000, c.bytes == 64000

The extension is compiled into native/build/ringbench-<hash of its sources, build flags and
Python>/ (gitignored) and loaded from there afterwards; load() it before forking, so that the
processes share one build.  It carries its own copy of the ring library, so its handles are its
own: Producer and Consumer claim a side of a ring of a pyruntime Arena, as Writer and Reader do
with pyruntime._ring's copy (the same shared-memory layout: one mo_ring.h).  Close them before
the arena (a with-block inside the arena's).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import cffi
from build_ring import HERE, make_ffi

HEADERS = [HERE / "mo_ring.h", HERE / "mo_ring_bench.h"]  # cdef order: the core declares the types
SOURCES = [HERE / "mo_ring.c", HERE / "mo_ring_bench.c"]
CACHE = HERE / "build"


def build(cache: Path = CACHE) -> Path:
  """The extension built from the sources as they are now: found in `cache`, or compiled there."""
  key = hashlib.sha256(f"{sys.implementation.cache_tag} cffi {cffi.__version__}".encode())
  for p in [*HEADERS, *SOURCES, HERE / "build_ring.py"]: key.update(p.read_bytes())
  out = cache / f"ringbench-{key.hexdigest()[:16]}"
  if found := sorted(out.glob("_ringbench.*")): return found[0]
  out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out) as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout may be --json
    built = Path(make_ffi("_ringbench", HEADERS, SOURCES, relative=False).compile(tmpdir=tmp))
    dest = out / built.name
    os.replace(built, dest)  # atomic: a concurrent build of the same sources leaves the same file
  return dest


@functools.cache
def load():
  """The `_ringbench` module (its ffi and lib), built first if need be."""
  spec = importlib.util.spec_from_file_location("_ringbench", build())
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


class _Side:
  """One side of ring `index` of `arena`, claimed with the extension's own library."""

  SIDE = ""

  def __init__(self, arena, index: int):
    m = load()
    self.ffi, self.lib = ffi, lib = m.ffi, m.lib
    self._base = ffi.from_buffer(arena.buffer())
    self.ring = ffi.new("mo_ring *")
    self.handle = ffi.new(f"mo_{self.SIDE} *")
    st = lib.mo_arena_ring(self._base, arena.size, index, self.ring)
    if st == 0: st = getattr(lib, f"mo_{self.SIDE}_attach")(self.handle, self.ring)
    if st:
      ffi.release(self._base)
      self._fail(f"mo_{self.SIDE}_attach", st)
    self.handle.wait_flags = lib.MO_WAIT_RETURN_ON_POLL  # the loops return MO_INTERRUPTED: signal handlers run
    self._done = ffi.new("uint64_t *")

  @property
  def done(self) -> int:
    """Records written (Producer) or read (Consumer) so far: the next one's object id."""
    return int(self._done[0])

  def _fail(self, what: str, status: int, detail: str = ""):
    raise RuntimeError(f"{what}: {self.ffi.string(self.lib.mo_status_name(status)).decode()}{detail}")

  def close(self) -> None:
    """Close this side (the peer drains, then sees the ring closed) and let go of the arena.  Idempotent."""
    if self._base is None: return
    getattr(self.lib, f"mo_{self.SIDE}_close")(self.handle)
    self.ffi.release(self._base)
    self._base = None

  def __enter__(self): return self
  def __exit__(self, *exc) -> None: self.close()


class Producer(_Side):
  SIDE = "producer"

  def produce(self, n: int, size: int, batch: int = 1, sources: Sequence[bytes] | None = None, shift: int = 0) -> int:
    """mo_bench_produce: records done..n-1 of `size` bytes, object id = the record number, `batch`
    per publish.  Record i's payload is a copy of sources[(i >> shift) % len(sources)] (a
    power-of-two count of buffers of at least `size` bytes), the work Writer.write(bytes) does;
    without sources, a fill in place.  Returns done (== n); RuntimeError names a status that stops it."""
    keep = [self.ffi.from_buffer(b) for b in sources or ()]
    if any(len(b) < size for b in keep): self._fail("mo_bench_produce", self.lib.MO_INVALID_ARGUMENT, f": every source must hold {size} bytes")
    srcs = self.ffi.new("void *[]", keep) if keep else self.ffi.NULL
    run = lambda: self.lib.mo_bench_produce(self.handle, n, size, batch, srcs, len(keep), shift, self._done)  # noqa: E731
    st = run()
    while st == self.lib.MO_INTERRUPTED: st = run()  # signal handlers have run; go on
    if st: self._fail("mo_bench_produce", st)
    return self.done


class Consumer(_Side):
  SIDE = "consumer"

  def __init__(self, arena, index: int):
    super().__init__(arena, index)
    self._bytes = self.ffi.new("uint64_t *")
    self._scratch = None

  @property
  def bytes(self) -> int:
    """Payload bytes read so far."""
    return int(self._bytes[0])

  def consume(self, n: int, batch: int = 1, copy: bool = False) -> bool:
    """mo_bench_consume: read records done..n-1 in batches of up to `batch` (max 256) per read and
    per release, checking that object ids run consecutively; copy each payload out if `copy`
    (else touch one byte in place).  True when n are read, False if the producer closed the ring
    first (everything it published is read); RuntimeError names any other status."""
    if copy and self._scratch is None: self._scratch = self.ffi.new("char[]", min(self.ring.max_extent, self.ring.capacity) or 1)
    scratch = self._scratch if copy else self.ffi.NULL
    run = lambda: self.lib.mo_bench_consume(self.handle, n, batch, scratch, self._done, self._bytes)  # noqa: E731
    st = run()
    while st == self.lib.MO_INTERRUPTED: st = run()
    if st not in (self.lib.MO_OK, self.lib.MO_CLOSED): self._fail("mo_bench_consume", st)
    return st == self.lib.MO_OK
