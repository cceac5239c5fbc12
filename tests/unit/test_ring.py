"""Unit tests of the MO01 ring (pyruntime.transport.ring over native/mo_ring.c)."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import posix_ipc
import pytest

from pyruntime import errors
from pyruntime.transport import shm
from pyruntime.transport.ring import HEADER_LEN, Arena, RingSpec, cleanup_stale, encode_header, record_size

pytestmark = pytest.mark.usefixtures("ring_binding")  # every test over both bindings (tests/conftest.py)

PREFIX = "pyruntime-test"
HEADER = struct.Struct("<4sHHQQQII")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def make(*specs: RingSpec) -> Arena:
  return Arena.create(list(specs) or [RingSpec(4096, 1024)], prefix=PREFIX)


def run_py(code: str, **kw) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kw)


# --- framing ---------------------------------------------------------------------------------
def test_header_bytes_are_exactly_spec():
  with make(RingSpec(4096, 1024)) as a:
    w, r = a.writer(0), a.reader(0)
    assert w.write(0x1122334455667788, b"hello world!", flags=1) == 0
    assert w.write(7, b"abcd") == 1
    data = a.data(0)
    magic, version, hlen, oid, seq, extent, flags, reserved = HEADER.unpack_from(data, 0)
    assert (magic, version, hlen, oid, seq, extent, flags, reserved) == (b"MO01", 1, 40, 0x1122334455667788, 0, 12, 1, 0)
    assert bytes(data[40:52]) == b"hello world!"
    assert bytes(data[:40]) == encode_header(0x1122334455667788, 0, 12, 1)
    # the next header is 8-aligned: 40 + 12 = 52 -> 56
    assert record_size(12) == 56 and record_size(0) == 40 and record_size(1) == 48
    assert HEADER.unpack_from(data, 56) == (b"MO01", 1, 40, 7, 1, 4, 0, 0)
    rec = r.read(timeout=0)
    assert (rec.object_id, rec.sequence, rec.flags, rec.extent) == (0x1122334455667788, 0, 1, 12)
    assert rec.position == 0 and bytes(rec.payload) == b"hello world!"
    assert HEADER_LEN == 40


def test_record_is_zero_copy_and_read_only():
  with make(RingSpec(4096, 1024)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(1, np.arange(8, dtype=np.float32))
    rec = r.read()
    arr = rec.array(np.float32, (2, 4))
    assert arr.shape == (2, 4) and arr[1, 3] == 7.0
    assert not arr.flags.writeable
    with pytest.raises(TypeError):
      rec.payload[0] = 1
    # the array is a view of shared memory: a change in the ring shows through
    data = a.data(0)
    data[40:44] = np.float32(42.0).tobytes()
    assert arr[0, 0] == 42.0
    assert rec.tobytes()[:4] == np.float32(42.0).tobytes()
    r.release()


@pytest.mark.parametrize("payload", [b"abcdefgh", bytearray(b"abcdefgh"), memoryview(b"xxabcdefgh")[2:],
                                     np.frombuffer(b"abcdefgh", dtype=np.uint8)])
def test_payload_types(payload):
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    w.write(3, payload)
    w.write(4, payload, flags=2, timeout=1.0)
    assert bytes(r.read().payload) == b"abcdefgh"
    rec = r.read()
    assert (rec.flags, bytes(rec.payload)) == (2, b"abcdefgh")


def test_non_contiguous_payload_refused():
  with make() as a:
    w = a.writer(0)
    with pytest.raises(ValueError):
      w.write(1, np.arange(16, dtype=np.uint8)[::2])
    with pytest.raises(ValueError):
      w.write(1, "text")


# --- wrap-around ---------------------------------------------------------------------------------
def retry_after_padding(w, r, fn):
  """A try-write that must wrap waits for the consumer to pass the padding record, which the
  consumer does on its next read attempt (this test plays both sides in one thread)."""
  try:
    return fn()
  except errors.WouldBlock:
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)  # skips the padding, finds nothing yet
    return fn()


def test_try_write_that_wraps_needs_the_consumer_to_pass_the_padding():
  with make(RingSpec(256, 256, alignment=1)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(0, bytes(100))  # 144 bytes
    r.read()
    r.release()  # drained
    with pytest.raises(errors.WouldBlock):
      w.write(1, bytes(160), timeout=0)  # 200 bytes > the 144 before the padding
    assert a.state(0)["head"] == 256  # the padding record is published
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)
    assert a.state(0)["tail"] == 256  # ...and passed
    assert w.write(1, bytes(160), timeout=0) == 1
    assert r.read().position == 256


def test_wraparound_every_size():
  """Records of every extent cross the end of a 256-byte data region at every offset."""
  with make(RingSpec(256, 256, alignment=1)) as a:
    w, r = a.writer(0), a.reader(0)
    seq = 0
    for extent in range(0, 217):  # 40 + 216 == 256: the largest record that fits
      for k in range(7):
        payload = bytes((seq * 7 + i) & 0xFF for i in range(extent))
        if k % 2:
          mv = retry_after_padding(w, r, lambda e=extent: w.reserve(e, timeout=0))
          assert len(mv) == extent  # one contiguous span
          mv[:] = payload
          assert w.commit(seq, flags=extent) == seq
        else:
          write = lambda s=seq, p=payload, e=extent: w.write(s, p, flags=e, timeout=0)
          assert retry_after_padding(w, r, write) == seq
        rec = r.read(timeout=0)
        assert (rec.sequence, rec.object_id, rec.flags, rec.extent) == (seq, seq, extent, extent)
        assert bytes(rec.payload) == payload
        assert rec.position % 8 == 0
        r.release()
        seq += 1
    assert a.state(0)["head"] > 256 * 50  # went round many times


def test_wraparound_with_records_in_flight():
  with make(RingSpec(1024, 512, alignment=1)) as a:
    w, r = a.writer(0), a.reader(0)
    rng = np.random.default_rng(1)
    sent, got = [], []
    for _ in range(3000):
      if rng.random() < 0.55:
        p = rng.integers(0, 256, rng.integers(0, 300), dtype=np.uint8).tobytes()
        try:
          w.write(len(sent), p, timeout=0)
          sent.append(p)
        except errors.WouldBlock:
          assert r.outstanding or a.state(0)["head"] != a.state(0)["tail"]
      else:
        try:
          rec = r.read(timeout=0)
          assert rec.object_id == len(got)
          got.append(bytes(rec.payload))
        except errors.WouldBlock:
          assert len(got) == len(sent)
        if rng.random() < 0.5: r.release()
    r.release()
    for rec in iter(lambda: next_or_none(r), None):
      got.append(bytes(rec.payload))
    assert got == sent


def next_or_none(r):
  try:
    return r.next_record(timeout=0)
  except errors.WouldBlock:
    r.release()
    return None


# --- full / empty -----------------------------------------------------------------------------
def test_full_and_empty():
  with make(RingSpec(1024, 512, alignment=8)) as a:
    w, r = a.writer(0), a.reader(0)
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)
    n = 0
    while True:
      try:
        w.write(n, bytes(64), timeout=0)
        n += 1
      except errors.WouldBlock:
        break
    assert n == 1024 // record_size(64)
    assert w.occupancy() > 0.9
    t0 = time.monotonic()
    with pytest.raises(errors.RingTimeout):
      w.write(99, bytes(64), timeout=0.05)
    assert 0.045 < time.monotonic() - t0 < 1.0
    for i in range(n):
      assert r.read(timeout=0).object_id == i
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)
    with pytest.raises(errors.WouldBlock):  # read but not released: still no room
      w.write(99, bytes(64), timeout=0)
    assert r.release() == n
    assert w.occupancy() == 0.0
    w.write(99, bytes(64), timeout=0)
    r.read()
    r.release()
    t0 = time.monotonic()
    with pytest.raises(errors.RingTimeout):
      r.read(timeout=0.05)
    assert 0.045 < time.monotonic() - t0 < 1.0


def test_many_outstanding_records_keep_their_views():
  with make(RingSpec(1 << 16, 64)) as a:
    w, r = a.writer(0), a.reader(0)
    for i in range(100):
      w.write(i, struct.pack("<Q", i))
    recs = [r.read() for _ in range(100)]  # more than the initial pool of Record slots
    assert [rec.object_id for rec in recs] == list(range(100))
    assert [struct.unpack("<Q", rec.payload)[0] for rec in recs] == list(range(100))
    assert r.outstanding == 100
    assert r.release() == 100



def test_records_are_records_and_read_the_same_in_both_bindings(ring_binding):
  """read(), next_record(), read(timeout) and batch items give Record instances with the same
  fields, payload views and repr, whichever binding made them."""
  from pyruntime.transport import ring
  with make(RingSpec(1 << 16, 64)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(7, b"abcdefgh")
    w.write(object_id=8, payload=bytearray(b"12345678"), flags=5, timeout=1.0)
    w.write(9, np.arange(2, dtype=np.float32))
    recs = [r.read(), r.read(timeout=1), r.read(timeout=None)]
    assert all(isinstance(x, ring.Record) for x in recs)
    assert [(x.object_id, x.sequence, x.flags, x.extent, x.position) for x in recs] == \
        [(7, 0, 0, 8, 0), (8, 1, 5, 8, 48), (9, 2, 0, 8, 96)]
    assert [bytes(x.payload) for x in recs[:2]] == [b"abcdefgh", b"12345678"]
    assert recs[0].tobytes() == b"abcdefgh" and recs[2].array(np.float32).tolist() == [0.0, 1.0]
    buf, arr = bytearray(b"-" * 10), np.zeros(3, dtype=np.float32)
    assert (recs[0].readinto(buf), buf) == (8, bytearray(b"abcdefgh--"))
    assert recs[2].readinto(arr) == 8 and arr.tolist() == [0.0, 1.0, 0.0]
    for bad in (bytearray(7), b"x" * 16, np.zeros(8, np.uint8)[::2], "text"):  # short, read-only, strided, no buffer
      with pytest.raises(ValueError):
        recs[0].readinto(bad)
    assert repr(recs[1]) == "Record(object_id=8, sequence=1, flags=0x5, extent=8)"
    view = recs[0].payload
    assert view.readonly and view.format == "B" and view.obj is not None
    with pytest.raises(TypeError):
      view[0] = 0
    assert r.release() == 3
    w.write_many([1, 2], [b"aaaa", b"bbbb"])
    b = r.read_many(8)
    item = b[1]
    assert isinstance(item, ring.Record) and (item.object_id, bytes(item.payload)) == (2, b"bbbb")
    assert [bytes(p) for p in b.payloads()] == [b"aaaa", b"bbbb"]
    r.release()
    w.write(3, b"zzzz")
    with pytest.raises(errors.OutputExtentAlignmentViolation):
      w.write(3, b"zzz")  # wrong alignment for this ring: the named error, not a TypeError
    assert r.next_record().object_id == 3
    with pytest.raises(errors.WouldBlock):
      r.next_record(timeout=0)
    with pytest.raises(ValueError):
      w.write(1, [1, 2, 3])  # not a buffer
    with pytest.raises(ValueError):
      r.read(timeout=-1)


def test_writers_and_readers_die_with_their_last_reference(ring_binding):
  """The fast entry points hold their Writer/Reader weakly: no reference cycle keeps them alive."""
  import gc
  import weakref
  with make() as a:
    was_enabled = gc.isenabled()  # off in this suite (tests/conftest.py): leave it as it was
    gc.disable()
    try:
      w, r = a.writer(0), a.reader(0)
      w.write(1, b"abcd")
      r.read()
      refs = [weakref.ref(w)]
      if ring_binding == "fast": refs.append(weakref.ref(r))  # cffi Records point back at their Reader
      w.close(), r.close()
      del w, r
      assert [x() for x in refs] == [None] * len(refs)
    finally:
      if was_enabled: gc.enable()



def test_flags_and_timeouts_stay_in_c_and_mean_what_they_mean_in_python(ring_binding, monkeypatch):
  """write(id, payload, flags, timeout) and read/next_record(timeout) with every way of passing the options: the
  fast binding does them in its C entry points (its Python fallbacks are never called for them), and the answers,
  refusals included, are the Python API's: timeout 0 never waits, a positive one waits at most that long, None for
  ever; a negative or NaN timeout is a ValueError and an unknown keyword a TypeError."""
  from pyruntime.transport import ring
  if ring_binding == "fast":
    def refuse(*a, **k): raise AssertionError("the Python fallback ran")
    slow = [ring._FastWriter._write_slow, ring._FastReader._read_slow, ring._FastReader._next_slow]
    for cls, name in ((ring._FastWriter, "_write_slow"), (ring._FastReader, "_read_slow"), (ring._FastReader, "_next_slow")):
      monkeypatch.setattr(cls, name, refuse)
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    w.write(1, b"abcd", 2)
    w.write(2, b"efgh", 3, 0.5)
    w.write(3, b"ijkl", flags=4)
    w.write(4, b"mnop", timeout=1e300)
    w.write(5, b"qrst", 6, timeout=0)
    got = [r.read(1.0), r.read(timeout=0), r.read(timeout=None)]
    assert [(x.object_id, x.flags, bytes(x.payload)) for x in got] == [(1, 2, b"abcd"), (2, 3, b"efgh"), (3, 4, b"ijkl")]
    r.release()
    assert (r.next_record(0.25).object_id, r.next_record(timeout=0).flags) == (4, 6)
  if ring_binding == "fast":
    monkeypatch.setattr(ring._FastWriter, "_write_slow", slow[0])
    monkeypatch.setattr(ring._FastReader, "_read_slow", slow[1])
    monkeypatch.setattr(ring._FastReader, "_next_slow", slow[2])
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    for bad in (-1.0, float("nan")):
      with pytest.raises(ValueError): r.read(bad)
      with pytest.raises(ValueError): r.next_record(timeout=bad)
      with pytest.raises(ValueError): w.write(1, b"abcd", 0, bad)
    with pytest.raises(TypeError): r.read(deadline=1)
    with pytest.raises(TypeError): w.write(1, b"abcd", 0, 1.0, 5)
    with pytest.raises(errors.WouldBlock): r.read(0)
    t0 = time.monotonic()
    with pytest.raises(errors.RingTimeout): r.next_record(0.05)
    assert 0.04 < time.monotonic() - t0 < 5
    w.write(9, b"abcd", flags=1, timeout=0.0)
    assert r.read(timeout=0.0).object_id == 9


def test_a_fast_extension_of_another_api_version_is_ignored(monkeypatch):
  """A stale pyruntime._ringfast (older sources, or another checkout's build found on the path)
  is not half-used: ring.py falls back to cffi alone."""
  import types

  from pyruntime._ring import ffi

  import pyruntime
  from pyruntime.transport import ring
  fake = types.ModuleType("pyruntime._ringfast")
  fake.SIZEOF_PRODUCER, fake.SIZEOF_CONSUMER, fake.SIZEOF_VIEW = (ffi.sizeof(t) for t in ("mo_producer", "mo_consumer", "mo_view"))
  monkeypatch.setitem(sys.modules, "pyruntime._ringfast", fake)
  monkeypatch.setattr(pyruntime, "_ringfast", fake, raising=False)
  assert ring._load_fast() is None  # no API constant: the first fast path's build
  fake.API = ring._FAST_API - 1
  assert ring._load_fast() is None
  fake.API = ring._FAST_API
  assert ring._load_fast() is fake


# --- batches ---------------------------------------------------------------------------------
def test_deferred_commits_publish_with_one_store():
  with make(RingSpec(4096, 256)) as a:
    w, r = a.writer(0), a.reader(0)
    for i in range(5):
      w.reserve(16)[:] = bytes([i]) * 16
      assert w.commit(100 + i, publish=False) == i
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)
    assert a.state(0)["head"] == 0
    assert w.publish() == 5
    assert a.state(0)["head"] == 5 * record_size(16)
    batch = r.read_many(16, timeout=0)
    assert len(batch) == 5
    assert batch.object_id.tolist() == [100, 101, 102, 103, 104]
    assert batch.sequence.tolist() == [0, 1, 2, 3, 4]
    assert [bytes(p) for p in batch.payloads()] == [bytes([i]) * 16 for i in range(5)]
    assert a.state(0)["tail"] == 0
    assert r.release_many() == 5
    assert a.state(0)["tail"] == 5 * record_size(16)


def test_write_many_forms():
  with make(RingSpec(1 << 16, 1024)) as a:
    w, r = a.writer(0), a.reader(0)
    assert w.write_many([1, 2, 3], [b"aaaa", bytearray(b"bbbbbbbb"), memoryview(b"cccc")], flags=[1, 0, 1]) == 0
    rows = np.arange(24, dtype=np.uint32).reshape(3, 8)
    assert w.write_many(9, rows) == 3
    assert w.write_many(np.array([5, 6]), b"x" * 8 + b"y" * 8, record_size=8, flags=4) == 6
    assert w.write_many([], []) == 8
    batch = r.read_many(100)
    assert len(batch) == 8
    assert batch.object_id.tolist() == [1, 2, 3, 9, 9, 9, 5, 6]
    assert batch.flags.tolist() == [1, 0, 1, 0, 0, 0, 4, 4]
    assert batch.extent.tolist() == [4, 8, 4, 32, 32, 32, 8, 8]
    assert bytes(batch.payload(1)) == b"bbbbbbbb"
    rec = batch[3]
    assert (rec.object_id, rec.sequence) == (9, 3)
    assert rec.array(np.uint32).tolist() == list(range(8))
    assert bytes(batch[-1].payload) == b"y" * 8
    assert bytes(batch.gather()) == b"aaaabbbbbbbbcccc" + rows.tobytes() + b"x" * 8 + b"y" * 8
    r.release()
    with pytest.raises(ValueError):
      w.write_many([1, 2], [b"aaaa"])
    with pytest.raises(ValueError):
      w.write_many(0, b"abc", record_size=2)


def test_batch_array_is_zero_copy_when_contiguous():
  with make(RingSpec(1 << 16, 64)) as a:
    w, r = a.writer(0), a.reader(0)
    rows = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    w.write_many(np.arange(10), rows)
    batch = r.read_many(10)
    arr = batch.array(np.float32)
    assert arr.shape == (10, 4)
    np.testing.assert_array_equal(arr, rows)
    assert arr.strides == (record_size(16), 4)  # strided over the headers: no copy
    assert np.shares_memory(arr, np.frombuffer(a.data(0), dtype=np.uint8))
    r.release()


def test_batch_array_copies_across_the_wrap():
  with make(RingSpec(256, 128, alignment=4)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(0, bytes(96))  # 136 bytes: the next 3 records of 56 bytes wrap
    r.read()
    r.release()
    rows = np.arange(12, dtype=np.uint32).reshape(3, 4)
    w.write_many(0, rows)
    batch = r.read_many(10)
    assert len(batch) == 3
    np.testing.assert_array_equal(batch.array(np.uint32), rows)
    r.release()


def test_write_many_partial_failure_reports_written():
  with make(RingSpec(1024, 512)) as a:
    w, r = a.writer(0), a.reader(0)
    with pytest.raises(errors.WouldBlock) as e:
      w.write_many(0, np.zeros((50, 64), np.uint8), timeout=0)
    assert e.value.written == 1024 // record_size(64)
    batch = r.read_many(100)  # everything committed was published
    assert len(batch) == e.value.written


# --- abort -----------------------------------------------------------------------------------
def test_abort_publishes_nothing():
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    mv = w.reserve(32)
    mv[:4] = b"junk"
    with pytest.raises(errors.RingError):
      w.reserve(32)  # one reservation at a time
    w.abort()
    with pytest.raises(ValueError):
      mv[0] = 1  # the view was revoked
    with pytest.raises(errors.RingError):
      w.commit(1)
    with pytest.raises(errors.WouldBlock):
      r.read(timeout=0)
    assert w.write(5, b"abcd") == 0  # the aborted reservation took no sequence
    assert r.read().sequence == 0


def test_reserved_view_revoked_after_commit():
  with make() as a:
    w = a.writer(0)
    mv = w.reserve(8)
    mv[:] = b"12345678"
    w.commit(1)
    with pytest.raises(ValueError):
      mv[0] = 0


# --- producer refusals ---------------------------------------------------------------------------
def test_producer_refusals():
  with make(RingSpec(256, 1000, alignment=4)) as a:
    w, r = a.writer(0), a.reader(0)
    with pytest.raises(errors.OutputExtentInvalid):
      w.write(1, bytes(1004))
    with pytest.raises(errors.OutputExtentAlignmentViolation):
      w.write(1, bytes(6))
    with pytest.raises(errors.OutputRingCapacityExceeded):
      w.write(1, bytes(220))
    with pytest.raises(errors.OutputRingCapacityExceeded):
      w.reserve(220)
    assert isinstance(errors.OutputExtentInvalid("x"), errors.OutputError)
    assert w.write(1, bytes(216)) == 0  # exactly the capacity
    assert r.read().extent == 216


# --- consumer validation: every named error, cursor unmoved ----------------------------------
def header(object_id=1, sequence=0, extent=8, flags=0, magic=b"MO01", version=1, hlen=40, reserved=0) -> bytes:
  return HEADER.pack(magic, version, hlen, object_id, sequence, extent, flags, reserved)


BAD_RECORDS = [
  ("EofBeforeFullHeader", header()[:16]),
  ("InvalidObjectMagic", header(magic=b"MO02") + bytes(8)),
  ("InvalidObjectHeader", header(version=2) + bytes(8)),
  ("InvalidObjectHeader", header(hlen=48) + bytes(8)),
  ("InvalidObjectHeader", header(reserved=1) + bytes(8)),
  ("ObjectExtentInvalid", header(extent=68) + bytes(72)),    # above max_extent 64
  ("ObjectExtentInvalid", header(extent=16) + bytes(8)),     # past the published bytes
  ("ObjectExtentAlignmentViolation", header(extent=6) + bytes(8)),
  ("SequenceViolation", header(sequence=5) + bytes(8)),
]


@pytest.mark.parametrize("name,raw", BAD_RECORDS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_RECORDS)])
def test_consumer_rejects_bad_record(name, raw):
  cls = getattr(errors, name)
  with make(RingSpec(1024, 64, alignment=4)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(0, b"good")
    assert r.read().sequence == 0
    r.release()
    w._publish_raw(raw)
    pos, seq, tail = r.position, r.expected_sequence, a.state(0)["tail"]
    for method in (lambda: r.read(timeout=0), lambda: r.read(), lambda: r.next_record(timeout=1),
                   lambda: r.read_many(8, timeout=0)):
      with pytest.raises(cls) as e:
        method()
      assert isinstance(e.value, errors.RecordError) and e.value.code == name
      assert (r.position, r.expected_sequence, a.state(0)["tail"]) == (pos, seq, tail)  # not skipped
    if name == "SequenceViolation":
      assert (e.value.expected, e.value.actual) == (1, 5)
    assert r.discard() == len(raw) + (-len(raw) % 8)
    w.write(1, b"next")
    rec = r.read(timeout=0)
    assert (rec.object_id, rec.sequence) == (1, 1)


def test_corrupting_a_published_record_in_the_data_region():
  """Craft the bad header by computing its offset from the arena buffer, as a tool would."""
  with make(RingSpec(4096, 64)) as a:
    w, r = a.writer(0), a.reader(0)
    w.write(1, b"aaaa")
    w.write(2, b"bbbb")
    r.read()
    r.release()
    whole = a.buffer()
    data_offset = a._rings[0].data_offset
    off = data_offset + record_size(4)  # the second record's header
    assert bytes(whole[off:off + 4]) == b"MO01"
    whole[off:off + 4] = b"MOXX"
    with pytest.raises(errors.InvalidObjectMagic):
      r.read(timeout=0)
    whole[off:off + 4] = b"MO01"
    assert r.read(timeout=0).object_id == 2


# --- arenas --------------------------------------------------------------------------------------
def test_attach_by_name_and_specs():
  specs = [RingSpec(100, 10), RingSpec(5000, 4096, alignment=8)]
  with make(*specs) as a:
    assert a.created and a.ring_count == 2
    assert a.name.startswith(f"/{PREFIX}-{os.getpid()}-")
    assert a.specs == [RingSpec(128, 10, 4), RingSpec(8192, 4096, 8)]  # capacities rounded up
    assert a.creator_pid == os.getpid()
    with Arena.attach(a.name) as b, Arena.attach(a.name.lstrip("/")) as c:
      assert not b.created and b.specs == a.specs and c.ring_count == 2
      w = a.writer(1)
      r = b.reader(1)
      w.write(5, bytes(16))
      assert r.read().object_id == 5
    assert os.path.exists("/dev/shm" + a.name)  # attachers do not unlink
  assert not os.path.exists("/dev/shm" + a.name)


def test_attach_foreign_segment():
  name = f"/{PREFIX}-{os.getpid()}-foreign"
  seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=8192)
  try:
    os.pwrite(seg.fd, os.urandom(8192), 0)
    seg.close_fd()
    with pytest.raises(errors.ArenaInvalid, match="magic"):
      Arena.attach(name)
  finally:
    posix_ipc.unlink_shared_memory(name)


def test_attach_wrong_version_and_size():
  with make() as a:
    a.buffer()[8:12] = struct.pack("<I", 2)
    with pytest.raises(errors.ArenaInvalid, match="version"):
      Arena.attach(a.name)
    a.buffer()[8:12] = struct.pack("<I", 1)
    Arena.attach(a.name).close()
    seg = posix_ipc.SharedMemory(a.name)
    os.ftruncate(seg.fd, a.size + 4096)
    seg.close_fd()
    with pytest.raises(errors.ArenaInvalid, match="size"):
      Arena.attach(a.name)


def test_attach_missing_and_tiny():
  with pytest.raises(errors.ArenaInvalid, match="no such"):
    Arena.attach(f"/{PREFIX}-{os.getpid()}-missing")
  name = f"/{PREFIX}-{os.getpid()}-tiny"
  posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=16).close_fd()
  try:
    with pytest.raises(errors.ArenaInvalid):
      Arena.attach(name)
  finally:
    posix_ipc.unlink_shared_memory(name)


def test_invalid_specs():
  with pytest.raises(ValueError):
    RingSpec(0, 10)
  with pytest.raises(ValueError):
    RingSpec(64, -1)
  with pytest.raises(ValueError):
    RingSpec(64, 8, alignment=0)
  with pytest.raises(TypeError):
    RingSpec(64.0, 8)
  with pytest.raises(ValueError):
    Arena.create([], prefix=PREFIX)


def test_shm_space_error(monkeypatch):
  class Tiny:
    f_bavail, f_frsize = 10, 4096
  monkeypatch.setattr(shm.os, "statvfs", lambda path: Tiny())
  with pytest.raises(errors.ShmSpaceError, match="mount -o remount,size="):
    make(RingSpec(1 << 20, 1024))


def test_close_is_idempotent_and_invalidates_handles():
  a = make()
  w, r = a.writer(0), a.reader(0)
  w.write(1, b"abcd")
  rec = r.read()
  view = rec.payload  # a view the caller still holds keeps the mapping alive
  a.close()
  a.close()
  assert a.closed and not os.path.exists("/dev/shm" + a.name)
  assert bytes(view) == b"abcd"
  with pytest.raises(errors.RingClosed):
    w.write(2, b"abcd")
  with pytest.raises(errors.RingClosed):
    r.read(timeout=0)
  with pytest.raises(errors.RingClosed):
    a.writer(0)
  assert w.occupancy() == 0.0
  del view, rec


def test_claims():
  with make() as a:
    w = a.writer(0)
    with pytest.raises(errors.RingBusy):
      a.writer(0)
    r = a.reader(0)
    with pytest.raises(errors.RingBusy):
      Arena.attach(a.name).reader(0)
    w.write(1, b"abcd")
    w.detach()
    w2 = a.writer(0)
    assert w2.write(2, b"efgh") == 1  # the new owner continues the sequence
    r.read()
    r.detach()
    r2 = a.reader(0)
    assert r2.read().sequence == 1  # resumes after the last release
    with pytest.raises(IndexError):
      a.reader(1)


# --- closing ---------------------------------------------------------------------------------
def test_writer_close_drains_then_closed():
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    for i in range(3): w.write(i, b"abcd")
    w.close()
    w.close()
    with pytest.raises(errors.RingClosed):
      w.write(9, b"abcd")
    assert [rec.object_id for rec in r] == [0, 1, 2]  # iteration ends at close
    with pytest.raises(errors.RingClosed):
      r.read()  # no hang
    with pytest.raises(errors.RingClosed):
      r.read(timeout=0)


def test_reader_close_stops_writer():
  with make(RingSpec(1024, 512)) as a:
    w, r = a.writer(0), a.reader(0)
    r.close()
    with pytest.raises(errors.RingClosed):
      w.write(1, b"abcd")
    with pytest.raises(errors.RingClosed):
      w.reserve(8, timeout=0)


def test_close_wakes_a_blocked_reader():
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    r.set_wait(spin=0, poll=3.0)  # a slow poll: only the futex wake can end the wait quickly
    result = []

    def consume():
      try:
        r.read()
      except errors.RingClosed as e:
        result.append(e)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    w.close()
    t.join(5)
    assert result and time.monotonic() - t0 < 1.0  # woken, not found by the poll


# --- waiting, the GIL, signals -----------------------------------------------------------------
def test_blocking_read_releases_the_gil_and_is_woken():
  with make() as a:
    w, r = a.writer(0), a.reader(0)
    r.set_wait(spin=0, poll=30)  # one park for the whole test: no poll slice ends it early
    got = []
    t = threading.Thread(target=lambda: got.append(bytes(r.read(timeout=60).payload)))
    t.start()
    # on a busy machine the reader may start late: wait until it is parked (its flag is up before it counts the park)
    deadline = time.monotonic() + 30
    while r.stats["parks"] == 0:
      assert time.monotonic() < deadline, "the reader never parked"
      time.sleep(0.001)
    count = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.2: count += 1  # runs only if the parked reader let go of the GIL
    assert count > 10000
    w.write(1, b"wake")
    t.join(30)
    assert got == [b"wake"]
    assert r.stats["parks"] == 1 and w.stats["wakes"] == 1  # parked, so the write had to wake it, once


def test_writer_wakes_only_sleeping_readers():
  with make(RingSpec(1 << 16, 64)) as a:
    w, _r = a.writer(0), a.reader(0)
    for i in range(1000): w.write(i, b"abcd")
    assert w.stats["wakes"] == 0  # nobody slept: no system call per record


def test_blocked_writer_is_woken_by_release():
  with make(RingSpec(1024, 512)) as a:
    w, r = a.writer(0), a.reader(0)
    w.set_wait(spin=0)
    while True:
      try:
        w.write(0, bytes(100), timeout=0)
      except errors.WouldBlock:
        break
    done = []
    t = threading.Thread(target=lambda: done.append(w.write(1, bytes(100), timeout=5)))
    t.start()
    time.sleep(0.1)
    assert not done
    r.read()
    r.release()
    t.join(5)
    assert done and w.stats["parks"] >= 1


def test_idle_waiting_reader_costs_little_cpu():
  with make() as a:
    _w, r = a.writer(0), a.reader(0)
    cpu = []

    def wait():
      c0 = time.thread_time()
      with pytest.raises(errors.RingTimeout):
        r.read(timeout=1.0)
      cpu.append(time.thread_time() - c0)

    t = threading.Thread(target=wait)
    t.start()
    t.join(5)
    assert cpu[0] < 0.02, f"an idle reader used {cpu[0] * 100:.1f}% of a core"
    assert r.stats["parks"] <= 12  # the 100 ms liveness poll, not a busy loop


def test_signal_handler_runs_during_an_unbounded_read():
  if threading.current_thread() is not threading.main_thread(): pytest.skip("needs the main thread")
  with make() as a:
    a.writer(0)
    r = a.reader(0)

    class Alarm(Exception): pass

    def handler(signum, frame): raise Alarm()

    old = signal.signal(signal.SIGALRM, handler)
    try:
      signal.setitimer(signal.ITIMER_REAL, 0.1)
      t0 = time.monotonic()
      with pytest.raises(Alarm):
        r.read()
      assert time.monotonic() - t0 < 1.0
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)


def test_signal_taken_by_another_thread_still_runs_the_handler():
  """The signal interrupts no system call of the waiting main thread (another thread takes it):
  the wait must still come back to Python, at the latest at its next poll wake-up."""
  if threading.current_thread() is not threading.main_thread(): pytest.skip("needs the main thread")
  with make() as a:
    w, r = a.writer(0), a.reader(0)

    class Alarm(Exception): pass

    def handler(signum, frame): raise Alarm()

    def other_thread():
      time.sleep(0.05)
      signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # the C-level handler runs here
      time.sleep(3)
      w.write(1, b"end!")  # only if the handler never ran: ends the wait so the test fails, not hangs

    old = signal.signal(signal.SIGUSR1, handler)
    t = threading.Thread(target=other_thread, daemon=True)
    try:
      t0 = time.monotonic()
      t.start()
      with pytest.raises(Alarm):
        r.read()
      assert time.monotonic() - t0 < 1.0
    finally:
      signal.signal(signal.SIGUSR1, old)
    t.join(10)


def test_timeout_survives_signals():
  if threading.current_thread() is not threading.main_thread(): pytest.skip("needs the main thread")
  with make() as a:
    a.writer(0)
    r = a.reader(0)
    hits = []
    old = signal.signal(signal.SIGALRM, lambda s, f: hits.append(s))
    try:
      signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
      t0 = time.monotonic()
      with pytest.raises(errors.RingTimeout):
        r.read(timeout=0.3)
      elapsed = time.monotonic() - t0
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)
    assert len(hits) >= 3 and 0.29 < elapsed < 0.6  # neither cut short nor restarted per signal


# --- housekeeping: stale segments, exit, SIGTERM -------------------------------------------------
def test_cleanup_stale_removes_only_dead_owners():
  child = run_py(f"""
    import os
    from pyruntime.transport.ring import Arena, RingSpec
    a = Arena.create([RingSpec(4096, 64)], prefix="{PREFIX}-stale")
    print(a.name, flush=True)
    os._exit(0)  # no atexit: the segment is left behind
  """)
  out, err = child.communicate(timeout=60)
  assert child.returncode == 0, err
  stale = out.strip()
  assert os.path.exists("/dev/shm" + stale)
  with Arena.create([RingSpec(4096, 64)], prefix=f"{PREFIX}-stale") as live:
    removed = cleanup_stale(f"{PREFIX}-stale")
    assert removed == [stale]
    assert not os.path.exists("/dev/shm" + stale)
    assert os.path.exists("/dev/shm" + live.name)
  # a segment without a superblock is judged by the pid in its name
  name = f"/{PREFIX}-stale-{2**22 - 1}-deadbeef"
  posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=64).close_fd()
  assert cleanup_stale(f"{PREFIX}-stale") == [name]


def test_unlinked_at_exit():
  child = run_py(f"""
    from pyruntime.transport.ring import Arena, RingSpec
    a = Arena.create([RingSpec(4096, 64)], prefix="{PREFIX}")
    print(a.name, flush=True)
  """)
  out, err = child.communicate(timeout=60)
  assert child.returncode == 0, err
  assert not os.path.exists("/dev/shm" + out.strip())


@pytest.mark.parametrize("chain", [False, True])
def test_unlinked_on_sigterm(chain):
  child = run_py(f"""
    import signal, sys, time
    if {chain}:
      def mine(signum, frame):
        print("chained", flush=True)
        sys.exit(3)
      signal.signal(signal.SIGTERM, mine)
    from pyruntime.transport.ring import Arena, RingSpec
    a = Arena.create([RingSpec(4096, 64)], prefix="{PREFIX}")
    r = a.reader(0)
    print(a.name, flush=True)
    r.read()  # blocks in C until the signal
  """)
  name = child.stdout.readline().strip()
  assert name and os.path.exists("/dev/shm" + name)
  child.send_signal(signal.SIGTERM)
  out, err = child.communicate(timeout=30)
  assert not os.path.exists("/dev/shm" + name)
  if chain:
    assert child.returncode == 3 and "chained" in out, err
  else:
    assert child.returncode == -signal.SIGTERM, err
