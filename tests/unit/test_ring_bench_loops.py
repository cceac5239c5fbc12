"""The C benchmark loops (native/mo_ring_bench.h): built by native/ringbench.py into an extension of
their own, never into the shipped pyruntime._ring, and run over pyruntime's arenas."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from pyruntime import _ring
from pyruntime.transport.ring import Arena, RingSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "native"))  # native/ringbench.py: a checkout, not the package
import ringbench  # noqa: E402

PREFIX = "pyruntime-test"


def make(spec: RingSpec) -> Arena:
  return Arena.create([spec], prefix=PREFIX)


def test_the_shipped_extension_has_no_benchmark_loops():
  assert not hasattr(_ring.lib, "mo_bench_produce") and not hasattr(_ring.lib, "mo_bench_consume")
  assert hasattr(ringbench.load().lib, "mo_bench_produce") and ringbench.build() == ringbench.build()  # built once, then found


@pytest.mark.parametrize("size,batch", [(8, 64), (1 << 20, 64)])
def test_bench_loops(size, batch):
  """Both loops run in C with the GIL released (so two threads work); with 1 MiB records a batch
  of 64 is far more than the 4 MiB ring holds: the consumer must not block holding records."""
  n = 20000 if size == 8 else 40
  with make(RingSpec(4 << 20, 1 << 20)) as a:
    with ringbench.Producer(a, 0) as p, ringbench.Consumer(a, 0) as c:
      got = []
      t = threading.Thread(target=lambda: got.append(c.consume(n, batch, copy=size > 8)))
      t.start()
      assert p.produce(n, size, batch) == n
      t.join(60)
      assert got == [True] and (c.done, c.bytes) == (n, n * size)
      assert a.state(0)["tail_seq"] == n


def test_bench_produce_copies_its_sources_in_turn():
  """The C loop's copying producer sends what write(bytes) would -- record i is a copy of
  sources[(i >> shift) % len(sources)] -- and a pyruntime Reader reads it; a count that is not a
  power of two, or sources shorter than a payload, are refused."""
  srcs = [bytes([k]) * 24 + bytes(range(8)) for k in range(4)]
  with make(RingSpec(1 << 16, 64)) as a:
    r = a.reader(0)
    with ringbench.Producer(a, 0) as p:
      p.produce(16, 32, 1, srcs, shift=1)
      got = [(rec.object_id, bytes(rec.payload)) for rec in (r.read() for _ in range(16))]
      assert got == [(i, srcs[(i >> 1) & 3]) for i in range(16)]
      with pytest.raises(RuntimeError, match="InvalidArgument"):
        p.produce(20, 32, 1, srcs[:3])
      with pytest.raises(RuntimeError, match="InvalidArgument"):
        p.produce(20, 64, 1, srcs)  # sources shorter than a payload
      assert p.done == 16


def test_bench_consume_stops_at_close_and_at_unnumbered_records():
  """The C consumer drains a ring its producer closed (False: fewer than asked for), and refuses
  object ids that do not run consecutively within a batch."""
  with make(RingSpec(1 << 16, 64)) as a:
    w = a.writer(0)
    with ringbench.Consumer(a, 0) as c:
      for i in range(5): w.write(i, bytes([i]) * 16)
      w.close()
      assert c.consume(100, 8, copy=True) is False and (c.done, c.bytes) == (5, 80)
  with make(RingSpec(1 << 16, 64)) as a:
    w = a.writer(0)
    with ringbench.Consumer(a, 0) as c:
      for i in (0, 1, 3): w.write(i, bytes(8))
      with pytest.raises(RuntimeError, match="InvalidState"):
        c.consume(3, 8)
