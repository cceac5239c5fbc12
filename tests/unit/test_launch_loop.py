"""The native launch loop (native/mo_graph.h) with test-double kernels: cffi callbacks that record what each call got.
The real kernels (tinygrad's, a whole model's decode) run on it in tests/integration/test_cpu_graph.py (same bits as tinygrad's graph)."""
from __future__ import annotations

import threading

import pytest

from pyruntime.stage.compute import cpu_graph

ffi, lib = cpu_graph.ffi, cpu_graph.lib
WORDS = 32  # MO_GRAPH_MAX_ARGS: the callbacks' signature is fixed before the library is asked


def test_the_native_loop_is_built() -> None:
  assert cpu_graph.available(), "pyruntime._graph is missing: pip install -e . (or python native/build_graph.py) builds it"
  assert lib.MO_GRAPH_MAX_ARGS == WORDS
SIGNATURE = f"void({', '.join(['uint64_t'] * WORDS)})"


class RecordingKernel:
  """A test double of a compiled kernel: a C entry point that appends (name, thread, the words it got) to a log."""

  def __init__(self, name: str, log: list, lock: threading.Lock):
    def call(*words: int) -> None:
      with lock: log.append((name, threading.get_ident(), words))
    self.entry = ffi.callback(SIGNATURE, call)


def make_pool(helpers: int, spin_us: int = 50):
  mem = ffi.new("char[]", lib.mo_pool_size() + lib.MO_GRAPH_ALIGN)
  p = ffi.cast("mo_pool *", mem + (-int(ffi.cast("uintptr_t", mem)) % lib.MO_GRAPH_ALIGN))
  assert lib.mo_pool_init(p, helpers, spin_us * 1000) == lib.MO_GRAPH_OK
  return p, mem


def launches(specs: list[tuple[RecordingKernel, list[int], int, int]]):
  ks = ffi.new("mo_kernel[]", len(specs))
  for k, (kern, args, threads, core_arg) in zip(ks, specs, strict=True):
    k.fn, k.nargs, k.threads, k.core_arg = ffi.cast("void *", kern.entry), len(args), threads, core_arg
    for i, a in enumerate(args): k.args[i] = a & (2**64 - 1)
  return ks


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_launches_run_in_order_each_split_over_its_cores(helpers: int) -> None:
  log: list = []
  lock = threading.Lock()
  a, b, c = (RecordingKernel(n, log, lock) for n in "abc")
  pool, mem = make_pool(helpers)
  try:
    ks = launches([(a, [0x7F0000001000, 5], 1, -1), (b, [0x7F0000002000, 0, 9], 4, 1), (c, [1, 2, -3], 1, -1)] * 50)
    assert lib.mo_graph_run(pool, ks, len(ks)) == lib.MO_GRAPH_OK
  finally: lib.mo_pool_fini(pool)
  names = [n for n, _, _ in log]
  assert names == ["a", "b", "b", "b", "b", "c"] * 50  # b's cores all end before c starts (a launch ends on every core)
  cores = sorted(w[1] for n, _, w in log[1:5])
  assert cores == [0, 1, 2, 3]  # each core once, its number in the word core_arg names
  assert all(w[0] == 0x7F0000002000 and w[2] == 9 for n, _, w in log if n == "b")
  assert log[0][2][:2] == (0x7F0000001000, 5) and set(log[0][2][2:]) == {0}  # words past nargs are zeros
  assert log[5][2][2] & 0xFFFFFFFF == (-3) & 0xFFFFFFFF  # an int's low 32 bits, what the kernel's `int` reads
  main = threading.get_ident()
  assert {t for n, t, _ in log if n in "ac"} == {main}  # unsplit launches run on the caller
  split_threads = {t for n, t, _ in log if n == "b"}
  assert len(split_threads) == min(4, helpers + 1)  # the helpers share the split ones


def test_a_pool_sleeps_between_runs_and_wakes_for_the_next() -> None:
  log: list = []
  kern = RecordingKernel("k", log, threading.Lock())
  pool, mem = make_pool(1, spin_us=0)  # helpers go to sleep at once: every split launch has to wake them
  try:
    ks = launches([(kern, [0, 0], 2, 1)])
    for _ in range(200): assert lib.mo_graph_run(pool, ks, 1) == lib.MO_GRAPH_OK
  finally: lib.mo_pool_fini(pool)
  assert len(log) == 400


def test_bad_launches_and_pools_are_refused_by_name() -> None:
  kern = RecordingKernel("k", [], threading.Lock())
  pool, mem = make_pool(0)
  try:
    ks = launches([(kern, [1], 1, -1)])
    ks[0].nargs = WORDS + 1
    assert lib.mo_graph_run(pool, ks, 1) == lib.MO_GRAPH_EARGS
    ks[0].nargs, ks[0].core_arg = 1, WORDS
    assert lib.mo_graph_run(pool, ks, 1) == lib.MO_GRAPH_EARGS
    ks[0].core_arg, ks[0].fn = -1, ffi.NULL
    assert lib.mo_graph_run(pool, ks, 1) == lib.MO_GRAPH_EARGS
    assert b"MO_GRAPH_MAX_ARGS" in ffi.string(lib.mo_graph_strerror(lib.MO_GRAPH_EARGS))
  finally: lib.mo_pool_fini(pool)
  mem = ffi.new("char[]", lib.mo_pool_size() + lib.MO_GRAPH_ALIGN)
  odd = ffi.cast("mo_pool *", mem + (-int(ffi.cast("uintptr_t", mem)) % lib.MO_GRAPH_ALIGN) + 8)
  assert lib.mo_pool_init(odd, 1, 0) == lib.MO_GRAPH_EALIGN
  assert lib.mo_pool_init(ffi.cast("mo_pool *", mem + (-int(ffi.cast("uintptr_t", mem)) % lib.MO_GRAPH_ALIGN)), 10_000, 0) == lib.MO_GRAPH_EHELPERS
