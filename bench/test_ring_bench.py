"""pytest-benchmark suite of the ring's Python API, in one process (writer and reader on one thread):
what one record costs in the binding, without a second process, scheduling or cache-line transfers.

    python -m pytest bench/ --benchmark-only                 # bench/ is outside the default testpaths
    python -m pytest bench/ --benchmark-only --benchmark-columns=min,median,ops

Each benchmarked call moves a block of records (256, fewer for 64 KiB payloads: see
extra_info.records_per_call), so the per-record cost is the reported time / records_per_call.  bench/ring.py
measures the same API across two processes against a C loop, multiprocessing.Queue and Pipe.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run as a file from a checkout: its pyruntime first (installed, this is pyruntime/bench and pyruntime is importable)
if os.path.isdir(os.path.join(ROOT, "pyruntime")) and ROOT not in sys.path: sys.path.insert(0, ROOT)

from pyruntime.transport import shm  # noqa: E402
from pyruntime.transport.ring import Arena, RingSpec, record_size  # noqa: E402

PREFIX = "pyruntime-test"
CAPACITY = 1 << 22
BLOCK = 256


def block(size: int) -> int:
  """Records per benchmarked call: BLOCK, or as many as fit in half the ring (one thread writes
  them all before reading any: more would wait for ever)."""
  return min(BLOCK, CAPACITY // 2 // record_size(size))


@pytest.fixture
def ring():
  arena = Arena.create([RingSpec(CAPACITY, 1 << 20, alignment=8)], prefix=PREFIX)
  try:
    yield arena.writer(0), arena.reader(0)
  finally:
    arena.close()
    shm.unlink_quietly(arena.name)


def _per_record(w, r, payload, n):
  write, read = w.write, r.read
  for i in range(n): write(i, payload)  # never waits: n records fit (see block())
  for _ in range(n): read()
  r.release()


@pytest.mark.parametrize("size", [8, 1152, 65536])
def test_write_read_per_record(benchmark, ring, size):
  """Writer.write(bytes) then Reader.read(); one release per BLOCK."""
  w, r = ring
  payload = bytes(size)
  benchmark.extra_info["records_per_call"] = n = block(size)
  benchmark(_per_record, w, r, payload, n)
  assert r.outstanding == 0


@pytest.mark.parametrize("size", [8, 1152])
def test_write_next_record(benchmark, ring, size):
  """Writer.write then Reader.next_record (release + read in one call): the lean per-record loop."""
  w, r = ring
  payload = bytes(size)

  def run():
    write, nxt = w.write, r.next_record
    for i in range(BLOCK):
      write(i, payload)
      nxt()
  benchmark.extra_info["records_per_call"] = BLOCK
  benchmark(run)
  r.release()


@pytest.mark.parametrize("size", [8, 1152])
def test_batch_write_many_read_many(benchmark, ring, size):
  """Writer.write_many(numpy rows) then Reader.read_many() + release(): one C call per side per batch."""
  w, r = ring
  rows = np.zeros((BLOCK, size), np.uint8)
  ids = np.arange(BLOCK, dtype=np.uint64)

  def run():
    w.write_many(ids, rows)
    b = r.read_many(BLOCK)
    r.release()
    return len(b)
  benchmark.extra_info["records_per_call"] = BLOCK
  assert benchmark(run) == BLOCK


@pytest.mark.parametrize("size", [8, 1152, 65536])
def test_reserve_commit(benchmark, ring, size):
  """Zero-copy production: reserve a span in the ring, fill it, commit."""
  w, r = ring
  payload = bytes(size)

  n = block(size)

  def run():
    for i in range(n):
      v = w.reserve(size)
      v[:] = payload
      w.commit(i)
    for _ in range(n): r.read()
    r.release()
  benchmark.extra_info["records_per_call"] = n
  benchmark(run)


@pytest.mark.parametrize("how", ["payload-first-last-byte", "array-sum", "bytes-copy"])
def test_read_view(benchmark, ring, how):
  """Reading 64 KiB payloads: in place through rec.payload (first and last byte), a numpy view
  summed in place (every byte read, nothing copied), or copied out with bytes()."""
  w, r = ring
  size = 65536
  n = block(size)
  for i in range(n): w.write(i, bytes([i & 0xFF]) * size)
  recs = [r.read() for _ in range(n)]

  if how == "payload-first-last-byte":
    def run():
      s = 0
      for rec in recs:
        p = rec.payload
        s += p[0] + p[-1]
      return s
  elif how == "array-sum":
    def run():
      return sum(int(rec.array(np.uint64).sum()) for rec in recs)
  else:
    def run():
      return sum(len(bytes(rec.payload)) for rec in recs)
  benchmark.extra_info["records_per_call"] = n
  benchmark(run)
  r.release()
