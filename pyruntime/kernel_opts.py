"""Loop schedules for the prefill's kernels on a CPU, where tinygrad's heuristic leaves them scalar and on one core.

A prefill chunk runs with a symbolic token count (`toks`: 1..32), so that one captured JIT serves every chunk length
and where a prompt is cut changes no bit. tinygrad's hand-coded heuristic sizes its upcasts and its threads from the
kernel's element count, which it cannot resolve when an axis is symbolic: so every prefill kernel came out with few
accumulators per output and on one core (a 32-token chunk of SmolLM2 cost as much as
fifteen decode steps: each output a chain of dependent adds, on one of the cores).

`install()` wraps the heuristic. For a kernel with a symbolic output (loop) axis, after tinygrad's own choices, it
- upcasts the constant output axis (more independent accumulators per loaded input row);
- splits the constant output axis over the CPU cores (THREAD), as tinygrad does for fixed shapes.
None of these touches a reduce axis, and no kernel is fused or split differently (that is decided before opts): each
output is the same sum of the same terms in the same order, so every value is bit for bit what tinygrad's own
schedule computes. tests/test_kernel_opts.py checks that against a process without them. Kernels of fixed shape or of little work
(MIN_WORK), and devices with local memory (GPUs, where the opts differ), are left as tinygrad schedules them.
PYRUNTIME_PREFILL_OPTS=0 turns it off.
"""
from __future__ import annotations

from tinygrad.codegen.opt import KernelOptError, Opt, OptOps, heuristic
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.helpers import getenv, prod
from tinygrad.uop.ops import AxisType

UPCAST = 8  # accumulators added per output: 8 measured best of 4 and 8 on SmolLM2 (24 with tinygrad's own 3)
# a kernel doing less than this (multiply-adds at the largest token count and context) keeps tinygrad's schedule: its
# threads would cost more than they save, and bigger kernels compile slower (SmolLM2's smallest, a key projection of
# 32 tokens, does 3.5 M; a test model's whole block less than 1 M)
MIN_WORK = 1 << 20
_stock = heuristic.hand_coded_optimizations


def _loops(k: Scheduler, symbolic: bool) -> list[int]:
  return [i for i in k.axes_of(AxisType.LOOP) if isinstance(s := k.full_shape[i], int) != symbolic and (symbolic or s > 1)]


def prefill_optimizations(k: Scheduler) -> Scheduler:
  """tinygrad's heuristic, then (for a kernel with a symbolic loop axis on a device without local memory) the loop
  upcast and threads it could not size. Only output axes change: sums keep their order."""
  work = prod(s if isinstance(s, int) else int(s.vmax) for s in k.full_shape)  # at the variables' largest values
  k = _stock(k)
  if k.ren.has_local or work < MIN_WORK or not _loops(k, True) or not (const := _loops(k, False)): return k
  if any(o.op in (OptOps.GROUP, OptOps.GROUPTOP, OptOps.TC) for o in k.applied_opts): return k
  for i in const[::-1]:
    if k.full_shape[i] % UPCAST == 0 and k.upcast_size() * UPCAST <= 128:
      try:
        k.apply_opt(Opt(OptOps.UPCAST, i, UPCAST))
        break
      except KernelOptError: pass
  if k.ren.has_threads and k.ren.global_max and not any(o.op is OptOps.THREAD for o in k.applied_opts):
    n = k.ren.global_max[0]
    for i in _loops(k, False):
      if n > 1 and k.full_shape[i] % n == 0:
        try:
          k.apply_opt(Opt(OptOps.THREAD, i, n))
          break
        except KernelOptError: pass
  return k


def install() -> bool:
  """Put prefill_optimizations in place of tinygrad's heuristic (once; before any kernel is compiled). Returns whether
  it is in place."""
  if not getenv("PYRUNTIME_PREFILL_OPTS", 1): return False
  heuristic.hand_coded_optimizations = prefill_optimizations
  return True
