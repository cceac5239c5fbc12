"""Two-process stress of the MO01 ring: >= 10^6 records of random sizes through a small ring (wrap-around
and back-pressure all the time), every record checked: 0 lost, duplicated, reordered or corrupted.

Record j (j = 0, 1, ...) is fully determined by j and a seed, on both sides: its length (0..MAX_EXTENT,
a multiple of the ring's alignment; zero and maximal lengths are frequent) and its payload (a slice of
a seeded random pool).  The producer sends object_id = j << 32 | crc32(payload) and flags derived from j;
the consumer checks the ring's sequence (== j), the object id (j, and the crc32 of the payload it
received), the extent, the flags, and every 512th payload byte for byte against the pool.

The producer is a forked child using the Python Writer API (write with bytes and with memoryviews,
reserve/commit, deferred commits, write_many); the consumer is this process using the Python Reader API
(next_record, read + release in groups, read_many batches).  `--long` runs 10^7 records.
"""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback
import zlib

import numpy as np
import pytest

from pyruntime import errors
from pyruntime.transport.ring import Arena, RingSpec

pytestmark = pytest.mark.usefixtures("ring_binding")  # every test over both bindings (tests/conftest.py)

PREFIX = "pyruntime-test"
CAPACITY = 1 << 15      # 32 KiB: about 30 records of average size, a wrap every ~30 records
MAX_EXTENT = 2048
ALIGN = 4               # extents are multiples of 4; records are padded to 8, so half of them carry padding
POOL_BYTES = 1 << 20
CHUNK = 1 << 14         # records per plan chunk (and per API mode switch on both sides)
CTX = mp.get_context("fork")




# --- the deterministic plan ------------------------------------------------------------------------
def make_pool(seed: int) -> bytes:
  return np.random.default_rng([seed, 0xB001]).integers(0, 256, POOL_BYTES, dtype=np.uint8).tobytes()


def plan(seed: int, chunk: int) -> tuple[list[int], list[int]]:
  """Lengths and pool offsets of records chunk*CHUNK .. (chunk+1)*CHUNK-1."""
  rng = np.random.default_rng([seed, chunk])
  units = MAX_EXTENT // ALIGN
  lengths = rng.integers(0, units + 1, CHUNK) * ALIGN
  edge = rng.random(CHUNK)
  lengths[edge < 0.05] = 0
  lengths[(edge >= 0.05) & (edge < 0.10)] = MAX_EXTENT
  lengths[(edge >= 0.10) & (edge < 0.15)] = rng.integers(1, 4, int(((edge >= 0.10) & (edge < 0.15)).sum())) * ALIGN  # tiny
  offsets = rng.integers(0, POOL_BYTES - MAX_EXTENT, CHUNK)
  return lengths.tolist(), offsets.tolist()


def flags_of(j: int) -> int:
  return (j * 2654435761) & 0xFFFFFFFF if j % 3 == 0 else 0


# --- producer (child process) ------------------------------------------------------------------------
def produce(name: str, n: int, seed: int, batched: bool) -> int:
  """Write records 0..n-1, switching Writer APIs per chunk; returns the count written."""
  pool = make_pool(seed)
  pool_mv = memoryview(pool)
  crc32 = zlib.crc32
  with Arena.attach(name) as arena:
    w = arena.writer(0)
    write = w.write
    j = 0
    for chunk in range((n + CHUNK - 1) // CHUNK):
      lengths, offsets = plan(seed, chunk)
      stop = min(CHUNK, n - j)
      mode = "batch" if batched else ("mixed", "write", "mixed", "batch")[chunk % 4]
      if mode == "write":  # the 4-argument fast path (bytes, flags 0) and the general one
        for k in range(stop):
          off = offsets[k]
          payload = pool[off:off + lengths[k]]
          write(j << 32 | crc32(payload), payload, flags_of(j))
          j += 1
      elif mode == "mixed":  # every Writer API, chosen per record
        for k in range(stop):
          off, ln = offsets[k], lengths[k]
          payload = pool[off:off + ln]
          oid, fl = j << 32 | crc32(payload), flags_of(j)
          how = j % 8
          if how < 4:
            write(oid, payload, fl)
          elif how == 4:
            write(oid, pool_mv[off:off + ln], fl, timeout=30.0)  # a memoryview, a timeout
          elif how == 5:
            view = w.reserve(ln)
            view[:] = payload
            w.commit(oid, fl)
          elif how == 6:  # deferred: published by the next publishing call (or by waiting for space)
            view = w.reserve(ln, timeout=30.0)
            view[:] = payload
            w.commit(oid, fl, publish=False)
          else:
            if j % 16 == 7:  # a reservation dropped: must leave no trace
              v = w.reserve(min(ln + ALIGN, MAX_EXTENT))
              v[:4] = b"JUNK"
              w.abort()
            w.write(oid, np.frombuffer(payload, dtype=np.uint8), fl)  # a numpy array
            w.publish()
          j += 1
      else:  # write_many: one buffer + lengths (via a list of payloads), ids and flags per record
        k = 0
        while k < stop:
          m = min(stop - k, 1 + (j * 7919) % 97)
          payloads = [pool[offsets[i]:offsets[i] + lengths[i]] for i in range(k, k + m)]
          ids = [(j + i) << 32 | crc32(p) for i, p in enumerate(payloads)]
          fls = [flags_of(j + i) for i in range(m)]
          seq = w.write_many(ids, payloads, fls)
          if seq != j: raise AssertionError(f"write_many returned sequence {seq}, expected {j}")
          j += m
          k += m
    w.close()
  return j


def _child(name: str, n: int, seed: int, batched: bool, tx) -> None:
  try:
    tx.send(("ok", produce(name, n, seed, batched)))
  except BaseException:
    tx.send(("err", traceback.format_exc()))
  finally:
    tx.close()


# --- consumer (this process) ---------------------------------------------------------------------
class Checker:
  def __init__(self, seed: int):
    self.seed = seed
    self.pool = make_pool(seed)
    self.chunk = -1
    self.lengths: list[int] = []
    self.offsets: list[int] = []
    self.compared = 0

  def check(self, j: int, object_id: int, sequence: int, extent: int, flags: int, payload) -> None:
    c, k = divmod(j, CHUNK)
    if c != self.chunk:
      self.lengths, self.offsets = plan(self.seed, c)
      self.chunk = c
    ln = self.lengths[k]
    if sequence != j or object_id >> 32 != j:
      raise AssertionError(f"record {j}: sequence {sequence}, object id names record {object_id >> 32} (lost/duplicated/reordered)")
    if extent != ln: raise AssertionError(f"record {j}: extent {extent}, expected {ln}")
    if flags != flags_of(j): raise AssertionError(f"record {j}: flags {flags:#x}, expected {flags_of(j):#x}")
    if zlib.crc32(payload) != object_id & 0xFFFFFFFF: raise AssertionError(f"record {j}: payload corrupted (crc32 mismatch)")
    if j % 512 == 0:
      off = self.offsets[k]
      if bytes(payload) != self.pool[off:off + ln]: raise AssertionError(f"record {j}: payload differs from the pool")
      self.compared += 1


def consume(r, n: int, checker: Checker, batched: bool, timeout: float = 30.0) -> int:
  """Read until RingClosed, switching Reader APIs per chunk; returns the count."""
  j = 0
  check = checker.check
  try:
    while True:
      mode = "batch" if batched else ("next", "group", "batch")[(j // CHUNK) % 3]
      end = (j // CHUNK + 1) * CHUNK
      if mode == "next":
        while j < end:
          rec = r.next_record(timeout)
          check(j, rec.object_id, rec.sequence, rec.extent, rec.flags, rec.payload)
          j += 1
      elif mode == "group":  # read a few, then release them with one store
        while j < end:
          g = 1 + j % 5
          for _ in range(g):
            rec = r.read(timeout)
            check(j, rec.object_id, rec.sequence, rec.extent, rec.flags, rec.payload)
            j += 1
          r.release()
      else:
        while j < end:
          b = r.read_many(64, timeout)
          ids, seqs, exts, fls = b.object_id.tolist(), b.sequence.tolist(), b.extent.tolist(), b.flags.tolist()
          for i, p in enumerate(b.payloads()):
            check(j, ids[i], seqs[i], exts[i], fls[i], p)
            j += 1
          r.release()
  except errors.RingClosed:
    pass
  return j


def stress(n: int, seed: int, batched: bool = False) -> None:
  arena = Arena.create([RingSpec(CAPACITY, MAX_EXTENT, ALIGN)], prefix=PREFIX)
  proc = None
  rx = None
  try:
    r = arena.reader(0)
    rx, tx = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_child, args=(arena.name, n, seed, batched, tx), daemon=True)
    proc.start()
    tx.close()
    checker = Checker(seed)
    t0 = time.monotonic()
    got = consume(r, n, checker, batched)
    secs = time.monotonic() - t0
    if not rx.poll(30): raise AssertionError("the producer did not report")
    status, val = rx.recv()
    if status != "ok": raise AssertionError(f"producer failed:\n{val}")
    assert val == n, f"producer wrote {val} records, expected {n}"
    assert got == n, f"consumer got {got} records, producer wrote {n}"
    assert r.expected_sequence == n
    assert checker.compared >= n // 512
    laps = arena.state(0)["head"] // CAPACITY
    assert laps > n // 100, f"only {laps} wrap-arounds"  # ~1 KiB average records through a 32 KiB ring
    print(f"{n} records in {secs:.1f} s ({n / secs:,.0f}/s)")
  finally:
    if proc is not None:
      proc.join(5)
      if proc.is_alive():
        proc.kill()
        proc.join()
    if rx is not None: rx.close()
    arena.close()


def test_stress_every_api_1e6():
  stress(1_000_000, seed=1)


def test_stress_batches_1e6():
  stress(1_000_000, seed=2, batched=True)


@pytest.mark.long
def test_stress_every_api_1e7():
  stress(10_000_000, seed=3)


def test_stress_detects_corruption():
  """The checks can fail: a producer that skips a record's payload bytes is caught."""
  checker = Checker(seed=1)
  lengths, offsets = plan(1, 0)
  k = next(i for i, ln in enumerate(lengths) if ln >= 8)
  payload = bytearray(make_pool(1)[offsets[k]:offsets[k] + lengths[k]])
  oid = k << 32 | zlib.crc32(payload)
  checker.check(k, oid, k, lengths[k], flags_of(k), payload)  # as sent: fine
  payload[3] ^= 1
  with pytest.raises(AssertionError, match="crc32"): checker.check(k, oid, k, lengths[k], flags_of(k), payload)
  with pytest.raises(AssertionError, match="lost/duplicated/reordered"): checker.check(k + 1, oid, k + 1, lengths[k], flags_of(k), payload)
