"""MO01 rings in POSIX shared memory: the Python face of native/mo_ring.{h,c}.

    with Arena.create([RingSpec(capacity=1 << 20, max_extent=65536)]) as arena:
      w = arena.writer(0)                        # in the producing process (claims the side)
      seq = w.write(object_id=7, payload=b"...")
      r = Arena.attach(arena.name).reader(0)     # in the consuming process
      rec = r.read(timeout=1.0)                  # zero-copy: rec.payload is a view into the ring
      ...; r.release()                           # the record's bytes may be reused from here on

An arena is one shared-memory object holding N rings; each ring has one producer (Writer) and one
consumer (Reader), normally in different processes.  Records are MO01 (docs/wire-format.md).

Timeouts everywhere: None waits without limit (but still ends with RingClosed or PeerDead), 0
never waits (WouldBlock), a positive number of seconds waits at most that long (RingTimeout).
Blocking calls release the GIL and let signal handlers (Ctrl-C, SIGTERM) run.  (With the
pyruntime._ringfast binding, an unbounded read first watches the empty ring for at most 5 us with
the GIL held -- see native/mo_fast.c, FAST_GIL_SPIN_NS -- then waits without it.)

Writers and Readers are not thread-safe: use each from one thread at a time.
"""
from __future__ import annotations

import abc
import mmap
import operator
import os
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from pyruntime import errors
from pyruntime._ring import ffi, lib
from pyruntime.transport.shm import (
  DEFAULT_PREFIX,
  check_free_space,
  cleanup_stale,
  create_segment,
  open_segment,
  register_owned,
  segment_name,
  space_message,
  unlink_quietly,
  unregister_owned,
)

__all__ = ["Arena", "Writer", "Reader", "Record", "RecordBatch", "RingSpec", "cleanup_stale",
           "HEADER_LEN", "record_size", "encode_header"]


_FAST_API = 4  # FAST_API in native/mo_fast.c


def _load_fast():
  """pyruntime._ringfast (native/mo_fast.c) if it is built, is the API version this file uses (a
  stale build of older sources is ignored) and agrees with cffi on the handle layout; else
  None, and the ring runs on cffi alone."""
  try:
    from pyruntime import _ringfast
  except ImportError:
    return None
  same = (getattr(_ringfast, "API", 0), _ringfast.SIZEOF_PRODUCER, _ringfast.SIZEOF_CONSUMER, _ringfast.SIZEOF_VIEW) == \
      (_FAST_API, ffi.sizeof("mo_producer"), ffi.sizeof("mo_consumer"), ffi.sizeof("mo_view"))
  return _ringfast if same else None


_fast = _load_fast()
# Which binding new Writers and Readers use for their per-record calls: "fast" (the CPython
# extension) when it is there, else "cffi".  PYRUNTIME_RING_BINDING=cffi forces cffi (tests run
# both); the rest of the API is cffi either way.
BINDING = "fast" if _fast is not None and os.environ.get("PYRUNTIME_RING_BINDING", "fast") != "cffi" else "cffi"

HEADER_LEN = lib.MO_HEADER_LEN
MAX_CAPACITY = lib.MO_MAX_CAPACITY
MAX_EXTENT = lib.MO_MAX_EXTENT
_INTERRUPTED = lib.MO_INTERRUPTED
_INVALID_STATE = lib.MO_INVALID_STATE


def record_size(extent: int) -> int:
  """Bytes a record with `extent` payload bytes occupies in a ring (header + payload, 8-aligned).
  C's mo_record_size, so the framing arithmetic has one home."""
  return lib.mo_record_size(extent)


def encode_header(object_id: int, sequence: int, extent: int, flags: int = 0) -> bytes:
  """The 40-byte MO01 header, exactly as the producer writes it (for tests and tools): C's
  mo_record_encode, i.e. the producer's own mo_record_header_make."""
  buf = ffi.new("char[]", HEADER_LEN)
  lib.mo_record_encode(buf, object_id, sequence, extent, flags)
  return ffi.buffer(buf)[:]


def check_header(header, avail: int, max_extent: int, alignment: int, expected_sequence: int) -> tuple[int, int, int, int]:
  """Judge a 40-byte MO01 header that arrived from elsewhere (a bridge, docs/hosts.md) as the consumer judges one in
  the ring (C's mo_record_header_check): `avail` is the header and payload bytes its frame holds. Returns
  (object_id, sequence, extent, flags), or raises the RecordError / SequenceViolation a Reader would."""
  view = ffi.new("mo_view *")
  st = lib.mo_record_check(ffi.from_buffer(header), avail, max_extent, alignment, expected_sequence, view)
  if st: raise _error(st, "a record from a bridge", view)
  return view.object_id, view.sequence, view.extent, view.flags


# --- status -> exception -------------------------------------------------------------------------
_NAMES = {}
for _code in range(64):
  _name = ffi.string(lib.mo_status_name(_code)).decode()
  if _name != "Unknown": _NAMES[_code] = _name


def _error(status: int, context: str = "", view=None) -> errors.PyruntimeError:
  """The pyruntime exception for a C status (class looked up by the status name in errors.py)."""
  name = _NAMES.get(status, f"Status{status}")
  if status == lib.MO_SEQUENCE_VIOLATION:
    return errors.SequenceViolation(view.expected_sequence, view.sequence) if view is not None else \
        errors.SequenceViolation(-1, -1)
  message = f"{name}: {ffi.string(lib.mo_status_message(status)).decode()}"
  if view is not None and status in _RECORD_ERRORS:
    message += (f" (position {view.position}: magic {view.magic:#010x}, version {view.version}, "
                f"header_len {view.header_len}, extent {view.extent}, reserved {view.reserved})")
  if context: message += f" [{context}]"
  cls = getattr(errors, name, None)
  if not (isinstance(cls, type) and issubclass(cls, errors.RingError)): cls = errors.RingError
  return cls(message)


_RECORD_ERRORS = {lib.MO_EOF_BEFORE_FULL_HEADER, lib.MO_INVALID_OBJECT_MAGIC, lib.MO_INVALID_OBJECT_HEADER,
                  lib.MO_OBJECT_EXTENT_INVALID, lib.MO_OBJECT_EXTENT_ALIGNMENT_VIOLATION}


_MAX_NS = 2**63 - 1


def _timeout_ns(timeout: float | None) -> int:
  if timeout is None: return -1
  if not timeout >= 0: raise ValueError(f"timeout must be None or >= 0, got {timeout!r}")  # NaN too
  if timeout * 1e9 >= _MAX_NS: return _MAX_NS  # C saturates its deadline: this is "for ever" in practice
  ns = int(timeout * 1e9)
  return ns if ns > 0 or timeout == 0 else 1


def _remaining_ns(handle, timeout: float | None) -> int:
  """After MO_INTERRUPTED (Python's signal handlers have run by now): what is left to wait."""
  if timeout is None: return -1
  return max(1, handle.deadline_ns - time.monotonic_ns())  # 1 ns, not 0: "timed out", not "would block"


def _release_view(view: memoryview) -> None:
  try:
    view.release()
  except BufferError:
    pass  # exported (numpy arrays over it): it goes with the last of them


def _buffer(payload):
  """A cffi char[] over any C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
  try:
    return ffi.from_buffer(payload)
  except (TypeError, ValueError, BufferError) as e:
    raise ValueError(f"payload must be a C-contiguous bytes-like object, not {type(payload).__name__}: {e}") from e


# --- specs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingSpec:
  """One ring: `capacity` data bytes (rounded up to a power of two, at least 64), payloads of at
  most `max_extent` bytes whose length is a multiple of `alignment`.  A record takes
  record_size(extent) = round_up(40 + extent, 8) bytes of the capacity.  An arena stores
  max_extent capped at MAX_EXTENT (2**40 - 40): no ring holds a larger payload."""
  capacity: int
  max_extent: int
  alignment: int = 4

  def __post_init__(self):
    for field in ("capacity", "max_extent", "alignment"):
      v = getattr(self, field)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool): raise TypeError(f"RingSpec.{field} must be an int")
    if not 0 < self.capacity <= MAX_CAPACITY: raise ValueError(f"RingSpec.capacity must be in 1..{MAX_CAPACITY}")
    if not 0 <= self.max_extent < 2**64: raise ValueError("RingSpec.max_extent must be in 0..2**64-1")
    if not 0 < self.alignment < 2**32: raise ValueError("RingSpec.alignment must be in 1..2**32-1")


# --- arena ---------------------------------------------------------------------------------------
class Arena:
  """One POSIX shared-memory object with a versioned superblock and N rings.

  `create` makes a new one named "/{prefix}-{pid}-{random hex}" (the creator unlinks it on
  close, at exit, and on SIGTERM); `attach` maps an existing one by name.  Close with close() or
  a with-block; closing also closes the Writers and Readers taken from this Arena."""

  name: str
  ring_count: int
  specs: list[RingSpec]
  created: bool
  size: int

  def __init__(self, name: str, mm: mmap.mmap, size: int, created: bool):
    self.name, self.size, self.created = name, size, created
    self._mm = mm
    self._ptr = ffi.from_buffer(mm)
    self._mv = memoryview(mm)
    self._closed = False
    self._children: weakref.WeakSet = weakref.WeakSet()
    reason = ffi.new("char **")
    st = lib.mo_arena_check(self._ptr, size, ffi.cast("const char **", reason))
    if st != 0:
      why = ffi.string(reason[0]).decode()
      self._release_mapping()
      raise errors.ArenaInvalid(f"{name}: {why}")
    self.ring_count = lib.mo_arena_ring_count(self._ptr)
    self._rings = []
    for i in range(self.ring_count):
      r = ffi.new("mo_ring *")
      st = lib.mo_arena_ring(self._ptr, size, i, r)
      if st != 0:
        self._release_mapping()
        raise _error(st, f"{name} ring {i}")
      self._rings.append(r)
    self.specs = [RingSpec(r.capacity, r.max_extent, r.alignment) for r in self._rings]
    pid = ffi.new("int32_t *")
    lib.mo_arena_creator(self._ptr, size, pid, ffi.NULL)  # MO_OK: mo_arena_check passed above
    self.creator_pid = pid[0]

  @classmethod
  def create(cls, specs: Sequence[RingSpec], *, prefix: str = DEFAULT_PREFIX) -> "Arena":
    specs = list(specs)
    if not specs: raise ValueError("an arena needs at least one RingSpec")
    segment_name(prefix)  # ArenaInvalid for a bad prefix, before anything is created
    cfg = ffi.new("mo_ring_config[]", len(specs))
    for c, s in zip(cfg, specs, strict=True):
      if not isinstance(s, RingSpec): raise TypeError(f"expected RingSpec, got {type(s).__name__}")
      c.capacity, c.max_extent, c.alignment = s.capacity, s.max_extent, s.alignment
    size = lib.mo_arena_size(cfg, len(specs))
    if size == 0: raise ValueError(f"invalid ring specs (at most {lib.MO_MAX_RINGS} rings): {specs}")
    check_free_space(size)
    name = segment_name(f"/{prefix}-{os.getpid()}-{secrets.token_hex(6)}")  # e.g. a prefix too long for it
    fd = create_segment(name, size)
    register_owned(name)
    try:
      try:
        try:
          os.posix_fallocate(fd, 0, size)  # back every page now: ENOSPC here, not SIGBUS later
        except OSError as e:
          if e.errno == 28: raise errors.ShmSpaceError(space_message(size, None)) from e  # ENOSPC
          # EOPNOTSUPP / EINVAL: the filesystem cannot reserve; statvfs above was our check
        mm = mmap.mmap(fd, size)
      finally:
        os.close(fd)
      ptr = ffi.from_buffer(mm)
      st = lib.mo_arena_init(ptr, size, cfg, len(specs))
      ffi.release(ptr)
      if st != 0: raise _error(st, "mo_arena_init")
      return cls(name, mm, size, created=True)
    except BaseException:
      unlink_quietly(name)
      unregister_owned(name)
      raise

  @classmethod
  def attach(cls, name: str) -> "Arena":
    """Map arena `name` ("/x" or "x").  ArenaInvalid for a bad name, a missing segment, anything
    but a regular file owned by our uid (links are not followed, FIFOs cannot block), or bytes
    that are not an arena of this layout version."""
    name = segment_name(name)
    fd, size = open_segment(name)
    try:
      if size < lib.MO_SUPERBLOCK_FIXED:
        raise errors.ArenaInvalid(f"{name}: the segment is smaller than an arena superblock ({size} bytes)")
      mm = mmap.mmap(fd, size)
    finally:
      os.close(fd)
    return cls(name, mm, size, created=False)

  def writer(self, index: int) -> "Writer":
    """Claim the producer side of ring `index` (RingBusy if a live process holds it)."""
    return (_FastWriter if BINDING == "fast" else Writer)(self, self._ring(index))

  def reader(self, index: int) -> "Reader":
    """Claim the consumer side of ring `index` (RingBusy if a live process holds it)."""
    return (_FastReader if BINDING == "fast" else Reader)(self, self._ring(index))

  def _ring(self, index: int):
    if self._closed: raise errors.RingClosed(f"arena {self.name} is closed")
    if not 0 <= index < self.ring_count: raise IndexError(f"ring index {index} out of range 0..{self.ring_count - 1}")
    return self._rings[index]

  def state(self, index: int) -> dict:
    """A snapshot of ring `index`'s shared state: cursors, sequences, owners, closed flags."""
    s = ffi.new("mo_ring_state *")
    lib.mo_ring_snapshot(self._ring(index), s)
    return {f: getattr(s, f) for f in ("head", "tail", "head_seq", "tail_seq", "producer_pid", "consumer_pid",
                                       "producer_start", "consumer_start", "producer_closed", "consumer_closed",
                                       "reader_sleeping", "writer_sleeping")}

  def occupancy(self, index: int) -> float:
    """Fill fraction of ring `index` (published bytes not yet released over its capacity), from any process."""
    st = self.state(index)
    return (st["head"] - st["tail"]) / self.specs[index].capacity

  def data(self, index: int) -> memoryview:
    """Writable view of ring `index`'s data region: for tests and tools that craft raw bytes."""
    r = self._ring(index)
    return self._mv[r.data_offset:r.data_offset + r.capacity]

  def buffer(self) -> memoryview:
    """Writable view of the whole mapping (superblock included): for tests and tools."""
    if self._closed: raise errors.RingClosed(f"arena {self.name} is closed")
    return self._mv

  def close(self) -> None:
    """Close this process's Writers/Readers of the arena, unmap, and (creator) unlink.  Idempotent.
    The mapping itself lives on while payload views or arrays handed out still reference it."""
    if self._closed: return
    self._closed = True
    for child in list(self._children): child._shutdown()
    self._release_mapping()
    if self.created: self.unlink()

  def _release_mapping(self) -> None:
    ffi.release(self._ptr)
    self._rings = []
    _release_view(self._mv)
    try:
      self._mm.close()
    except BufferError:
      pass  # views handed out are alive: the mapping goes when the last of them does

  def unlink(self) -> None:
    """Remove the name (mappings stay valid until closed).  Idempotent."""
    unlink_quietly(self.name)
    unregister_owned(self.name)

  @property
  def closed(self) -> bool: return self._closed

  def __enter__(self) -> "Arena": return self
  def __exit__(self, *exc) -> None: self.close()

  def __repr__(self) -> str:
    return f"Arena({self.name!r}, rings={self.ring_count}, size={self.size}, created={self.created}, closed={self._closed})"


# --- producer ------------------------------------------------------------------------------------
class Writer:
  """The producer side of one ring.  Records get consecutive sequence numbers from 0."""

  __slots__ = ("_arena", "_p", "_data", "_write", "_put", "_res_view", "_written", "index", "spec", "__weakref__")

  def __init__(self, arena: Arena, ring):
    p = ffi.new("mo_producer *")
    st = lib.mo_producer_attach(p, ring)
    if st != 0: raise _error(st, f"{arena.name} ring {ring.index} producer side")
    p.wait_flags = lib.MO_WAIT_RETURN_ON_POLL  # so Python signal handlers run during long waits
    self._arena, self._p = arena, p
    self.index = ring.index
    self.spec = arena.specs[ring.index]
    self._data = arena._mv[ring.data_offset:ring.data_offset + ring.capacity]
    self._write = lib.mo_producer_write
    self._put = lib.mo_producer_put
    self._res_view = None
    self._written = ffi.new("uint32_t *")
    arena._children.add(self)

  # one record, one call
  def write(self, object_id: int, payload, flags: int = 0, timeout: float | None = None) -> int:
    """Copy `payload` (bytes, bytearray, memoryview, C-contiguous numpy array) into the ring as one
    record and publish it; returns its sequence.  Waits for space per `timeout`.

    With timeout=0 a record that must wrap around the end of the ring raises WouldBlock until the
    reader has passed the padding record (its next read attempt does), even on an empty ring."""
    if timeout is None and not flags and payload.__class__ is bytes:  # the 4-argument fast path
      r = self._put(self._p, object_id, payload, len(payload))
      if r < 0: return self._write_failed(-r, object_id, payload, flags, timeout)
      return r
    t = -1 if timeout is None else _timeout_ns(timeout)
    if payload.__class__ is bytes:
      r = self._write(self._p, object_id, flags, payload, len(payload), t)
    else:
      buf = _buffer(payload)
      r = self._write(self._p, object_id, flags, buf, len(buf), t)
    if r < 0: return self._write_failed(-r, object_id, payload, flags, timeout)
    return r

  def _write_failed(self, status, object_id, payload, flags, timeout):
    while status == _INTERRUPTED:
      buf = payload if payload.__class__ is bytes else _buffer(payload)
      r = self._write(self._p, object_id, flags, buf, len(buf), _remaining_ns(self._p, timeout))
      if r >= 0: return r
      status = -r
    raise self._fail(status)

  def _fail(self, status: int) -> errors.PyruntimeError:
    if status == _INVALID_STATE and self._arena._closed:
      return errors.RingClosed(f"arena {self._arena.name} is closed")
    return _error(status, f"{self._arena.name} ring {self.index} producer")

  # zero-copy: reserve, fill, commit
  def reserve(self, extent: int, timeout: float | None = None) -> memoryview:
    """Open a reservation of `extent` payload bytes; returns a writable view of that contiguous
    span in the ring.  Fill it, then commit() (or abort()).  One reservation at a time."""
    t = -1 if timeout is None else _timeout_ns(timeout)
    try:
      st = lib.mo_producer_reserve(self._p, extent, t, ffi.NULL)
    except OverflowError:  # negative or >= 2**64: no ring takes it, whatever its max_extent
      raise errors.OutputExtentInvalid(f"OutputExtentInvalid: extent {extent} is not in 0..{self.spec.max_extent}") from None
    while st == _INTERRUPTED:
      st = lib.mo_producer_reserve(self._p, extent, _remaining_ns(self._p, timeout), ffi.NULL)
    if st: raise self._fail(st)
    off = lib.mo_producer_reserved_offset(self._p)
    view = self._data[off:off + extent]
    self._res_view = view
    return view

  def commit(self, object_id: int, flags: int = 0, publish: bool = True) -> int:
    """Write the header of the open reservation and publish it (one store-release); returns its
    sequence.  With publish=False the record stays invisible until publish() or the next
    publishing commit: a batch of deferred commits becomes visible with one store."""
    r = lib.mo_producer_commit(self._p, object_id, flags) if publish else \
        lib.mo_producer_commit_deferred(self._p, object_id, flags)
    self._drop_view()
    if r < 0: raise self._fail(-r)
    return r

  def publish(self) -> int:
    """Publish every deferred commit; returns how many records became visible."""
    return lib.mo_producer_publish(self._p)

  def abort(self) -> None:
    """Drop the open reservation (nothing is published)."""
    lib.mo_producer_abort(self._p)
    self._drop_view()

  def _drop_view(self) -> None:
    v = self._res_view
    if v is not None:
      self._res_view = None
      try:
        v.release()  # writing through it after commit would corrupt a published record
      except BufferError:
        pass  # the caller exported it (e.g. np.frombuffer); can't revoke

  # batches
  def write_many(self, object_ids, payloads, flags=0, timeout: float | None = None, *,
                 record_size: int | None = None) -> int:
    """Write many records with one C call and one publishing store (more only when the ring fills
    meanwhile); returns the sequence of the first.  `payloads` is either a sequence of bytes-like
    objects, or one buffer split into records of `record_size` bytes, or a numpy array of shape
    (n, ...) whose rows are the payloads.  `object_ids` / `flags`: an int for all records, or
    one per record.  On an error after k records, those k are published and the exception has
    `written = k`."""
    # long (~55 lines): the hot path of both payload forms and the C call's retry loop, kept flat (no calls per record)
    lengths = None
    if isinstance(payloads, np.ndarray) and record_size is None:
      if payloads.ndim == 0: raise ValueError("payloads must have a leading record dimension")
      n = payloads.shape[0]
      fixed = payloads.nbytes // n if n else 0
      data = _buffer(payloads) if n else ffi.NULL
    elif record_size is not None:
      data = _buffer(payloads)
      total = len(data)
      if record_size < 0 or (record_size == 0 and total) or (record_size and total % record_size):
        raise ValueError(f"a buffer of {total} bytes does not split into records of {record_size} bytes")
      n = total // record_size if record_size else 0
      fixed = record_size
    else:
      views = [memoryview(x) for x in payloads]
      n = len(views)
      lens = np.fromiter((v.nbytes for v in views), dtype=np.uint64, count=n)
      blob = b"".join(views)
      data = ffi.from_buffer(blob) if blob else ffi.NULL
      lengths = ffi.from_buffer("uint64_t[]", lens)
      fixed = 0
    if n == 0: return self.next_sequence
    if n >= 2**32: raise ValueError("at most 2**32 - 1 records per batch")
    ids = self._per_record(object_ids, n, np.uint64, "object_ids")
    fl = self._per_record(flags, n, np.uint32, "flags")
    first = self._p.next_seq
    ids_p = ffi.from_buffer("uint64_t[]", ids) if ids is not None else ffi.NULL
    fl_p = ffi.from_buffer("uint32_t[]", fl) if fl is not None else ffi.NULL
    t = _timeout_ns(timeout)
    done = 0
    offset = 0
    while True:
      st = lib.mo_producer_write_many(self._p, ids_p + done if ids is not None else ffi.NULL,
                                      fl_p + done if fl is not None else ffi.NULL,
                                      data + offset if data != ffi.NULL else ffi.NULL,
                                      lengths + done if lengths is not None else ffi.NULL,
                                      fixed, n - done, t, self._written)
      k = self._written[0]
      offset += int(lens[done:done + k].sum()) if lengths is not None else k * fixed
      done += k
      if st == 0: return first
      if st != _INTERRUPTED:
        e = self._fail(st)
        e.written = done
        raise e
      t = _remaining_ns(self._p, timeout)

  @staticmethod
  def _per_record(value, n, dtype, what):
    if isinstance(value, (int, np.integer)):
      return None if value == 0 else np.full(n, value, dtype=dtype)
    arr = np.ascontiguousarray(value, dtype=dtype)
    if arr.shape != (n,): raise ValueError(f"{what} must be an int or have one entry per record ({n})")
    return arr

  # state
  @property
  def next_sequence(self) -> int:
    """The sequence the next committed record gets."""
    return self._p.next_seq

  def occupancy(self) -> float:
    """Fraction of the ring's data bytes in use (published and not yet released)."""
    return lib.mo_ring_occupancy(ffi.addressof(self._p, "r"))

  def peer_alive(self) -> bool:
    """False once the consumer's process is known to be dead (True while unclaimed)."""
    s = self._arena.state(self.index) if not self._arena._closed else None
    return s is None or s["consumer_pid"] == 0 or bool(lib.mo_process_alive(s["consumer_pid"], s["consumer_start"]))

  def set_wait(self, spin: float = 20e-6, poll: float = 0.1) -> None:
    """Spin `spin` seconds before parking; parked, wake every `poll` seconds to check the peer."""
    lib.mo_producer_set_wait(self._p, int(spin * 1e9), max(1, int(poll * 1e9)))

  @property
  def stats(self) -> dict:
    """Process-local counters: records committed, futex waits (parks), futex wakes issued."""
    return {"records": self._p.records, "parks": self._p.parks, "wakes": self._p.wakes}

  # tests and fuzzing
  def _publish_raw(self, data: bytes) -> None:
    """TEST/FUZZ ONLY: publish raw bytes (zero-padded to 8) with no framing."""
    buf = _buffer(data)
    st = lib.mo_producer_publish_raw(self._p, buf, len(buf))
    if st: raise self._fail(st)

  # lifetime
  def close(self) -> None:
    """Publish what is committed and mark the producer side closed: the reader drains what was
    published, then gets RingClosed.  Idempotent."""
    self._drop_view()
    lib.mo_producer_close(self._p)

  def detach(self) -> None:
    """Give up the producer side without closing it (another process may claim it)."""
    self._drop_view()
    lib.mo_producer_detach(self._p)

  def _shutdown(self) -> None:
    self.close()
    self._p.state = 0
    self._p.r.ctrl = ffi.NULL
    self._p.r.data = ffi.NULL
    _release_view(self._data)

  def __enter__(self) -> "Writer": return self
  def __exit__(self, *exc) -> None: self.close()
  def __repr__(self) -> str: return f"Writer({self._arena.name!r}, ring={self.index}, next_sequence={self._p.next_seq})"


class _FastWriter(Writer):
  """Writer whose per-record calls go through pyruntime._ringfast: same handle, same behaviour,
  no cffi call per record (the GIL is released only to wait or to copy a large payload).
  `write(object_id, payload, flags=0, timeout=None)` is a C entry point (an instance slot); an
  argument it does not take and every status but MO_OK come back to _write_slow."""

  __slots__ = ("_fw", "_fput", "write")

  def __init__(self, arena: Arena, ring):
    super().__init__(arena, ring)
    fw = _fast.Producer(ffi.buffer(self._p))
    self._fw, self._fput = fw, fw.put
    fw.bind(self, _FastWriter._write_slow)
    self.write = fw.fast_write

  def _write_slow(self, status: int, object_id: int, payload, flags: int = 0, timeout: float | None = None) -> int:
    """Writer.write after the C entry point: status 0 = not tried (a conversion it refused: the
    error is raised here, as Writer.write raises it)."""
    if status: return self._write_failed(status, object_id, payload, flags, timeout)
    try:
      if timeout is None and not flags:
        r = self._fput(object_id, payload)
      else:
        r = self._fw.write(object_id, payload, flags, _timeout_ns(timeout))
    except (TypeError, BufferError) as e:
      raise ValueError(f"payload must be a C-contiguous bytes-like object, not {type(payload).__name__}: {e}") from e
    if r < 0: return self._write_failed(-r, object_id, payload, flags, timeout)
    return r

  def reserve(self, extent: int, timeout: float | None = None) -> memoryview:
    t = -1 if timeout is None else _timeout_ns(timeout)
    try:
      off = self._fw.reserve(extent, t)
    except OverflowError:
      raise errors.OutputExtentInvalid(f"OutputExtentInvalid: extent {extent} is not in 0..{self.spec.max_extent}") from None
    while off == -_INTERRUPTED:
      off = self._fw.reserve(extent, _remaining_ns(self._p, timeout))
    if off < 0: raise self._fail(-off)
    view = self._data[off:off + extent]
    self._res_view = view
    return view

  def commit(self, object_id: int, flags: int = 0, publish: bool = True) -> int:
    r = self._fw.commit(object_id, flags, publish)
    self._drop_view()
    if r < 0: raise self._fail(-r)
    return r


# --- consumer ------------------------------------------------------------------------------------
class Record(metaclass=abc.ABCMeta):  # noqa: B024 - an ABC only so the fast binding's record type can register
  """One record, in place in the ring.  Valid until the Reader's next release(); the Reader reuses
  Record objects after that, so copy what you keep (`rec.tobytes()`, `rec.readinto(buf)`,
  `rec.array(...).copy()`).

  This class reads its fields through cffi; with pyruntime._ringfast the Reader hands out
  _FastRecord objects instead (same attributes, read in C; isinstance(rec, Record) holds)."""

  __slots__ = ("_reader", "_v")

  object_id = property(operator.attrgetter("_v.object_id"))
  sequence = property(operator.attrgetter("_v.sequence"))
  flags = property(operator.attrgetter("_v.flags"))
  extent = property(operator.attrgetter("_v.extent"))
  position = property(operator.attrgetter("_v.position"), doc="free-running byte position of the header")

  def __init__(self, reader: "Reader", view):
    self._reader, self._v = reader, view

  @property
  def payload(self) -> memoryview:
    """Read-only view of the payload in shared memory (no copy)."""
    v = self._v
    o = v.data_offset
    return self._reader._data[o:o + v.extent]

  def array(self, dtype, shape=None) -> np.ndarray:
    """Zero-copy read-only numpy view of the payload."""
    a = np.frombuffer(self.payload, dtype=dtype)
    return a if shape is None else a.reshape(shape)

  def tobytes(self) -> bytes:
    """A copy of the payload."""
    return bytes(self.payload)

  def readinto(self, buffer) -> int:
    """Copy the payload to the start of a writable buffer (bytearray, memoryview, numpy array) that
    holds at least `extent` bytes, without allocating; returns the bytes copied."""
    p = self.payload
    try:
      dst = memoryview(buffer).cast("B")
    except TypeError as e:
      raise ValueError(f"readinto needs a writable C-contiguous buffer, not {type(buffer).__name__}: {e}") from e
    if dst.readonly: raise ValueError("readinto needs a writable buffer")
    if len(dst) < len(p): raise ValueError(f"the buffer holds {len(dst)} bytes, the payload has {len(p)}")
    dst[:len(p)] = p
    return len(p)

  def __repr__(self) -> str:
    return (f"Record(object_id={self.object_id}, sequence={self.sequence}, flags={self.flags:#x}, "
            f"extent={self.extent})")


if _fast is not None:
  class _FastRecord(_fast.Record):
    """Record whose fields and payload are read in C (native/mo_fast.c): the getters object_id,
    sequence, flags, extent, position and payload, tobytes() and readinto(), come from the extension; the
    buffer protocol of the object itself is the payload (read-only)."""

    __slots__ = ()

    def array(self, dtype, shape=None) -> np.ndarray:
      """Zero-copy read-only numpy view of the payload."""
      a = np.frombuffer(self, dtype=dtype)
      return a if shape is None else a.reshape(shape)

    def __repr__(self) -> str:
      return (f"Record(object_id={self.object_id}, sequence={self.sequence}, flags={self.flags:#x}, "
              f"extent={self.extent})")

  Record.register(_FastRecord)


# struct mo_view as a numpy dtype, every name, width and offset taken from the C declaration
# (the payload pointer becomes a u8 address).
_VIEW_FIELDS = ffi.typeof("mo_view").fields
VIEW_DTYPE = np.dtype({"names": [name for name, _ in _VIEW_FIELDS],
                       "formats": [f"<u{ffi.sizeof(f.type)}" for _, f in _VIEW_FIELDS],
                       "offsets": [f.offset for _, f in _VIEW_FIELDS],
                       "itemsize": ffi.sizeof("mo_view")})


class RecordBatch:
  """Records taken by one Reader.read_many(), valid until the Reader's next release().  Header
  fields come as numpy arrays; payloads as views, a zero-copy 2-D array, or copied out at once."""

  __slots__ = ("_reader", "_raw", "views")

  def __init__(self, reader: "Reader", raw):
    """raw: the mo_view array, as bytes (copied out of cffi) or a VIEW_DTYPE array (filled in place)."""
    self._reader, self._raw = reader, raw
    self.views = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=VIEW_DTYPE)

  def __len__(self) -> int: return len(self.views)

  @property
  def object_id(self) -> np.ndarray: return self.views["object_id"]
  @property
  def sequence(self) -> np.ndarray: return self.views["sequence"]
  @property
  def flags(self) -> np.ndarray: return self.views["flags"]
  @property
  def extent(self) -> np.ndarray: return self.views["extent"]

  def payload(self, i: int) -> memoryview:
    row = self.views[i]
    o = int(row["data_offset"])
    return self._reader._data[o:o + int(row["extent"])]

  def payloads(self) -> list[memoryview]:
    data = self._reader._data
    return [data[o:o + e] for o, e in zip(self.views["data_offset"].tolist(), self.views["extent"].tolist(), strict=True)]

  def __getitem__(self, i: int) -> Record:
    n = len(self.views)
    if i < 0: i += n
    if not 0 <= i < n: raise IndexError(i)
    v = ffi.new("mo_view *")
    ffi.memmove(v, self.views[i:i + 1], VIEW_DTYPE.itemsize)
    return self._reader._record_of(v)

  def __iter__(self) -> Iterator[Record]:
    for i in range(len(self.views)): yield self[i]

  def gather(self, out=None):
    """Copy every payload back to back into `out` (a writable buffer; default a new bytearray of
    the total size); returns `out`.  One C call."""
    total = int(self.views["extent"].sum())
    if out is None: out = bytearray(total)
    dst = ffi.from_buffer(out, require_writable=True)
    if len(dst) < total: raise ValueError(f"out holds {len(dst)} bytes, the payloads {total}")
    r = lib.mo_consumer_gather(self._reader._c, ffi.from_buffer("mo_view[]", self._raw), len(self.views), dst, len(dst))
    if r < 0: raise self._reader._fail(-r)
    return out

  def array(self, dtype, shape=None) -> np.ndarray:
    """All payloads as one array of shape (len(batch), *shape): zero-copy (strided over the
    headers) when every record has the same extent and the batch does not wrap around the ring,
    else a copy."""
    dtype = np.dtype(dtype)
    n = len(self.views)
    ext = self.views["extent"]
    if n == 0: return np.empty((0,) + tuple(shape or (0,)), dtype)
    e = int(ext[0])
    if e % dtype.itemsize or not (ext == e).all():
      raise ValueError("array() needs records of one extent that is a multiple of the dtype size")
    inner = tuple(shape) if shape is not None else (e // dtype.itemsize,)
    pos = self.views["position"]
    rs = record_size(e)
    if int(pos[-1]) - int(pos[0]) == (n - 1) * rs:
      first = int(self.views["data_offset"][0])
      flat = np.ndarray((n, e // dtype.itemsize), dtype=dtype, buffer=self._reader._data, offset=first,
                        strides=(rs, dtype.itemsize))
      return flat.reshape((n,) + inner)
    return np.frombuffer(self.gather(), dtype=dtype).reshape((n,) + inner)

  def __repr__(self) -> str:
    return f"RecordBatch({len(self)} records)"


class Reader:
  """The consumer side of one ring."""

  __slots__ = ("_arena", "_c", "_data", "_recs", "_cap", "_pools", "_n", "_take", "_take_next", "_bviews", "_bcap",
               "_nptr", "index", "spec", "__weakref__")

  def __init__(self, arena: Arena, ring):
    c = ffi.new("mo_consumer *")
    st = lib.mo_consumer_attach(c, ring)
    if st != 0: raise _error(st, f"{arena.name} ring {ring.index} consumer side")
    c.wait_flags = lib.MO_WAIT_RETURN_ON_POLL
    self._arena, self._c = arena, c
    self.index = ring.index
    self.spec = arena.specs[ring.index]
    self._data = arena._mv[ring.data_offset:ring.data_offset + ring.capacity].toreadonly()
    self._pools = []
    self._cap = 0
    self._grow(8)
    self._n = 0  # == c.slot: records taken through read()/next_record() since the last release
    self._take = lib.mo_consumer_take
    self._take_next = lib.mo_consumer_take_next
    self._bcap = 0
    self._bviews = None
    self._nptr = ffi.new("uint32_t *")
    arena._children.add(self)

  def _grow(self, cap: int) -> None:
    """Give C a new array of view slots.  Records handed out keep pointing into the old array
    (kept alive here), which C no longer writes."""
    pool = ffi.new("mo_view[]", cap)
    self._pools.append(pool)
    self._c.views, self._c.nviews = pool, cap
    self._recs = [Record(self, pool + k) for k in range(cap)]
    self._cap = cap

  def _record_of(self, v) -> Record:
    """A Record over a cffi mo_view that the caller keeps (RecordBatch items)."""
    return Record(self, v)

  def read(self, timeout: float | None = None) -> Record:
    """The next record, validated, in place.  It stays valid until release().  Raises WouldBlock
    / RingTimeout / RingClosed (producer closed, all drained) / PeerDead (producer died, all
    drained) / a RecordError subclass for a bad record (the cursor does not move).

    Records not yet released occupy the ring: do not block for more while holding enough of them
    to fill it (the writer would wait on you while you wait on it)."""
    n = self._n
    if n == self._cap: self._grow(2 * n)
    st = self._take(self._c) if timeout is None else lib.mo_consumer_take_timed(self._c, _timeout_ns(timeout))
    if st:
      while st == _INTERRUPTED:
        st = lib.mo_consumer_take_timed(self._c, _remaining_ns(self._c, timeout))
      if st: raise self._fail(st, self._recs[n]._v)
    self._n = n + 1
    return self._recs[n]

  def next_record(self, timeout: float | None = None) -> Record:
    """release() then read() in one C call: the lean per-record loop."""
    self._n = 0
    st = self._take_next(self._c) if timeout is None else lib.mo_consumer_take_next_timed(self._c, _timeout_ns(timeout))
    if st:
      while st == _INTERRUPTED:
        st = lib.mo_consumer_take_timed(self._c, _remaining_ns(self._c, timeout))
      if st: raise self._fail(st, self._recs[0]._v)
    self._n = 1
    return self._recs[0]

  def __iter__(self) -> Iterator[Record]:
    """Records until the producer closes; each is released when the next one is taken."""
    while True:
      try:
        yield self.next_record()
      except errors.RingClosed:
        return

  def release(self) -> int:
    """Hand every record read so far back to the producer (one store); returns how many."""
    self._n = 0
    return lib.mo_consumer_release(self._c)

  release_many = release

  def read_many(self, max_records: int = 1024, timeout: float | None = None) -> RecordBatch:
    """Wait per `timeout` for one record, then take every published record up to `max_records`
    (one C call).  The batch stays valid until release()/release_many()."""
    if max_records < 1: raise ValueError("max_records must be >= 1")
    if max_records > self._bcap:
      self._bcap = max(max_records, 64)
      self._bviews = ffi.new("mo_view[]", self._bcap)
    t = -1 if timeout is None else _timeout_ns(timeout)
    st = lib.mo_consumer_read_many(self._c, self._bviews, max_records, t, self._nptr)
    while st == _INTERRUPTED:
      st = lib.mo_consumer_read_many(self._c, self._bviews, max_records, _remaining_ns(self._c, timeout), self._nptr)
    if st: raise self._fail(st, self._bviews[0])
    n = self._nptr[0]
    return RecordBatch(self, ffi.buffer(self._bviews, n * VIEW_DTYPE.itemsize)[:])

  def _fail(self, status: int, view=None) -> errors.PyruntimeError:
    if status == _INVALID_STATE and self._arena._closed:
      return errors.RingClosed(f"arena {self._arena.name} is closed")
    return _error(status, f"{self._arena.name} ring {self.index} consumer", view)

  # state
  @property
  def expected_sequence(self) -> int:
    """The sequence the next record must carry."""
    return self._c.next_seq

  @property
  def position(self) -> int:
    """Free-running byte position of the next record to read."""
    return self._c.rpos

  @property
  def outstanding(self) -> int:
    """Records read and not yet released."""
    return self._c.outstanding

  def occupancy(self) -> float:
    return lib.mo_ring_occupancy(ffi.addressof(self._c, "r"))

  def peer_alive(self) -> bool:
    """False once the producer's process is known to be dead (True while unclaimed)."""
    s = self._arena.state(self.index) if not self._arena._closed else None
    return s is None or s["producer_pid"] == 0 or bool(lib.mo_process_alive(s["producer_pid"], s["producer_start"]))

  def set_wait(self, spin: float = 20e-6, poll: float = 0.1) -> None:
    """Spin `spin` seconds before parking; parked, wake every `poll` seconds to check the peer."""
    lib.mo_consumer_set_wait(self._c, int(spin * 1e9), max(1, int(poll * 1e9)))

  @property
  def stats(self) -> dict:
    return {"records": self._c.records, "parks": self._c.parks, "wakes": self._c.wakes}

  def discard(self) -> int:
    """Release everything and skip every published byte unread (recovery after a bad record,
    and fuzzing).  The expected sequence does not change.  Returns the bytes skipped."""
    self._n = 0
    return lib.mo_consumer_discard(self._c)

  # lifetime
  def close(self) -> None:
    """Release everything and mark the consumer side closed (the writer gets RingClosed)."""
    self._n = 0
    lib.mo_consumer_close(self._c)

  def detach(self) -> None:
    """Give up the consumer side without closing it (another process may claim it and resumes
    at the last release)."""
    self._n = 0
    lib.mo_consumer_detach(self._c)

  def _shutdown(self) -> None:
    self.close()
    self._c.state = 0
    self._c.r.ctrl = ffi.NULL
    self._c.r.data = ffi.NULL
    _release_view(self._data)

  def __enter__(self) -> "Reader": return self
  def __exit__(self, *exc) -> None: self.close()
  def __repr__(self) -> str: return f"Reader({self._arena.name!r}, ring={self.index}, expected_sequence={self._c.next_seq})"


class _FastReader(Reader):
  """Reader whose per-record calls go through pyruntime._ringfast: `read(timeout=None)` and
  `next_record(timeout=None)` are C entry points (instance slots) that return a _FastRecord;
  anything else (a bad timeout, a grown pool, a status that is not MO_OK) comes back to
  _read_slow/_next_slow."""

  __slots__ = ("_fc", "_ftake", "read", "next_record")

  def __init__(self, arena: Arena, ring):
    super().__init__(arena, ring)  # _grow(8) below runs before _fc exists
    fc = _fast.Consumer(ffi.buffer(self._c))
    self._fc, self._ftake = fc, fc.take
    fc.set_records(self._recs)
    fc.bind(self, _FastReader._read_slow, _FastReader._next_slow)
    self.read, self.next_record = fc.fast_read, fc.fast_next

  def _grow(self, cap: int) -> None:
    pool = ffi.new("mo_view[]", cap)
    self._pools.append(pool)
    self._c.views, self._c.nviews = pool, cap
    views, data = ffi.buffer(pool), self._data
    self._recs = [_FastRecord(views, k, data) for k in range(cap)]
    self._cap = cap
    fc = getattr(self, "_fc", None)
    if fc is not None: fc.set_records(self._recs)

  def _record_of(self, v) -> Record:
    return _FastRecord(ffi.buffer(v), 0, self._data)

  def _read_slow(self, status: int, timeout: float | None = None) -> Record:
    """Reader.read after the C entry point: status 0 = not tried (a bad timeout, or no free slot)."""
    c = self._c
    if not status:
      t = -1 if timeout is None else _timeout_ns(timeout)
      if c.slot == self._cap: self._grow(2 * self._cap)
      status = self._ftake(t)
    while status == _INTERRUPTED:
      status = self._ftake(_remaining_ns(c, timeout))
    if status: raise self._fail(status, c.views + c.slot)
    return self._recs[c.slot - 1]

  def _next_slow(self, status: int, timeout: float | None = None) -> Record:
    """Reader.next_record after the C entry point: status 0 = not tried (a bad timeout)."""
    if not status: status = self._fc.take_next(-1 if timeout is None else _timeout_ns(timeout))
    while status == _INTERRUPTED:
      status = self._ftake(_remaining_ns(self._c, timeout))
    if status: raise self._fail(status, self._c.views)
    return self._recs[0]

  def release(self) -> int:
    self._n = 0
    return self._fc.release()

  release_many = release

  def read_many(self, max_records: int = 1024, timeout: float | None = None) -> RecordBatch:
    if max_records < 1: raise ValueError("max_records must be >= 1")
    out = np.empty(max_records, dtype=VIEW_DTYPE)  # the batch's own array: C fills it in place
    n = self._fc.read_many(out, max_records, -1 if timeout is None else _timeout_ns(timeout))
    while n == -_INTERRUPTED:
      n = self._fc.read_many(out, max_records, _remaining_ns(self._c, timeout))
    if n < 0: raise self._fail(-n, ffi.from_buffer("mo_view[]", out)[0])
    return RecordBatch(self, out[:n])
