"""Fuzzing the consumer: random and mutated MO01 headers published raw into a ring, then read.

Each input is raw bytes published at the ring's write position with Writer._publish_raw (the test-only
path of native/mo_ring.c: no framing, zero-padded to 8 bytes, wrapping at the end of the data region),
sometimes after steering the position close to the end of the region so that headers straddle it and
padding records come into play.  The consumer must never crash, and must do exactly what docs/wire-format.md
and native/mo_ring.h say, which a small Python model of the consumer (`expect`) predicts:

  - a valid record: read it, with the object id, sequence, extent, flags and payload the bytes say;
  - a bad one: raise a named RecordError of one of the kinds the bytes violate, with the cursor (position,
    expected sequence) unmoved, and raise the same error again on the next read;
  - a valid padding record: skip it (and then read what follows it at offset 0).

PYRUNTIME_FUZZ_N inputs (default 60000) with seed PYRUNTIME_FUZZ_SEED (default 20241129); run more
offline, e.g. `PYRUNTIME_FUZZ_N=10000000 python -m pytest tests/unit/test_ring_fuzz.py -k random`.
Hypothesis drives two more tests (raw bytes; header fields).
"""
from __future__ import annotations

import collections
import os
import random
import struct
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyruntime import errors
from pyruntime.transport.ring import HEADER_LEN, Arena, RingSpec, record_size

pytestmark = pytest.mark.usefixtures("ring_binding")  # every test over both bindings (tests/conftest.py)

PREFIX = "pyruntime-test"
HDR = struct.Struct("<IHHQQQII")  # magic, version, header_len, object_id, sequence, extent, flags, reserved
MAGIC = 0x31304F4D                # "MO01"
PAD = 0x44504F4D                  # "MOPD"
U64 = 2**64 - 1
SPECS = [RingSpec(1024, 256, alignment=4), RingSpec(4096, 1000, alignment=8), RingSpec(512, 64, alignment=1)]
N = int(os.environ.get("PYRUNTIME_FUZZ_N", "60000"))
SEED = int(os.environ.get("PYRUNTIME_FUZZ_SEED", "20241129"))

EOF, BAD_MAGIC, BAD_HEADER = "EofBeforeFullHeader", "InvalidObjectMagic", "InvalidObjectHeader"
BAD_EXTENT, BAD_ALIGN, BAD_SEQ = "ObjectExtentInvalid", "ObjectExtentAlignmentViolation", "SequenceViolation"
NAMES = {EOF, BAD_MAGIC, BAD_HEADER, BAD_EXTENT, BAD_ALIGN, BAD_SEQ}




# --- the model -------------------------------------------------------------------------------------
@dataclass
class Expect:
  kind: str                       # "record", "error" or "empty"
  errors: set = field(default_factory=set)
  skipped: int = 0                # bytes of a valid padding record passed before
  fields: tuple = ()              # (object_id, sequence, extent, flags) of a record
  payload: bytes = b""


def expect(raw: bytes, off: int, cap: int, max_extent: int, alignment: int, seq: int) -> Expect:
  """What the consumer must do with `raw` (a multiple of 8 bytes) published at data offset `off` of an
  otherwise empty ring of `cap` bytes.  Where several rules are broken, any of their errors will do."""
  avail, room = len(raw), cap - off
  w0, w1 = struct.unpack_from("<II", raw)
  if w0 == PAD:  # padding runs to the end of the region; it is only complete once all of that is published
    errs = ({EOF} if avail < room else set()) | ({BAD_HEADER} if w1 != 0 else set())
    if errs: return Expect("error", errs)
    rest = raw[room:]
    if not rest: return Expect("empty", skipped=room)
    e = expect(rest, 0, cap, max_extent, alignment, seq)
    e.skipped += room
    return e
  if avail < HEADER_LEN:  # truncated; a wrong magic may be reported before the rest arrives
    return Expect("error", {EOF} | ({BAD_MAGIC} if w0 != MAGIC else set()))
  if room < HEADER_LEN:  # no header fits before the end of the region: only padding may start here
    return Expect("error", {BAD_HEADER} | ({BAD_MAGIC} if w0 != MAGIC else set()))
  magic, version, header_len, object_id, sequence, extent, flags, reserved = HDR.unpack_from(raw)
  errs = set()
  if magic != MAGIC: errs.add(BAD_MAGIC)
  if version != 1 or header_len != HEADER_LEN or reserved != 0: errs.add(BAD_HEADER)
  if extent > max_extent: errs.add(BAD_EXTENT)
  if extent % alignment: errs.add(BAD_ALIGN)
  if record_size(extent) > min(avail, room): errs.add(BAD_EXTENT)  # the payload runs past what is published
  if sequence != seq: errs.add(BAD_SEQ)
  if errs: return Expect("error", errs)
  return Expect("record", fields=(object_id, sequence, extent, flags), payload=raw[HEADER_LEN:HEADER_LEN + extent])


# --- one ring under fuzz ---------------------------------------------------------------------------
class FuzzRing:
  def __init__(self, arena: Arena, index: int):
    self.arena, self.spec = arena, arena.specs[index]
    self.w, self.r = arena.writer(index), arena.reader(index)
    self.cap = self.spec.capacity
    self.outcomes: collections.Counter = collections.Counter()

  @property
  def offset(self) -> int:
    return self.r.position & (self.cap - 1)

  def steer(self, room: int) -> None:
    """Move the (empty) ring's position so that `room` bytes remain before the end of the region."""
    room = max(8, min(self.cap, room // 8 * 8))
    filler = (self.cap - room - self.offset) % self.cap
    if filler:
      self.w._publish_raw(bytes(filler))
      self.r.discard()
    assert self.cap - self.offset == room

  def run(self, raw: bytes, use_many: bool = False) -> str:
    """Publish raw, read, check against the model; returns the outcome's name."""
    r = self.r
    raw = bytes(raw)
    assert 0 < len(raw) <= self.cap
    padded = raw + bytes(-len(raw) % 8)
    pos, seq = r.position, r.expected_sequence
    want = expect(padded, pos & (self.cap - 1), self.cap, self.spec.max_extent, self.spec.alignment, seq)
    self.w._publish_raw(raw)
    read = (lambda: r.read_many(4, timeout=0)) if use_many else (lambda: r.read(timeout=0))
    got = None
    try:
      got = read()
    except errors.WouldBlock:
      assert want.kind == "empty", f"WouldBlock, expected {want}"
      assert r.position == pos + want.skipped and r.expected_sequence == seq
      outcome = "padding only"
    except errors.RecordError as e:
      name = type(e).__name__
      assert want.kind == "error", f"{name}: {e}, expected {want}"
      assert name in want.errors, f"{name}: {e}, expected one of {sorted(want.errors)}"
      assert name in NAMES and e.code == name
      here = pos + want.skipped
      assert (r.position, r.expected_sequence) == (here, seq), "the cursor moved past a bad record"
      if name == BAD_SEQ: assert e.expected == seq and e.actual == HDR.unpack_from(padded, want.skipped)[4]
      for again in (lambda: r.read(timeout=0), lambda: r.read_many(2, timeout=0)):
        with pytest.raises(type(e)):
          again()
        assert (r.position, r.expected_sequence) == (here, seq), "the cursor moved on a repeated read"
      outcome = name
    else:
      assert want.kind == "record", f"read a record, expected {want}"
      rec = got[0] if use_many else got
      assert (rec.object_id, rec.sequence, rec.extent, rec.flags) == want.fields
      assert bytes(rec.payload) == want.payload
      assert rec.position == pos + want.skipped
      taken = len(got) if use_many else 1
      assert r.expected_sequence == seq + taken
      if not use_many: assert r.position == pos + want.skipped + record_size(want.fields[2])
      outcome = "record"
    del got
    r.release()
    r.discard()
    assert r.position == pos + len(padded), "discard did not reach the producer's position"
    self.outcomes[outcome] += 1
    return outcome


def fuzz_rings(arena: Arena) -> list[FuzzRing]:
  return [FuzzRing(arena, i) for i in range(arena.ring_count)]


# --- input generation ----------------------------------------------------------------------------
def valid_record(rnd: random.Random, spec: RingSpec, seq: int, extent: int | None = None) -> bytearray:
  if extent is None:
    units = spec.max_extent // spec.alignment
    extent = rnd.choice([0, spec.alignment, units * spec.alignment, rnd.randint(0, units) * spec.alignment])
  flags = rnd.getrandbits(32) if rnd.random() < 0.5 else rnd.choice([0, 1])
  return bytearray(HDR.pack(MAGIC, 1, HEADER_LEN, rnd.getrandbits(64), seq, extent, flags, 0) + rnd.randbytes(extent))


FIELD_AT = {"magic": (0, "<I"), "version": (4, "<H"), "header_len": (6, "<H"), "object_id": (8, "<Q"),
            "sequence": (16, "<Q"), "extent": (24, "<Q"), "flags": (32, "<I"), "reserved": (36, "<I")}


def interesting(rnd: random.Random, name: str, spec: RingSpec, seq: int, published: int) -> int:
  a, m = spec.alignment, spec.max_extent
  bits = {"<I": 32, "<H": 16, "<Q": 64}[FIELD_AT[name][1]]
  choices = {
    "magic": [PAD, MAGIC ^ 0x20, 0x32304F4D, 0, 0xFFFFFFFF, int.from_bytes(b"MO01"[::-1], "little")],
    "version": [0, 2, 0x100, 0xFFFF],
    "header_len": [0, 8, 39, 41, 48, 0x2800, 0xFFFF],
    "object_id": [0, U64],
    "sequence": [(seq + 1) & U64, (seq - 1) & U64, 0, U64, seq + 2**32],
    "extent": [m + a, m + 1, max(a - 1, 1), U64, 2**63, 2**32 + a, U64 - 7, max(0, published - HEADER_LEN + a),
               rnd.randrange(1, max(m, 2)) | 1, (m // a) * a - 1 if m > a else 1],
    "flags": [0, 1, 0xFFFFFFFF],
    "reserved": [1, 0x80000000, 0xFFFFFFFF],
  }[name]
  return rnd.choice(choices) if rnd.random() < 0.7 else rnd.getrandbits(bits)


def mutate(rnd: random.Random, buf: bytearray, spec: RingSpec, seq: int) -> bytearray:
  op = rnd.random()
  if op < 0.45 and len(buf) >= HEADER_LEN:  # one header field
    name = rnd.choice(list(FIELD_AT))
    at, fmt = FIELD_AT[name]
    struct.pack_into(fmt, buf, at, interesting(rnd, name, spec, seq, len(buf)))
  elif op < 0.65:  # bit flips
    for _ in range(rnd.randint(1, 3)):
      i = rnd.randrange(min(len(buf), HEADER_LEN + 8))
      buf[i] ^= 1 << rnd.randrange(8)
  elif op < 0.80:  # truncate
    del buf[rnd.randrange(1, len(buf) + 1):]
  elif op < 0.90:  # random bytes over a part of the header
    i = rnd.randrange(len(buf))
    n = rnd.randint(1, 8)
    buf[i:i + n] = rnd.randbytes(min(n, len(buf) - i))
  else:  # more bytes after it
    buf += rnd.randbytes(rnd.randint(1, 64))
  return buf


def gen_input(rnd: random.Random, fr: FuzzRing) -> bytes:
  spec, cap, seq = fr.spec, fr.cap, fr.r.expected_sequence
  if rnd.random() < 0.3:  # near the end of the region: straddling headers, padding
    fr.steer(rnd.choice([8, 16, 24, 32, 40, 48, 56, 64, 96, 128, rnd.randrange(8, cap + 1)]))
  room = cap - fr.offset
  k = rnd.random()
  if k < 0.12:  # random bytes
    buf = bytearray(rnd.randbytes(rnd.randint(1, 160)))
  elif k < 0.20:  # a truncated valid header
    buf = valid_record(rnd, spec, seq)[:rnd.randint(1, HEADER_LEN - 1)]
  elif k < 0.35 and room < cap // 2:  # padding to the end of the region, then a record at offset 0
    rec = valid_record(rnd, spec, seq)
    if rnd.random() < 0.5: rec = mutate(rnd, rec, spec, seq)
    pad = bytearray(struct.pack("<II", PAD, 0) + rnd.randbytes(room - 8))  # what follows the marker is never read
    r2 = rnd.random()
    if r2 < 0.1: struct.pack_into("<I", pad, 4, rnd.getrandbits(32) | 1)   # marker with garbage
    buf = pad + rec
    if r2 > 0.9: del buf[rnd.randrange(1, room):]                          # padding not complete
    buf = buf[:cap]
  else:  # a valid record, mutated 0..3 times
    buf = valid_record(rnd, spec, seq)
    for _ in range(rnd.choice([0, 0, 1, 1, 1, 2, 3])):
      if buf: buf = mutate(rnd, buf, spec, seq)
  if not buf: buf = bytearray(rnd.randbytes(1))
  return bytes(buf[:cap])


# --- tests ---------------------------------------------------------------------------------------
def test_model_agrees_with_hand_written_cases():
  """The model itself, on cases whose outcome is known by hand (so a wrong model cannot pass quietly)."""
  good = HDR.pack(MAGIC, 1, 40, 7, 0, 8, 0, 0) + bytes(8)
  assert expect(good, 0, 1024, 64, 4, 0).kind == "record"
  assert expect(good, 0, 1024, 64, 4, 1).errors == {BAD_SEQ}
  assert expect(good, 0, 1024, 4, 4, 0).errors == {BAD_EXTENT}
  assert expect(good, 0, 1024, 64, 16, 0).errors == {BAD_ALIGN}
  assert expect(good[:40], 0, 1024, 64, 4, 0).errors == {BAD_EXTENT}          # payload not published
  assert expect(good[:32], 0, 1024, 64, 4, 0).errors == {EOF}
  assert expect(b"XXXX" + good[4:], 0, 1024, 64, 4, 0).errors == {BAD_MAGIC}
  assert expect(good, 1024 - 32, 1024, 64, 4, 0).errors == {BAD_HEADER}       # no room for a header
  pad = struct.pack("<II", PAD, 0) + bytes(24)
  assert expect(pad, 1024 - 32, 1024, 64, 4, 0).kind == "empty"
  assert expect(pad + good, 1024 - 32, 1024, 64, 4, 0).kind == "record"
  assert expect(pad[:16], 1024 - 32, 1024, 64, 4, 0).errors == {EOF}
  assert expect(struct.pack("<II", PAD, 1) + bytes(24), 1024 - 32, 1024, 64, 4, 0).errors == {BAD_HEADER}


def test_fuzz_random_and_mutated_headers():
  rnd = random.Random(SEED)
  t0 = time.monotonic()
  with Arena.create(SPECS, prefix=PREFIX) as arena:
    rings = fuzz_rings(arena)
    for i in range(N):
      fr = rings[i % len(rings)]
      raw = gen_input(rnd, fr)
      try:
        fr.run(raw, use_many=(i % 7 == 0))
      except AssertionError as e:
        raise AssertionError(f"input {i} (seed {SEED}) on ring {i % len(rings)} at offset {fr.offset}: {raw.hex()}\n{e}") from e
    total = sum((fr.outcomes for fr in rings), collections.Counter())
  print(f"{N} inputs in {time.monotonic() - t0:.1f} s: {dict(total)}")
  assert sum(total.values()) == N
  # the fuzzer reaches every outcome (a generator that stopped doing so would test little)
  missing = (NAMES | {"record", "padding only"}) - set(total)
  assert not missing or N < 10000, f"never produced: {missing}"


def test_fuzz_hypothesis_raw_bytes():
  with Arena.create(SPECS[:1], prefix=PREFIX) as arena:
    fr = FuzzRing(arena, 0)

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=st.binary(min_size=1, max_size=320), room=st.integers(1, 129).map(lambda x: x * 8), many=st.booleans())
    def check(raw, room, many):
      fr.steer(room)
      fr.run(raw, use_many=many)
    check()


def test_fuzz_hypothesis_header_fields():
  u16, u32, u64 = st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1), st.integers(0, U64)
  with Arena.create(SPECS[:1], prefix=PREFIX) as arena:
    fr = FuzzRing(arena, 0)
    spec = fr.spec

    @settings(max_examples=350, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(magic=st.sampled_from([MAGIC, MAGIC, PAD]) | u32,
           version=st.sampled_from([1, 1, 0, 2]) | u16,
           header_len=st.sampled_from([40, 40, 0, 39, 41]) | u16,
           object_id=u64,
           seq_delta=st.sampled_from([0, 0, 0, 1, -1]) | st.integers(-2**63, 2**63),
           extent=st.sampled_from([0, 4, spec.max_extent, spec.max_extent + 4, 3, 2**64 - 4]) | st.integers(0, 300) | u64,
           flags=u32, reserved=st.sampled_from([0, 0, 1]) | u32,
           published=st.integers(1, 400), room=st.integers(1, 129).map(lambda x: x * 8))
    def check(magic, version, header_len, object_id, seq_delta, extent, flags, reserved, published, room):
      fr.steer(room)
      seq = (fr.r.expected_sequence + seq_delta) & U64
      body = HDR.pack(magic, version, header_len, object_id, seq, extent, flags, reserved)
      body += bytes((i * 37 + 11) & 0xFF for i in range(max(0, min(published, fr.cap) - HEADER_LEN)))
      fr.run(body[:max(1, min(published, fr.cap))])
    check()
