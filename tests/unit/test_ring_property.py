"""Property: any sequence of writes (per-record, reserve/commit, deferred batches, aborts, write_many)
and reads (per-record, batches, releases at any point) of random sizes delivers exactly the
written records, in order, with consecutive sequence numbers, and a record's bytes stay intact
until it is released.  One thread plays both sides with try-calls, against a model."""
from __future__ import annotations

import os
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyruntime import errors
from pyruntime.transport import shm
from pyruntime.transport.ring import Arena, RingSpec

pytestmark = pytest.mark.usefixtures("ring_binding")  # every test over both bindings (tests/conftest.py)

PREFIX = "pyruntime-test"


def payload_for(object_id: int, n: int) -> bytes:
  return ((np.arange(n, dtype=np.uint32) * 7 + object_id * 13) & 0xFF).astype(np.uint8).tobytes()


OPS = st.one_of(
  st.tuples(st.just("write"), st.integers(0, 1 << 16), st.sampled_from(["write", "commit", "deferred", "abort"])),
  st.tuples(st.just("write_many"), st.lists(st.integers(0, 1 << 16), min_size=1, max_size=6)),
  st.tuples(st.just("read"), st.integers(1, 6)),
  st.tuples(st.just("release")),
  st.tuples(st.just("publish")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.sampled_from([64, 128, 256, 512, 2048]), alignment=st.sampled_from([1, 4, 8]),
       ops=st.lists(OPS, max_size=150))
def test_delivers_exactly_the_written_records_in_order(capacity, alignment, ops):
  max_extent = capacity - 40
  size = lambda raw: (raw % (max_extent + 1)) // alignment * alignment
  with Arena.create([RingSpec(capacity, max_extent, alignment)], prefix=PREFIX) as arena:
    w, r = arena.writer(0), arena.reader(0)
    published: deque = deque()   # (object_id, payload) visible to the reader, not yet read
    deferred: list = []          # committed, not yet published
    outstanding: list = []       # (payload view, expected bytes) read, not released
    delivered: list = []         # object ids in the order the reader got them
    next_id = 0
    next_seq = 0

    def in_flight() -> bool:
      return bool(published or outstanding or deferred)

    def try_write(fn):
      """A try-write; returns None on WouldBlock (after checking why it may block)."""
      nonlocal deferred
      try:
        return fn()
      except errors.WouldBlock:
        published.extend(deferred)  # a producer that cannot proceed publishes what it committed
        deferred = []
        if not in_flight():  # only a wrap waiting for the reader to pass the padding
          try:
            r.read(timeout=0)
            raise AssertionError("read a record nobody wrote")
          except errors.WouldBlock:
            pass
          return fn()  # must fit now: the ring is empty
        return None

    def take(rec):
      nonlocal next_seq
      oid, want = published.popleft()
      assert (rec.object_id, rec.sequence, rec.extent) == (oid, next_seq, len(want))
      assert bytes(rec.payload) == want
      outstanding.append((rec.payload, want))
      delivered.append(oid)
      next_seq += 1

    for op in ops:
      kind = op[0]
      if kind == "write":
        n, how = size(op[1]), op[2]
        data = payload_for(next_id, n)
        if how == "write":
          if try_write(lambda i=next_id, d=data: w.write(i, d, timeout=0)) is not None:
            published.extend(deferred)
            deferred = []
            published.append((next_id, data))
            next_id += 1
        else:
          mv = try_write(lambda n=n: w.reserve(n, timeout=0))
          if mv is not None:
            assert len(mv) == n
            if how == "abort":
              mv[:] = bytes(n)
              w.abort()
            else:
              mv[:] = data
              w.commit(next_id, publish=(how == "commit"))
              deferred.append((next_id, data))
              if how == "commit":
                published.extend(deferred)
                deferred = []
              next_id += 1
      elif kind == "write_many":
        sizes = [size(x) for x in op[1]]
        datas = [payload_for(next_id + i, n) for i, n in enumerate(sizes)]
        published.extend(deferred)
        deferred = []
        try:
          w.write_many(list(range(next_id, next_id + len(sizes))), datas, timeout=0)
          k = len(sizes)
        except errors.WouldBlock as e:
          k = e.written
        published.extend((next_id + i, datas[i]) for i in range(k))
        next_id += k
      elif kind == "read":
        k = op[1]
        try:
          if k == 1:
            take(r.read(timeout=0))
          else:
            for rec in r.read_many(k, timeout=0): take(rec)
        except errors.WouldBlock:
          assert not published, "the reader missed a published record"
      elif kind == "release":
        for view, want in outstanding: assert bytes(view) == want  # untouched while held
        r.release()
        outstanding.clear()
      elif kind == "publish":
        assert w.publish() == len(deferred)
        published.extend(deferred)
        deferred = []

    # drain: everything written arrives, in order, exactly once
    for view, want in outstanding: assert bytes(view) == want
    r.release()
    w.publish()
    published.extend(deferred)
    while published:
      try:
        take(r.read(timeout=0))
      except errors.WouldBlock:
        raise AssertionError(f"{len(published)} published records never arrived") from None
      r.release()
    assert delivered == list(range(next_id))
    w.close()
    try:
      r.read(timeout=0)
      raise AssertionError("a record after the end")
    except errors.RingClosed:
      pass
    state = arena.state(0)
    assert state["head"] == state["tail"]  # only padding was left, and the reader passed it
    assert state["head_seq"] == state["tail_seq"] == next_id


def test_no_segments_left():
  assert not [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX) and f"-{os.getpid()}-" in n]
  assert shm.cleanup_owned() == []
