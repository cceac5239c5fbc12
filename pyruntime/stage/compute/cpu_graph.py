"""A CPU stage's captured graphs, replayed from one native loop (native/mo_graph.h) instead of one Python call per kernel.

tinygrad 0.13 replays a captured graph on the CPU through its HCQ queue: each kernel is a command that a Python worker
thread runs with ctypes, and a kernel split over cores is handed to more Python threads and joined. On SmolLM2 that is
~30 ms of a ~45 ms decode step spent between kernels (bench/decode_step.py). `NativeCPUGraph` is the CPU device's graph
class instead: when tinygrad batches a captured graph's kernels, the batch becomes an array of launches (entry point,
argument words, cores) that `mo_graph_run` runs in order on this thread and a pool of native helper threads. The same
kernels, the same arguments, the same order, so the same bits; the graph cache keeps working (it stores the kernels,
and the batches are rebuilt on load).

A batch with anything but kernels (a copy), a launch size that depends on a variable, or more argument words than
MO_GRAPH_MAX_ARGS keeps tinygrad's graph (HCQGraph). PYRUNTIME_NATIVE_GRAPH=0 keeps it for every batch (to compare).
The pool's helpers spin for PYRUNTIME_GRAPH_SPIN_US (default 50) between split kernels, then sleep.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

from tinygrad.device import Buffer, Device
from tinygrad.engine.jit import GraphRunner
from tinygrad.helpers import CPU_COUNT, getenv
from tinygrad.runtime.graph.hcq import HCQGraph
from tinygrad.uop.ops import Ops, UOp

from pyruntime import errors

ENABLED = bool(getenv("PYRUNTIME_NATIVE_GRAPH", 1))
SPIN_US = getenv("PYRUNTIME_GRAPH_SPIN_US", 50)

try:
  from pyruntime._graph import ffi, lib
except ImportError:  # an install that predates the extension: tinygrad's graph still runs
  ffi = lib = None

_pool: tuple[int, Any, Any] | None = None  # (pid, aligned pool pointer, its memory)
_pool_lock = threading.Lock()


def available() -> bool:
  """Whether the native loop is built into this install (pyruntime._graph)."""
  return lib is not None


def pool() -> Any:
  """This process's helper pool (CPU_COUNT - 1 helpers): made on first use, and anew in a forked child, which has none
  of its parent's threads."""
  global _pool
  with _pool_lock:
    if _pool is None or _pool[0] != os.getpid():
      mem = ffi.new("char[]", lib.mo_pool_size() + lib.MO_GRAPH_ALIGN)
      at = -int(ffi.cast("uintptr_t", mem)) % lib.MO_GRAPH_ALIGN
      p = ffi.cast("mo_pool *", mem + at)
      if (rc := lib.mo_pool_init(p, max(0, CPU_COUNT.value - 1), SPIN_US * 1000)) != lib.MO_GRAPH_OK:
        raise errors.PyruntimeError(f"mo_pool_init: {ffi.string(lib.mo_graph_strerror(rc)).decode()}")
      _pool = (os.getpid(), p, mem)
    return _pool[1]


def _native_batch(linear: UOp) -> bool:
  """Whether every call of a batch is a kernel the native loop can launch (see the module's docstring)."""
  for call in linear.src[0].src:
    ast = call.src[0]
    if ast.op is not Ops.PROGRAM: return False
    info = ast.arg
    if not isinstance(info.global_size[0], int) or len(info.globals) + len(info.vars) > lib.MO_GRAPH_MAX_ARGS: return False
  return True


class NativeCPUGraph(GraphRunner):
  """tinygrad's graph interface (engine/jit.py GraphRunner) over mo_graph_run."""

  def __new__(cls, linear: UOp, input_uops: tuple[UOp, ...] = ()):
    if not (ENABLED and available() and _native_batch(linear)): return HCQGraph(linear, input_uops=input_uops)
    return super().__new__(cls)

  def __init__(self, linear: UOp, input_uops: tuple[UOp, ...] = ()):
    super().__init__(linear, input_uops)
    self.dev = Device[self.calls[0][2][0].device]
    self.launches = ffi.new("mo_kernel[]", len(self.calls))
    self.inputs: list[tuple[int, int, int]] = []  # (launch, argument word, input index)
    self.val_at: list[int] = []  # per launch: the word of its first int (after its buffers)
    for j, ((_, ast, bufs, device_vars), rt) in enumerate(zip(self.calls, self.runtimes, strict=True)):
      info, k = ast.arg, self.launches[j]
      k.fn = ffi.cast("void *", ctypes.cast(rt.fxn, ctypes.c_void_p).value)
      k.nargs, k.threads = len(info.globals) + len(info.vars), max(1, info.global_size[0])
      k.core_arg = len(info.globals) + info.runtimevars["core_id"] if "core_id" in info.runtimevars else -1
      for w, i in enumerate(info.globals): k.args[w] = _address(bufs[i])
      for i, v in enumerate(info.vars):
        if v.expr in device_vars: k.args[len(info.globals) + i] = device_vars[v.expr]
      self.val_at.append(len(info.globals))
      self.inputs += [(j, info.globals.index(pos), iidx) for pos, iidx in self.uop_replace[j] if pos in info.globals]

  def __call__(self, input_uops: tuple[UOp, ...], var_vals: dict[str, int], wait: bool = False) -> float | None:
    for j, w, iidx in self.inputs: self.launches[j].args[w] = _address(input_uops[iidx].buffer)
    for j, i, v in self.updated_vars(var_vals): self.launches[j].args[self.val_at[j] + i] = v
    self.dev.synchronize()  # what tinygrad queued before this graph (copies, eager kernels) has run
    t = time.perf_counter()
    if (rc := lib.mo_graph_run(pool(), self.launches, len(self.calls))) != lib.MO_GRAPH_OK:
      raise errors.PyruntimeError(f"mo_graph_run: {ffi.string(lib.mo_graph_strerror(rc)).decode()}")
    return time.perf_counter() - t if wait else None


def _address(buf: Buffer) -> int: return buf.ensure_allocated()._buf.va_addr


def install() -> bool:
  """Make NativeCPUGraph the graph of every CPU device, opened already or later. Returns whether it is in use."""
  if not (ENABLED and available()): return False
  from tinygrad.runtime.ops_cpu import CPUDevice
  graph_of_every(CPUDevice, "CPU", NativeCPUGraph)
  return True


def graph_of_every(device_class: type, base: str, graph: type) -> None:
  """Make `graph` the graph class of every `device_class` device (backend `base`), opened already or later: the
  backend's own __init__ sets its graph, so this wraps it (once; a second call changes the graph only)."""
  stock = getattr(device_class.__init__, "_stock_init", device_class.__init__)

  def init(self, *args, **kwargs) -> None:
    stock(self, *args, **kwargs)
    self.graph = graph
  init._stock_init = stock  # type: ignore[attr-defined]
  device_class.__init__ = init
  for name in list(Device._opened_devices):
    if name.split(":")[0] == base: Device[name].graph = graph
