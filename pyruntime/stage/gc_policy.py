"""Garbage collection in a process that runs tinygrad: on its main thread only.

tinygrad 0.13's CPU device runs kernels on worker threads of its own (`ops_cpu.CPUWorker`). Python runs a cyclic
collection on whichever thread allocates past the threshold, so now and then it runs on such a worker, between two
kernels. If that collection frees a device buffer or a captured JIT graph, their `__del__` waits until the device's
task queue is empty: the queue this very thread is serving. The worker waits on itself, and every later
`synchronize()` (a `.numpy()`, a copy out) waits on it for ever. CI saw exactly this (the worker's stack: `_exec` ->
weakref callback -> `HCQGraph.__del__` -> `synchronize` -> `tasks.join()`).

So such a process turns automatic collection off and collects on its own thread at points where no tinygrad call is
in progress on it (`collect_due`: the generations the automatic policy would have collected, so memory behaves as
before). The stage process does this between records; the test suite between tests.
"""
from __future__ import annotations

import gc


def collect_on_this_thread() -> None:
  """From now on cyclic garbage is collected only by `collect_due` (or an explicit gc.collect) on the caller's thread."""
  gc.disable()


def collect_due() -> int:
  """Collect the oldest generation whose allocation count passed its threshold, as the automatic policy would;
  a cheap check when none is due. Returns the generation collected, -1 for none."""
  counts, thresholds = gc.get_count(), gc.get_threshold()
  due = [g for g in range(3) if counts[g] >= thresholds[g] > 0]
  if not due: return -1
  gc.collect(due[-1])
  return due[-1]
