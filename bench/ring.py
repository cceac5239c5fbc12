"""Ring benchmark: pyruntime's MO01 rings against a C-only loop over the same library (the ceiling)
and the Python peers -- faster-fifo, pyzmq over ipc, a pure-Python ring over
multiprocessing.shared_memory, `multiprocessing.Queue` and `multiprocessing.Pipe` -- side by side
in one interleaved run (peers not installed are left out: `pip install -e ".[bench]"`).

    python bench/ring.py [--json] [--quick] [--sizes 8,1152,65536,1048576] [--duration S] [--plot FILE.png]
    pyruntime bench ring [same arguments]

Every measurement uses two processes forked from this one (producer and consumer, or pinger and
echo); this process only orchestrates and waits.  Measured (see bench/results/log-through-2026-12-03.md for the details):

  throughput  messages/s and GB/s (payload bytes only) for payloads of 8 B, 1152 B, 64 KiB, 1 MiB.
              A producer writes for `--duration` seconds then closes; the consumer reads until the
              ring says closed.  Rate = records / (consumer's end - producer's start), both taken
              from CLOCK_MONOTONIC.  Every row runs `--rounds` times, the rounds interleaved over
              all rows, and reports its best round (all of them in "all_msgs_per_s").  Modes:
                per-record  Writer.write(bytes) / Reader.next_record(); payload not touched
                batch       Writer.write_many(numpy rows) / Reader.read_many() + release()
                copy-out    per-record, and the consumer copies each payload out: rec.tobytes()
                copy-into   per-record, and the consumer copies each payload into one reused buffer
                            (rec.readinto(buf): a memcpy, as the C loop's copy-out does)
                view        per-record, and the consumer reads the payload in place through
                            rec.payload (a memoryview into the ring): its first and last byte
              The C loop (mo_bench_produce / mo_bench_consume, GIL released, no Python per record;
              native/mo_ring_bench.c, built on first use by native/ringbench.py: a checkout only)
              runs per-record (1 record per publish and per release; its consumer touches one byte
              of each payload in place: that is also its "view"), batch (256) and copy-out (memcpy
              of every payload into a scratch buffer).  Its producer copies each payload from the
              same buffers the Python producer sends, as Writer.write(bytes) does (--c-producer
              fill: fills it in place, stores only).  The peers send bytes per message.
              Every run checks that nothing was lost: the consumer's count equals the producer's,
              and sampled records have the right object id and the crc32 of the payload sent.
  latency     one-way latency = ping-pong round trip / 2 over two rings (two channels of each peer),
              p50 and p99, while spinning (pings back to back) and parked (1 ms between pings, far
              longer than the 20 us spin window, so the waiting side sleeps on its futex).
  idle        CPU % of a process blocked in Reader.read() on an empty ring for a few seconds
              (getrusage in the waiter, cross-checked with /proc/<pid>/stat from outside).
  overhead    single-process ns per call of the Python API's pieces, to say where the time goes.

--json prints one JSON list on stdout: throughput rows {"system", "payload_bytes", "mode",
"msgs_per_s", "gb_per_s", ...}, latency rows {"system", "payload_bytes", "p50_us", "p99_us", ...},
and extra rows (idle CPU, per-call overheads, targets) told apart by their "kind" field.
Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import struct
import sys
import time
import timeit
import traceback
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# run as a file from a checkout: its pyruntime first (installed, this is pyruntime/bench and pyruntime is importable)
if os.path.isdir(os.path.join(ROOT, "pyruntime")) and ROOT not in sys.path: sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from pyruntime import _ring, errors  # noqa: E402
from pyruntime.transport.ring import Arena, RingSpec, record_size  # noqa: E402

ffi, lib = _ring.ffi, _ring.lib
# The C loop's extension (not shipped: native/ringbench.py builds it from native/, which only a checkout has)
if os.path.isfile(os.path.join(ROOT, "native", "ringbench.py")):
  sys.path.insert(0, os.path.join(ROOT, "native"))
  import ringbench  # noqa: E402
else:
  ringbench = None

SIZES = (8, 1152, 64 << 10, 1 << 20)
KINDS = 4          # distinct payloads per size; record i carries payload kind (i >> shift) & 3
PARK_GAP_S = 1e-3  # sleep between pings in the parked latency run (spin window: 20 us)
CTX = mp.get_context("fork")
mono = time.monotonic
C_SYSTEM = "C loop (ceiling)"
PY_SYSTEM = "pyruntime"
Q_SYSTEM = "multiprocessing.Queue"
P_SYSTEM = "multiprocessing.Pipe"
PY_C_SYSTEM = "py producer -> C consumer"   # diagnostics: one side Python, the other the C loop
C_PY_SYSTEM = "C producer -> py consumer"
FF_SYSTEM = "faster-fifo"
ZMQ_SYSTEM = "pyzmq ipc"
PYSHM_SYSTEM = "pure-Python shm ring"
PEERS = (FF_SYSTEM, ZMQ_SYSTEM, PYSHM_SYSTEM, Q_SYSTEM, P_SYSTEM)  # the Python peers (targets: "the best peer")

TARGETS = {  # the targets (issues 2 and 10)
  "per_record_8": 5e6, "per_record_1152": 3e6, "batch_8": 20e6, "vs_best_peer_8": 2.0,
  "copy_ratio": 0.85, "view_ratio": 0.80, "spin_p50_us": 1.0, "parked_p50_us": 40.0, "idle_cpu_percent": 2.0,
}


def log(*a) -> None:
  print(*a, file=sys.stderr, flush=True)


# --- payloads and checks -------------------------------------------------------------------------
class Payloads:
  """The payloads of one size, known to both sides (built before the fork): KINDS distinct random
  byte strings, their crc32s, and the sampling: record i has kind (i >> shift) & 3 and is checked
  by the consumer when i % sample == 0 (sample = 1 << shift)."""

  def __init__(self, size: int):
    rng = np.random.default_rng(size)
    self.size = size
    self.bufs = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(KINDS)]
    self.crcs = [zlib.crc32(b) for b in self.bufs]
    self.shift = 12 if size <= 4096 else 8  # a crc32 of 64 KiB costs ~10 us: every 256th big record, not every 64th
    self.mask = (1 << self.shift) - 1

  def kind(self, i: int) -> int:
    return (i >> self.shift) & 3

  def check(self, i: int, object_id: int, payload) -> int:
    """Verify sampled record i; returns its crc for the run's sample checksum."""
    if object_id != i: raise AssertionError(f"record {i}: object id {object_id} (lost, duplicated or reordered)")
    crc = zlib.crc32(payload)
    if crc != self.crcs[self.kind(i)]: raise AssertionError(f"record {i}: payload crc {crc:#x}, expected {self.crcs[self.kind(i)]:#x}")
    return crc

  def sample_sum(self, count: int) -> int:
    return sum(self.crcs[self.kind(i)] for i in range(0, count, self.mask + 1))


def ring_spec(size: int) -> RingSpec:
  """1 MiB of ring for small payloads; at least four records of the big ones."""
  return RingSpec(capacity=max(1 << 20, 4 * record_size(size)), max_extent=max(size, 8), alignment=8)


def batch_records(size: int, capacity: int) -> int:
  """Records per write_many: a power of two (it divides the sample interval) filling <= 1/4 ring."""
  b = 1
  while b * 2 <= min(1024, capacity // (4 * record_size(size))): b *= 2
  return b


def chunk_records(size: int, cap: int = 4096) -> int:
  """Records between two looks at the clock (about 16 MiB of payload, at most `cap`)."""
  return max(1, min(cap, (16 << 20) // record_size(size)))


def _handle(side, name: str):
  h = getattr(side, name, None)
  if h is None: raise RuntimeError(f"{type(side).__name__} has no C handle {name!r}: bench/ring.py needs updating to ring.py")
  return h


# --- running two processes -----------------------------------------------------------------------
PIN: list[int] = []  # CPUs for the first and second process of a pair (main() fills it unless --no-pin)
C_FILL: list[bool] = []  # [True] with --c-producer fill: the C loop's producer fills payloads in place instead of copying


def _child(fn, barrier, tx, cpu) -> None:
  try:
    if cpu is not None: os.sched_setaffinity(0, {cpu})
    tx.send(("ok", fn(barrier)))
  except BaseException:
    barrier.abort()
    tx.send(("err", traceback.format_exc()))
  finally:
    tx.close()


def run_two(first, second, timeout: float, watch=None) -> list:
  """Run first(barrier) and second(barrier) in two forked processes; their return values, in order.
  `watch(pids)`, if given, runs here while they work.  Both are killed if anything goes wrong."""
  barrier = CTX.Barrier(2)
  procs, conns = [], []
  try:
    for k, fn in enumerate((first, second)):
      rx, tx = CTX.Pipe(duplex=False)
      p = CTX.Process(target=_child, args=(fn, barrier, tx, PIN[k] if PIN else None), daemon=True)
      p.start()
      tx.close()
      procs.append(p)
      conns.append(rx)
    extra = watch([p.pid for p in procs]) if watch else None
    out: dict = {}
    deadline = mono() + timeout
    while len(out) < 2:
      ready = mp.connection.wait([c for c in conns if conns.index(c) not in out], max(0.0, deadline - mono()))
      if not ready: raise TimeoutError(f"benchmark processes still running after {timeout:.0f} s")
      for c in ready:
        k = conns.index(c)
        try:
          status, val = c.recv()
        except EOFError:
          raise RuntimeError(f"benchmark process {procs[k].pid} died (exit code {procs[k].exitcode})") from None
        if status != "ok": raise RuntimeError(f"benchmark process failed:\n{val}")
        out[k] = val
    res = [out[0], out[1]]
    if watch: res.append(extra)
    return res
  finally:
    for p in procs:
      p.join(2)
      if p.is_alive():
        p.kill()
        p.join()
    for c in conns: c.close()


def with_arena(specs, first, second, timeout: float, watch=None) -> list:
  """run_two with an arena created here (and always unlinked); the functions get its name."""
  arena = Arena.create(specs)
  try:
    return run_two(lambda b: first(arena.name, b), lambda b: second(arena.name, b), timeout, watch)
  finally:
    arena.close()


def prefault(arena: Arena, index: int) -> None:
  """Touch every page of a ring's data region in this process (page-table faults, not timed)."""
  a = np.frombuffer(arena.data(index), dtype=np.uint8)
  int(a[::4096].sum())
  del a


# --- throughput: producers -------------------------------------------------------------------------
def produce_py_record(name, barrier, P: Payloads, dur: float) -> dict:
  with Arena.attach(name) as arena:
    w = arena.writer(0)
    prefault(arena, 0)
    barrier.wait()
    write, bufs, sh, ch = w.write, P.bufs, P.shift, chunk_records(P.size)
    i = 0
    t0 = mono()
    end = t0 + dur
    while True:
      for j in range(i, i + ch): write(j, bufs[(j >> sh) & 3])
      i += ch
      if mono() >= end: break
    w.close()
  return {"t0": t0, "count": i, "sample_sum": P.sample_sum(i)}


def produce_py_batch(name, barrier, P: Payloads, dur: float) -> dict:
  with Arena.attach(name) as arena:
    w = arena.writer(0)
    B = batch_records(P.size, arena.specs[0].capacity)
    rows = [np.frombuffer(b, dtype=np.uint8)[None, :].repeat(B, axis=0) for b in P.bufs]  # batches never mix kinds
    base = np.arange(B, dtype=np.uint64)
    prefault(arena, 0)
    barrier.wait()
    write_many, sh = w.write_many, P.shift
    per_check = max(1, chunk_records(P.size) // B)
    i = 0
    t0 = mono()
    end = t0 + dur
    while True:
      for _ in range(per_check):
        write_many(base + i, rows[(i >> sh) & 3])
        i += B
      if mono() >= end: break
    w.close()
  return {"t0": t0, "count": i, "sample_sum": P.sample_sum(i), "batch": B}


def produce_c(name, barrier, P: Payloads, dur: float, batch: int) -> dict:
  """The C loop's producer: P's payloads copied from their buffers, as Writer.write(bytes) does (or, with
  --c-producer fill, each payload filled in place: stores only, no reads; the ceiling before 2026-12-02)."""
  with Arena.attach(name) as arena, ringbench.Producer(arena, 0) as w:
    srcs = None if C_FILL else P.bufs
    ch = chunk_records(P.size, 1 << 16)
    prefault(arena, 0)
    barrier.wait()
    t0 = mono()
    end = t0 + dur
    while True:
      w.produce(w.done + ch, P.size, batch, srcs, P.shift)
      if mono() >= end: break
  return {"t0": t0, "count": w.done, "sample_sum": None if C_FILL else P.sample_sum(w.done)}


def send_for(send, P: Payloads, dur: float) -> tuple[float, int]:
  """Send P's payloads for `dur` seconds, checking the clock once per chunk; returns (start, count)."""
  bufs, sh, ch = P.bufs, P.shift, chunk_records(P.size, 1024)
  i = 0
  t0 = mono()
  end = t0 + dur
  while True:
    for j in range(i, i + ch): send(bufs[(j >> sh) & 3])
    i += ch
    if mono() >= end: break
  return t0, i






# --- peers: other ways for two Python processes to pass messages ------------------------------------
class Channel:
  """One direction between two forked processes.  open() runs in the parent before the fork;
  sender() / receiver() in the children, returning send(bytes) / recv() -> bytes; b"" marks the end
  (no payload measured here is empty).  close() runs in the parent afterwards."""

  def open(self) -> "Channel": return self
  def sender(self): raise NotImplementedError
  def receiver(self): raise NotImplementedError
  def finish_send(self) -> None: pass
  def close(self) -> None: pass


class FasterFifoChannel(Channel):
  """faster-fifo's Queue: a C++ circular buffer in shared memory behind a process-shared mutex and
  condition variables; put() pickles the message."""

  def open(self):
    import faster_fifo
    self.q = faster_fifo.Queue(max_size_bytes=8 << 20)
    return self

  def sender(self): return self.q.put
  def receiver(self): return self.q.get
  def close(self): self.q.close()


class ZmqChannel(Channel):
  """pyzmq PUSH -> PULL over an ipc:// (Unix socket) endpoint; contexts are made after the fork."""

  _n = 0

  def open(self):
    ZmqChannel._n += 1
    self.addr = f"ipc:///tmp/pyruntime-bench-{os.getpid()}-{ZmqChannel._n}.ipc"
    return self

  def sender(self):
    import zmq
    self.ctx = zmq.Context()
    self.sock = self.ctx.socket(zmq.PUSH)
    self.sock.connect(self.addr)
    return self.sock.send

  def receiver(self):
    import zmq
    self.ctx = zmq.Context()
    self.sock = self.ctx.socket(zmq.PULL)
    self.sock.bind(self.addr)
    return self.sock.recv

  def finish_send(self):
    self.sock.close(linger=-1)  # deliver everything queued before the process ends
    self.ctx.term()

  def close(self):
    try: os.unlink(self.addr[len("ipc://"):])
    except FileNotFoundError: pass


class PyShmRing(Channel):
  """A single-producer single-consumer byte ring written in pure Python over
  multiprocessing.shared_memory: 8-byte length + payload per record (8-aligned), free-running head
  and tail counters as two u64 in the first 128 bytes, busy-waiting on both sides.

  NOT a safe design on weakly ordered CPUs (ARM, POWER): Python has no memory-ordering primitives,
  so nothing orders the payload stores before the head store (nor the consumer's payload loads
  after its head load).  x86's total store order happens to make it work here; see bench/results/log-through-2026-12-03.md."""

  SKIP = 2**64 - 1  # length of a filler record that runs to the end of the region

  def __init__(self, capacity: int = 1 << 20):
    self.CAP = 1 << (capacity - 1).bit_length()  # a power of two, as pyruntime's ring rounds it

  def open(self):
    from multiprocessing import shared_memory
    self.shm = shared_memory.SharedMemory(create=True, size=128 + self.CAP)
    return self

  def _views(self):
    buf = self.shm.buf
    return buf[0:16].cast("Q"), buf[128:128 + self.CAP]

  def sender(self):
    ctrl, data = self._views()
    cap, mask, skip = self.CAP, self.CAP - 1, self.SKIP
    pack = struct.Struct("<Q").pack_into
    state = [0, 0]  # head, cached tail

    def send(msg: bytes) -> None:
      n = len(msg)
      need = 8 + ((n + 7) & ~7)
      head = state[0]
      off = head & mask
      if cap - off < need:  # a filler to the end, then start at 0
        while head + (cap - off) + need - state[1] > cap: state[1] = ctrl[1]
        pack(data, off, skip)
        head += cap - off
        off = 0
      while head + need - state[1] > cap: state[1] = ctrl[1]
      data[off + 8:off + 8 + n] = msg
      pack(data, off, n)
      head += need
      ctrl[0] = head  # publish (no barrier: see the class docstring)
      state[0] = head
    return send

  def receiver(self):
    ctrl, data = self._views()
    cap, mask, skip = self.CAP, self.CAP - 1, self.SKIP
    unpack = struct.Struct("<Q").unpack_from
    state = [0, 0]  # tail, cached head

    def recv() -> bytes:
      tail = state[0]
      while True:
        while tail == state[1]: state[1] = ctrl[0]
        off = tail & mask
        n = unpack(data, off)[0]
        if n != skip: break
        tail += cap - off
      msg = bytes(data[off + 8:off + 8 + n])
      tail += 8 + ((n + 7) & ~7)
      ctrl[1] = tail  # release
      state[0] = tail
      return msg
    return recv

  def close(self):
    self.shm.close()
    self.shm.unlink()


class QueueChannel(Channel):
  def open(self):
    self.q = CTX.Queue(maxsize=256)
    return self

  def sender(self): return self.q.put
  def receiver(self): return self.q.get

  def finish_send(self):
    self.q.close()
    self.q.join_thread()

  def close(self):
    self.q.close()
    self.q.cancel_join_thread()


class PipeChannel(Channel):
  def open(self):
    self.rx, self.tx = CTX.Pipe(duplex=False)
    return self

  def sender(self): return self.tx.send_bytes
  def receiver(self): return self.rx.recv_bytes

  def close(self):
    self.rx.close()
    self.tx.close()


CHANNELS = {FF_SYSTEM: FasterFifoChannel, ZMQ_SYSTEM: ZmqChannel, PYSHM_SYSTEM: PyShmRing, Q_SYSTEM: QueueChannel,
            P_SYSTEM: PipeChannel}


def make_channel(system: str, P: Payloads) -> Channel:
  if system == PYSHM_SYSTEM: return PyShmRing(ring_spec(P.size).capacity).open()
  return CHANNELS[system]().open()


def peer_available(system: str) -> bool:
  mod = {FF_SYSTEM: "faster_fifo", ZMQ_SYSTEM: "zmq"}.get(system)
  if mod is None: return True
  import importlib.util
  return importlib.util.find_spec(mod) is not None


def produce_peer(ch: Channel, barrier, P: Payloads, dur: float) -> dict:
  send = ch.sender()
  barrier.wait()
  t0, i = send_for(send, P, dur)
  send(b"")
  ch.finish_send()
  return {"t0": t0, "count": i, "sample_sum": P.sample_sum(i)}


def consume_peer(ch: Channel, barrier, P: Payloads) -> dict:
  recv, mask = ch.receiver(), P.mask
  barrier.wait()
  i = s = 0
  while m := recv():
    if not i & mask: s += P.check(i, i, m)
    i += 1
  t1 = mono()
  return {"t1": t1, "count": i, "sample_sum": s}


def latency_peer(system: str, P: Payloads, dur: float, gap: float, min_n: int, max_n: int, timeout: float) -> list[int]:
  ping_ch, pong_ch = make_channel(system, P), make_channel(system, P)

  def ping(barrier):
    send, recv = ping_ch.sender(), pong_ch.receiver()
    barrier.wait()
    buf, size = P.bufs[0], P.size

    def check(k):
      if len(recv()) != size: raise AssertionError("short pong")
    rtts = _pings(lambda k: send(buf), check, dur, gap, min_n, max_n)
    send(b"")
    ping_ch.finish_send()
    return rtts

  def echo(barrier):
    recv, send = ping_ch.receiver(), pong_ch.sender()
    barrier.wait()
    buf = P.bufs[1]
    while recv(): send(buf)
    pong_ch.finish_send()
    return 0
  try:
    rtts, _ = run_two(ping, echo, timeout)
  finally:
    ping_ch.close()
    pong_ch.close()
  return rtts


# --- throughput: consumers -------------------------------------------------------------------------
def check_c_payload(i: int, object_id: int, payload) -> int:
  """A sampled record of mo_bench_produce filling in place: object id i, every byte i & 0xff, the first 8 bytes i."""
  if object_id != i: raise AssertionError(f"record {i}: object id {object_id} (lost, duplicated or reordered)")
  p = memoryview(payload)
  if len(p) >= 8 and int.from_bytes(p[:8], "little") != i or len(p) > 8 and p[-1] != i & 0xFF:
    raise AssertionError(f"record {i}: payload is not mo_bench_produce's")
  return 0


def consume_py_record(name, barrier, P: Payloads, mode: str, c_producer: bool = False) -> dict:
  with Arena.attach(name) as arena:
    r = arena.reader(0)
    prefault(arena, 0)
    barrier.wait()
    nxt, mask, check = r.next_record, P.mask, (check_c_payload if c_producer and C_FILL else P.check)
    i = s = acc = 0
    try:
      if mode == "per-record":
        while True:
          rec = nxt()
          if not i & mask: s += check(i, rec.object_id, rec.payload)
          i += 1
      elif mode == "copy-out":
        while True:
          rec = nxt()
          data = rec.tobytes()
          if not i & mask: s += check(i, rec.object_id, data)
          i += 1
      elif mode == "copy-into":
        dst = bytearray(P.size)
        while True:
          rec = nxt()
          rec.readinto(dst)  # memcpy into one reused buffer, like the C loop's scratch
          if not i & mask: s += check(i, rec.object_id, dst)
          i += 1
      elif mode == "view":
        while True:
          rec = nxt()
          p = rec.payload
          acc ^= p[0] ^ p[-1]
          if not i & mask: s += check(i, rec.object_id, p)
          i += 1
      else:
        raise ValueError(mode)
    except errors.RingClosed:
      pass
    t1 = mono()
    r.release()
  return {"t1": t1, "count": i, "sample_sum": s}


def consume_py_batch(name, barrier, P: Payloads) -> dict:
  with Arena.attach(name) as arena:
    r = arena.reader(0)
    prefault(arena, 0)
    barrier.wait()
    read_many, release, mask = r.read_many, r.release, P.mask
    i = s = 0
    try:
      while True:
        b = read_many(1024)
        ids = b.object_id
        n = len(ids)
        if ids[0] != i or ids[n - 1] != i + n - 1:
          raise AssertionError(f"batch at {i}: object ids {int(ids[0])}..{int(ids[n - 1])} for {n} records")
        k = -i & mask  # first sampled record of the batch, if any
        while k < n:
          s += P.check(i + k, int(ids[k]), b.payload(k))
          k += mask + 1
        i += n
        release()
    except errors.RingClosed:
      pass
    t1 = mono()
  return {"t1": t1, "count": i, "sample_sum": s}


def consume_c(name, barrier, P: Payloads, batch: int, copy: bool) -> dict:
  with Arena.attach(name) as arena, ringbench.Consumer(arena, 0) as r:
    prefault(arena, 0)
    barrier.wait()
    r.consume(1 << 62, batch, copy)  # until the producer closes the ring
    t1 = mono()
    count = r.done
    if r.bytes != count * P.size: raise AssertionError(f"C consumer: {r.bytes} bytes for {count} records of {P.size}")
  return {"t1": t1, "count": count, "sample_sum": None}






def throughput(system: str, mode: str, P: Payloads, dur: float) -> dict:
  spec = ring_spec(P.size)
  timeout = 60 + 20 * dur
  if system == PY_SYSTEM:
    if mode == "batch":
      prod, cons = (lambda n, b: produce_py_batch(n, b, P, dur)), (lambda n, b: consume_py_batch(n, b, P))
    else:
      prod, cons = (lambda n, b: produce_py_record(n, b, P, dur)), (lambda n, b: consume_py_record(n, b, P, mode))
    pr, cr = with_arena([spec], prod, cons, timeout)
  elif system == PY_C_SYSTEM:  # Python producer, C consumer: the producer side alone
    pr, cr = with_arena([spec], lambda n, b: produce_py_record(n, b, P, dur), lambda n, b: consume_c(n, b, P, 1, False), timeout)
  elif system == C_PY_SYSTEM:  # C producer, Python consumer: the consumer side alone
    pr, cr = with_arena([spec], lambda n, b: produce_c(n, b, P, dur, 1),
                        lambda n, b: consume_py_record(n, b, P, mode, c_producer=True), timeout)
  elif system == C_SYSTEM:
    batch = 256 if mode == "batch" else 1
    pr, cr = with_arena([spec], lambda n, b: produce_c(n, b, P, dur, batch),
                        lambda n, b: consume_c(n, b, P, batch, mode == "copy-out"), timeout)
  elif system in CHANNELS:
    ch = make_channel(system, P)
    try:
      pr, cr = run_two(lambda b: produce_peer(ch, b, P, dur), lambda b: consume_peer(ch, b, P), timeout)
    finally:
      ch.close()
  else:
    raise ValueError(system)
  if pr["count"] != cr["count"]:
    raise AssertionError(f"{system} {mode} {P.size} B: producer sent {pr['count']} records, consumer got {cr['count']}")
  if None not in (pr["sample_sum"], cr["sample_sum"]) and pr["sample_sum"] != cr["sample_sum"]:
    raise AssertionError(f"{system} {mode} {P.size} B: sample checksum {cr['sample_sum']} != {pr['sample_sum']}")
  secs = cr["t1"] - pr["t0"]
  n = pr["count"]
  row = {"kind": "throughput", "system": system, "payload_bytes": P.size, "mode": mode,
         "msgs_per_s": round(n / secs, 1), "gb_per_s": round(n * P.size / secs / 1e9, 4),
         "records": n, "seconds": round(secs, 4), "verified": True, "cpus": list(PIN) or None}
  if "batch" in pr: row["batch_records"] = pr["batch"]
  return row


# --- latency ---------------------------------------------------------------------------------------
def _pings(send, recv_check, dur: float, gap: float, min_n: int, max_n: int, warmup: int = 50) -> list[int]:
  sleep, clock = time.sleep, time.perf_counter_ns
  for k in range(warmup):
    send(k)
    recv_check(k)
  rtts = []
  end = mono() + dur
  k = warmup
  while (len(rtts) < min_n or mono() < end) and len(rtts) < max_n:
    if gap: sleep(gap)
    t = clock()
    send(k)
    recv_check(k)
    rtts.append(clock() - t)
    k += 1
  return rtts


def ping_py(name, barrier, P: Payloads, dur, gap, min_n, max_n) -> list[int]:
  with Arena.attach(name) as arena:
    w, r = arena.writer(0), arena.reader(1)
    barrier.wait()
    write, nxt, buf = w.write, r.next_record, P.bufs[0]

    def recv_check(k):
      rec = nxt()
      if rec.object_id != k or rec.extent != P.size: raise AssertionError(f"pong {rec.object_id} ({rec.extent} B) for ping {k}")

    rtts = _pings(lambda k: write(k, buf), recv_check, dur, gap, min_n, max_n)
    w.close()
    r.release()
  return rtts


def echo_py(name, barrier, P: Payloads) -> int:
  with Arena.attach(name) as arena:
    r, w = arena.reader(0), arena.writer(1)
    barrier.wait()
    nxt, write, buf = r.next_record, w.write, P.bufs[1]  # the pong: a payload of the same size
    n = 0
    try:
      while True:
        write(nxt().object_id, buf)
        n += 1
    except errors.RingClosed:
      pass
    w.close()
  return n


def latency(system: str, mode: str, P: Payloads, dur: float, min_n: int) -> dict:
  gap = PARK_GAP_S if mode == "parked" else 0.0
  max_n = 200000
  timeout = 60 + 10 * dur + min_n * (gap + 0.002)
  if system == PY_SYSTEM:
    spec = ring_spec(P.size)
    rtts, _ = with_arena([spec, spec], lambda n, b: ping_py(n, b, P, dur, gap, min_n, max_n),
                         lambda n, b: echo_py(n, b, P), timeout)
  elif system in CHANNELS:
    rtts = latency_peer(system, P, dur, gap, min_n, max_n, timeout)
  else:
    raise ValueError(system)
  one_way = np.asarray(rtts, dtype=np.float64) / 2e3  # ns round trip -> us one way
  return {"kind": "latency", "system": system, "payload_bytes": P.size, "mode": mode,
          "p50_us": round(float(np.percentile(one_way, 50)), 3), "p99_us": round(float(np.percentile(one_way, 99)), 3),
          "samples": len(rtts), "cpus": list(PIN) or None, **({"gap_s": gap} if gap else {})}


# --- idle wait -------------------------------------------------------------------------------------
def _proc_cpu_s(pid: int) -> float:
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (fields 14, 15)


def _rusage_cpu_s() -> float:
  ru = resource.getrusage(resource.RUSAGE_SELF)
  return ru.ru_utime + ru.ru_stime


def idle_cpu(wait_s: float) -> list[dict]:
  """Three waiters at once, each blocked for wait_s on an empty channel: a Reader, a Pipe, a Queue."""
  arena = Arena.create([RingSpec(4096, 64)])
  rx, tx = CTX.Pipe(duplex=False)
  q = CTX.Queue()
  w = arena.writer(0)  # a live, idle producer (this process)
  barrier = CTX.Barrier(4)

  def waiter(block):
    def run(tx_):
      try:
        barrier.wait()
        c0, t0 = _rusage_cpu_s(), mono()
        extra = block()
        t1, c1 = mono(), _rusage_cpu_s()
        tx_.send(("ok", {"cpu_percent": 100 * (c1 - c0) / (t1 - t0), "wall_s": t1 - t0, **(extra or {})}))
      except BaseException:
        barrier.abort()
        tx_.send(("err", traceback.format_exc()))
    return run

  def ring_block():
    with Arena.attach(arena.name) as a:
      r = a.reader(0)
      try:
        r.read(timeout=wait_s)
        raise AssertionError("read a record from an idle ring")
      except errors.RingTimeout:
        pass
      return {"parks": r.stats["parks"]}

  def pipe_block():
    if rx.poll(wait_s): raise AssertionError("data on an idle pipe")

  def queue_block():
    try:
      q.get(timeout=wait_s)
      raise AssertionError("data on an idle queue")
    except Exception as e:  # queue.Empty
      if isinstance(e, AssertionError): raise

  systems = [(PY_SYSTEM, ring_block), (P_SYSTEM, pipe_block), (Q_SYSTEM, queue_block)]
  procs, conns = [], []
  try:
    for _, block in systems:
      r_, t_ = CTX.Pipe(duplex=False)
      p = CTX.Process(target=waiter(block), args=(t_,), daemon=True)
      p.start()
      t_.close()
      procs.append(p)
      conns.append(r_)
    barrier.wait()
    time.sleep(min(0.5, wait_s / 4))  # the waiters are in their blocking calls: sample from outside
    outside0 = [(_proc_cpu_s(p.pid), mono()) for p in procs]
    time.sleep(wait_s - 2 * min(0.5, wait_s / 4))
    outside1 = [(_proc_cpu_s(p.pid), mono()) for p in procs]
    rows = []
    for (system, _), c, (c0, t0), (c1, t1) in zip(systems, conns, outside0, outside1, strict=True):
      if not c.poll(wait_s + 30): raise TimeoutError(f"idle waiter of {system} did not report")
      status, val = c.recv()
      if status != "ok": raise RuntimeError(f"idle waiter of {system} failed:\n{val}")
      rows.append({"kind": "idle", "system": system, "payload_bytes": 0, "mode": "idle-wait",
                   "idle_cpu_percent": round(val["cpu_percent"], 3), "proc_cpu_percent": round(100 * (c1 - c0) / (t1 - t0), 2),
                   "wall_s": round(val["wall_s"], 2), **({"futex_parks": val["parks"]} if "parks" in val else {})})
    return rows
  finally:
    for p in procs:
      p.join(wait_s + 5)
      if p.is_alive():
        p.kill()
        p.join()
    for c in conns: c.close()
    rx.close()
    tx.close()
    q.close()
    q.cancel_join_thread()
    w.close()
    arena.close()


# --- overhead --------------------------------------------------------------------------------------
def overheads(quick: bool) -> list[dict]:
  """ns per call of the pieces of the per-record path, in this process (one side at a time)."""
  n = 20000 if quick else 50000
  reps = 3 if quick else 5
  rows = []

  def add(op: str, ns: float, note: str = "") -> None:
    rows.append({"kind": "overhead", "system": PY_SYSTEM, "op": op, "ns_per_call": round(ns, 1), **({"note": note} if note else {})})

  def best(fn, number=n) -> float:
    return min(timeit.repeat(fn, number=number, repeat=reps)) / number * 1e9

  import math
  add("python call of an empty function", best(lambda: None))
  add("python -> C builtin (math.floor)", best(lambda: math.floor(1.5)))
  add("cffi call, trivial C function (mo_record_size)", best(lambda: lib.mo_record_size(8)),
      "cffi API mode: argument unpacking + GIL release/reacquire + errno save/restore around every call")
  with Arena.create([RingSpec(1 << 22, 1 << 20, 8)]) as arena:
    w, r = arena.writer(0), arena.reader(0)
    p, c = _handle(w, "_p"), _handle(r, "_c")
    b8, b1152 = bytes(8), bytes(1152)
    k = 1024  # records per timed block: write k, then read k (the ring holds them)

    def timed_pair(write_one, read_one, number: int) -> tuple[float, float]:
      tw = tr = float("inf")
      for _ in range(reps):
        sw = sr = 0.0
        for _ in range(number // k):
          t = time.perf_counter()
          for _ in range(k): write_one()
          t2 = time.perf_counter()
          for _ in range(k): read_one()
          t3 = time.perf_counter()
          r.release()
          sw += t2 - t
          sr += t3 - t2
        tw, tr = min(tw, sw), min(tr, sr)
      return tw / number * 1e9, tr / number * 1e9

    put, take_next = lib.mo_producer_put, lib.mo_consumer_take_next
    ws, rs = timed_pair(lambda: put(p, 0, b8, 8), lambda: take_next(c), n)
    r.release()
    add("raw lib.mo_producer_put, 8 B", ws)
    add("raw lib.mo_consumer_take_next", rs)
    for size, buf in ((8, b8), (1152, b1152)):
      ws, rs = timed_pair(lambda buf=buf: w.write(0, buf), r.next_record, n)
      add(f"Writer.write, {size} B", ws)
      add(f"Reader.next_record ({size} B)", rs)
    w.write(1, b8)
    rec = r.next_record()
    add("Record.object_id", best(lambda: rec.object_id))
    add("Record.payload (memoryview slice)", best(lambda: rec.payload))
    add("bytes(rec.payload), 8 B", best(lambda: bytes(rec.payload)))
    add("rec.tobytes(), 8 B", best(lambda: rec.tobytes()))
    add("rec.array(np.uint8), 8 B", best(lambda: rec.array(np.uint8)))
    r.release()

    def reserve_commit():
      v = w.reserve(8)
      v[:] = b8
      w.commit(0)
    ws, _ = timed_pair(reserve_commit, r.next_record, n)
    add("Writer.reserve + fill + commit, 8 B", ws)
    nb = 1024
    rows8 = np.zeros((nb, 8), np.uint8)
    ids = np.arange(nb, dtype=np.uint64)
    tw = tr = float("inf")
    for _ in range(reps):
      sw = sr = 0.0
      for _ in range(max(1, n // nb)):
        t = time.perf_counter()
        w.write_many(ids, rows8)
        t2 = time.perf_counter()
        b = r.read_many(nb)
        assert len(b) == nb
        r.release()
        t3 = time.perf_counter()
        sw += t2 - t
        sr += t3 - t2
      tw, tr = min(tw, sw), min(tr, sr)
    add(f"Writer.write_many per record ({nb} x 8 B)", tw / (max(1, n // nb) * nb) * 1e9)
    add(f"Reader.read_many + release per record ({nb} x 8 B)", tr / (max(1, n // nb) * nb) * 1e9)
  return rows


# --- report ----------------------------------------------------------------------------------------
def fmt_size(n: int) -> str:
  return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB" if n >= 1 << 10 and not n % (1 << 10) else f"{n} B"


def targets(rows: list[dict]) -> list[dict]:
  tp = {(r["system"], r["payload_bytes"], r["mode"]): r for r in rows if r.get("kind") == "throughput"}
  lat = {(r["system"], r["payload_bytes"], r["mode"]): r for r in rows if r.get("kind") == "latency"}
  idle = {r["system"]: r for r in rows if r.get("kind") == "idle"}
  out = []

  def add(name, value, goal, higher=True, unit=""):
    if value is None: return
    out.append({"kind": "target", "target": name, "value": round(value, 4), "goal": goal, "unit": unit,
                "met": bool(value >= goal if higher else value <= goal)})

  def rate(size, mode, system=PY_SYSTEM):
    r = tp.get((system, size, mode))
    return r["msgs_per_s"] if r else None

  add("per-record 8 B, records/s", rate(8, "per-record"), TARGETS["per_record_8"])
  peer_rates = [(rate(8, "per-record", peer), peer) for peer in PEERS if rate(8, "per-record", peer)]
  if peer_rates and rate(8, "per-record"):
    best, who = max(peer_rates)
    add(f"per-record 8 B / best Python peer ({who}), x", rate(8, "per-record") / best, TARGETS["vs_best_peer_8"])
  add("per-record 1152 B, records/s", rate(1152, "per-record"), TARGETS["per_record_1152"])
  add("batch 8 B, records/s", rate(8, "batch"), TARGETS["batch_8"])
  for size in (64 << 10, 1 << 20):
    for mode, cmode, key in (("copy-out", "copy-out", "copy_ratio"), ("copy-into", "copy-out", "copy_ratio"),
                             ("view", "per-record", "view_ratio")):
      py, c = tp.get((PY_SYSTEM, size, mode)), tp.get((C_SYSTEM, size, cmode))
      if py and c: add(f"{fmt_size(size)} {mode} GB/s / C loop {cmode} GB/s", py["gb_per_s"] / c["gb_per_s"], TARGETS[key])
  for size in (8,):
    for mode, key in (("spin", "spin_p50_us"), ("parked", "parked_p50_us")):
      r = lat.get((PY_SYSTEM, size, mode))
      if r: add(f"latency p50 {mode}, {fmt_size(size)}", r["p50_us"], TARGETS[key], higher=False, unit="us")
  if PY_SYSTEM in idle: add("idle waiting reader, CPU %", idle[PY_SYSTEM]["idle_cpu_percent"], TARGETS["idle_cpu_percent"], higher=False, unit="%")
  return out


def print_report(rows: list[dict], cmd: str) -> None:
  p = print
  p(f"# {cmd}")
  m = next((r for r in rows if r.get("kind") == "machine"), None)
  p(f"# {os.cpu_count()} CPUs; the two processes of each pair " + (f"pinned to CPUs {PIN[0]} and {PIN[1]}" if PIN else "not pinned")
    + (f"; the C loop's producer: {m['c_producer']}; load average {m['loadavg_1min_before']} before, "
       f"{m['loadavg_1min_after']} after; {m['seconds']} s" if m else ""))
  tp = [r for r in rows if r.get("kind") == "throughput"]
  cref = {(r["payload_bytes"], r["mode"]): r for r in tp if r["system"] == C_SYSTEM}
  if tp:
    p("\n## Throughput (two processes; GB/s counts payload bytes)")
    p(f"{'payload':>8}  {'system':<26} {'mode':<11} {'msgs/s':>14} {'GB/s':>9}  {'vs C loop':>9}")
  for r in tp:
    cm = {"view": "per-record", "copy-into": "copy-out"}.get(r["mode"], r["mode"])
    c = cref.get((r["payload_bytes"], cm))
    ratio = f"{r['gb_per_s'] / c['gb_per_s']:9.1%}" if c and r["system"] != C_SYSTEM and c["gb_per_s"] else ""
    p(f"{fmt_size(r['payload_bytes']):>8}  {r['system']:<26} {r['mode']:<11} {r['msgs_per_s']:>14,.0f} {r['gb_per_s']:>9.3f}  {ratio:>9}")
  lat = [r for r in rows if r.get("kind") == "latency"]
  if lat:
    p("\n## One-way latency (round trip / 2)")
    p(f"{'payload':>8}  {'system':<26} {'mode':<7} {'p50 us':>9} {'p99 us':>9} {'samples':>8}")
    for r in lat:
      p(f"{fmt_size(r['payload_bytes']):>8}  {r['system']:<26} {r['mode']:<7} {r['p50_us']:>9.2f} {r['p99_us']:>9.2f} {r['samples']:>8}")
  idle = [r for r in rows if r.get("kind") == "idle"]
  if idle:
    p("\n## Idle wait: CPU of a process blocked on an empty channel")
    for r in idle:
      p(f"  {r['system']:<26} {r['idle_cpu_percent']:7.3f} % (getrusage)  {r['proc_cpu_percent']:6.2f} % (/proc)  over {r['wall_s']} s"
        + (f", {r['futex_parks']} futex waits" if "futex_parks" in r else ""))
  ov = [r for r in rows if r.get("kind") == "overhead"]
  if ov:
    p("\n## Where the time goes (one process, ns per call, best of repeats)")
    for r in ov: p(f"  {r['ns_per_call']:8.1f}  {r['op']}")
  tg = [r for r in rows if r.get("kind") == "target"]
  if tg:
    p("\n## Targets")
    for r in tg:
      rel = "<=" if r["unit"] in ("us", "%") else ">="
      p(f"  {'met   ' if r['met'] else 'MISSED'}  {r['target']}: {r['value']:,.3f}{r['unit']} (goal {rel} {r['goal']:,}{r['unit']})")


def plot(rows: list[dict], path: str, title: str) -> None:
  """Left: messages/s against payload size, log-log, one line per (system, mode) measured at more
  than one size.  Right: one-way latency p50 and p99 per system, spinning and parked."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax, lx) = plt.subplots(1, 2, figsize=(15, 6.5))
  lines: dict = {}
  for r in rows:
    if r.get("kind") == "throughput" and r["system"] not in (PY_C_SYSTEM, C_PY_SYSTEM):
      lines.setdefault((r["system"], r["mode"]), []).append((r["payload_bytes"], r["msgs_per_s"]))
  colors = plt.cm.tab20(np.linspace(0, 1, max(1, len(lines))))
  for color, ((system, mode), pts) in zip(colors, sorted(lines.items()), strict=True):
    pts.sort()
    style = "-" if system == PY_SYSTEM else "--" if system == C_SYSTEM else ":"
    ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", color=color,
            label=f"{system} ({mode})" if system in (PY_SYSTEM, C_SYSTEM) else system)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("payload bytes per record")
  ax.set_ylabel("messages / s (two processes)")
  ax.set_title("throughput")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="lower left")
  lat = [r for r in rows if r.get("kind") == "latency"]
  size = min((r["payload_bytes"] for r in lat), default=None)
  lat = [r for r in lat if r["payload_bytes"] == size]
  labels = [f"{r['system']}\n{r['mode']}" for r in lat]
  xs = np.arange(len(lat))
  lx.bar(xs - 0.2, [r["p50_us"] for r in lat], 0.4, label="p50")
  lx.bar(xs + 0.2, [r["p99_us"] for r in lat], 0.4, label="p99")
  lx.set_xticks(xs, labels, rotation=60, ha="right", fontsize=7)
  lx.set_yscale("log")
  lx.set_ylabel("one-way latency, us (round trip / 2)")
  lx.set_title(f"latency, {fmt_size(size) if size else ''} payloads")
  lx.grid(True, axis="y", which="both", alpha=0.3)
  lx.legend()
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="pyruntime bench ring", description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", action="store_true", help="print one JSON list of rows on stdout")
  ap.add_argument("--quick", action="store_true", help="shorter runs (about 30 s in all)")
  ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="payload sizes in bytes, comma-separated")
  ap.add_argument("--duration", type=float, default=None, help="seconds per throughput run (default 0.4, --quick 0.25)")
  ap.add_argument("--rounds", type=int, default=None, help="throughput runs per row, interleaved; the best is reported (default 3, --quick 1)")
  ap.add_argument("--skip", default="", help="comma-separated parts to skip: throughput,latency,idle,overhead")
  ap.add_argument("--no-pin", action="store_true", help="let the scheduler place the two processes (default: one CPU each)")
  ap.add_argument("--c-producer", choices=["copy", "fill"], default="copy",
                  help="the C loop's producer copies each payload from its buffer, as Writer.write(bytes) does (default), "
                       "or fills it in place (stores only: less work than any producer that sends data it holds)")
  ap.add_argument("--plot", metavar="FILE.png", help="also draw throughput against payload size (log-log) and latency percentiles")
  a = ap.parse_args(argv)
  cpus = sorted(os.sched_getaffinity(0))
  PIN[:] = cpus[:2] if len(cpus) >= 2 and not a.no_pin else []
  C_FILL[:] = [True] if a.c_producer == "fill" else []
  sizes = [int(s) for s in a.sizes.split(",") if s]
  if any(s <= 0 or s % 8 for s in sizes): ap.error("sizes must be positive multiples of 8")
  skip = set(filter(None, a.skip.split(",")))
  dur = a.duration if a.duration is not None else (0.25 if a.quick else 0.4)
  rounds = max(1, a.rounds if a.rounds is not None else (1 if a.quick else 3))
  lat_dur = 0.15 if a.quick else 0.4
  park_n = 60 if a.quick else 300
  idle_s = 1.5 if a.quick else 3.0
  started = mono()
  load0 = os.getloadavg()
  rows: list[dict] = []
  pays = {s: Payloads(s) for s in sizes}
  if "overhead" not in skip:
    log("overhead: per-call costs in one process")
    rows += overheads(a.quick)
  if "throughput" not in skip:
    plan = [(C_SYSTEM, m) for m in ("per-record", "batch", "copy-out")] + \
           [(PY_SYSTEM, m) for m in ("per-record", "batch", "copy-out", "copy-into", "view")] + \
           [(peer, "per-record") for peer in PEERS if peer_available(peer)]
    if not a.quick:
      plan += [(PY_C_SYSTEM, "per-record")] + [(C_PY_SYSTEM, m) for m in ("per-record", "copy-out", "copy-into", "view")]
    if ringbench is None:
      log("the C loop's rows are left out: its extension is built from native/, which only a checkout has")
      plan = [(system, mode) for system, mode in plan if system not in (C_SYSTEM, PY_C_SYSTEM, C_PY_SYSTEM)]
    else:
      ringbench.load()  # built (first time only) and loaded here, before the benchmark processes fork
    best: dict = {}
    for rnd in range(rounds):  # rounds interleave the systems: a burst of load elsewhere hits all of them alike
      for size in sizes:
        for system, mode in plan:
          row = throughput(system, mode, pays[size], dur)
          log(f"throughput {rnd + 1}/{rounds} {fmt_size(size):>8} {system:<26} {mode:<10} {row['msgs_per_s']:>14,.0f}/s "
              f"{row['gb_per_s']:8.3f} GB/s")
          key = (size, system, mode)
          runs = best.get(key, {}).get("all_msgs_per_s", []) + [row["msgs_per_s"]]
          if key not in best or row["msgs_per_s"] > best[key]["msgs_per_s"]: best[key] = row
          best[key]["all_msgs_per_s"] = runs
    rows += list(best.values())
  if "latency" not in skip:
    for size in sizes:
      for system in (PY_SYSTEM, *(peer for peer in PEERS if peer_available(peer))):
        for mode in ("spin", "parked"):
          row = latency(system, mode, pays[size], lat_dur if mode == "spin" else 0.0, 200 if mode == "spin" else park_n)
          log(f"latency {fmt_size(size):>8} {system:<26} {mode:<7} p50 {row['p50_us']:9.2f} us  p99 {row['p99_us']:9.2f} us")
          rows.append(row)
  if "idle" not in skip:
    log(f"idle: {idle_s} s blocked on empty channels")
    rows += idle_cpu(idle_s)
  rows += targets(rows)
  rows.append({"kind": "machine", "cpus": os.cpu_count(), "pinned_cpus": list(PIN) or None, "c_producer": a.c_producer,
               "python": sys.version.split()[0],
               "loadavg_1min_before": round(load0[0], 2), "loadavg_1min_after": round(os.getloadavg()[0], 2),
               "seconds": round(mono() - started, 1)})
  cmd = "python bench/ring.py " + " ".join(sys.argv[1:] if argv is None else argv)
  log(f"done in {mono() - started:.1f} s")
  if a.json:
    print(json.dumps(rows))
  else:
    print_report(rows, cmd.strip())
  if a.plot:
    plot(rows, a.plot, cmd.strip())
    log(f"plot written to {a.plot}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
