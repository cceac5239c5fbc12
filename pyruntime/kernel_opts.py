"""Loop schedules for the prefill's and the decode's kernels on a CPU, where tinygrad's heuristic leaves the
prefill's scalar and on one core, and has every thread of a batched decode step stream all the weights.

A prefill chunk runs with a symbolic token count (`toks`: 1..32), so that one captured JIT serves every chunk length
and where a prompt is cut changes no bit. tinygrad's hand-coded heuristic sizes its upcasts and its threads from the
kernel's element count, which it cannot resolve when an axis is symbolic: so every prefill kernel came out with few
accumulators per output and on one core (a 32-token chunk of SmolLM2 cost as much as fifteen decode steps).
A decode step's matmuls have a fixed shape, (rows, outputs, inputs); tinygrad threads the first loop axis it can
split, the rows, so with 8 streams each core reads every weight, and a batch of 8 cost twice a single row's step.

`install()` wraps the heuristic. After tinygrad's own choices, for
- a kernel with a symbolic output (loop) axis: upcast the constant output axis (more independent accumulators per
  loaded input row) and split it over the CPU cores (THREAD), as tinygrad does for fixed shapes;
- a reduce kernel of fixed shape: upcast the rows whole and the largest output axis by 4, re-apply tinygrad's own
  UNROLLs, and put tinygrad's thread count on the largest output axis.
None of these changes how a reduce axis is split, and no kernel is fused or split differently (that is decided before
opts): each output is the same sum of the same terms in the same order, so every value is bit for bit what
tinygrad's own schedule computes, and a row's bits do not depend on the batch beside it. tests/test_kernel_opts.py
checks that against a process without them. Kernels of little work (MIN_WORK), and devices with local memory (GPUs,
where the opts differ), are left as tinygrad schedules them. PYRUNTIME_LOOP_OPTS=0 turns it off.
"""
from __future__ import annotations

from tinygrad.codegen.opt import KernelOptError, Opt, OptOps, heuristic
from tinygrad.codegen.opt.postrange import Scheduler
from tinygrad.helpers import getenv, prod
from tinygrad.uop.ops import AxisType

UPCAST = 8  # prefill: accumulators added per output, 8 measured best of 4 and 8 on SmolLM2 (24 with tinygrad's own 3)
ROW_UPCAST = 8  # a fixed loop axis this small is the batch's rows: upcast whole, each loaded weight serves every row
OUT_UPCAST = 4  # then the largest output axis, 4 outputs per loaded input (measured: 8 rows x 4 outputs best on SmolLM2)
# a kernel doing less than this (multiply-adds at the largest token count and context) keeps tinygrad's schedule: its
# threads would cost more than they save, and bigger kernels compile slower (SmolLM2's smallest, a key projection of
# 32 tokens, does 3.5 M; a test model's whole block less than 1 M)
MIN_WORK = 1 << 20
_stock = heuristic.hand_coded_optimizations


def _loops(k: Scheduler, symbolic: bool) -> list[int]:
  return [i for i in k.axes_of(AxisType.LOOP) if isinstance(s := k.full_shape[i], int) != symbolic and (symbolic or s > 1)]


def _symbolic_schedule(k: Scheduler) -> Scheduler:
  """A kernel with a symbolic loop axis (a prefill chunk's tokens), after tinygrad's heuristic: the upcast and the
  threads it could not size, both on the constant output axis."""
  if not (const := _loops(k, False)) or any(o.op in (OptOps.GROUP, OptOps.GROUPTOP, OptOps.TC) for o in k.applied_opts): return k
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


def _fixed_schedule(k: Scheduler, stock: Scheduler) -> Scheduler:
  """A reduce kernel of fixed shape (a decode step's matmuls, one row per stream): tinygrad threads the first loop
  axis it can split, which for a batch is the rows, so every thread streams all of the weights; and it upcasts rows
  by 4, so a batch of 8 reads them twice. Here the rows are upcast whole, the largest output axis by 4, and tinygrad's
  thread count splits that output axis instead: each thread streams half of the weights, once. tinygrad's UNROLLs
  (the only reduce-axis opts it chose) are applied as they were, so each sum keeps its order."""
  if any(o.op not in (OptOps.UPCAST, OptOps.UNROLL, OptOps.THREAD) for o in stock.applied_opts): return stock
  t = k.copy()
  try:
    if (rows := next((i for i in _loops(t, False) if t.full_shape[i] <= ROW_UPCAST), None)) is not None:
      t.apply_opt(Opt(OptOps.UPCAST, rows, 0))
    _on_largest_output(t, OptOps.UPCAST, OUT_UPCAST)
    for o in stock.applied_opts:
      if o.op is OptOps.UNROLL: t.apply_opt(o)
    if (threads := next((o.arg for o in stock.applied_opts if o.op is OptOps.THREAD), 1)) > 1: _on_largest_output(t, OptOps.THREAD, threads)
  except KernelOptError: return stock
  return t


def _on_largest_output(k: Scheduler, op: OptOps, n: int) -> None:
  """Apply `op` of `n` to the largest loop axis, when `n` divides it (looked up anew: earlier opts renumber the axes)."""
  if (outs := _loops(k, False)) and k.full_shape[big := max(outs, key=lambda i: k.full_shape[i])] % n == 0:
    k.apply_opt(Opt(op, big, n))


def loop_optimizations(k: Scheduler) -> Scheduler:
  """tinygrad's heuristic, then on a device without local memory, for a kernel of at least MIN_WORK multiply-adds:
  the symbolic (prefill) or the fixed-shape (decode) loop schedule. Only output axes change: sums keep their order."""
  work = prod(s if isinstance(s, int) else int(s.vmax) for s in k.full_shape)  # at the variables' largest values
  stock = _stock(k)
  if stock.ren.has_local or work < MIN_WORK: return stock
  if _loops(k, True): return _symbolic_schedule(stock)
  return _fixed_schedule(k, stock) if k.axes_of(AxisType.REDUCE) else stock


def install() -> bool:
  """Put loop_optimizations in place of tinygrad's heuristic (once; before any kernel is compiled). Returns whether it
  is in place."""
  if not getenv("PYRUNTIME_LOOP_OPTS", 1): return False
  heuristic.hand_coded_optimizations = loop_optimizations
  return True
