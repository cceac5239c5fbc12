"""How a step's routed-expert products are best laid out on this machine, side by side in one run.

  python bench/expert_products.py [--rows 8] [--used 4] [--experts 16] [--out 384] [--inputs 512] [--matrices 8] [--device CPU]

The rows path (pyruntime/stage/compute/experts.py) computes each of a row's k experts as a product of that row with the
expert's column blocks (experts, out / VEC, in, VEC), read by the row's index. Compared, for rows x used (row, expert)
pairs over `matrices` expert matrices (distinct buffers, as a model's blocks are: together larger than the caches):
- the indices clamped into range (what experts.py does: the kernel loads the chosen block directly) or not (each load
  gated by a bounds check);
- the pairs in the rows' order, or sorted by expert (what grouping rows by expert would give: consecutive pairs read
  the same expert's blocks);
- the pairs' loop outermost, or the output blocks' (for an output block, every pair in turn).
Printed: the CPU, then the median milliseconds of one graph of `matrices` products per variant, and each ÷ the first.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from pyruntime.bench.machine import cpu
from tinygrad import Tensor, TinyJit, dtypes

from pyruntime.stage.compute import loop_schedules


def variant(wbs: list[Tensor], x: Tensor, sel_np: np.ndarray, clamp: bool, outputs_outer: bool, experts: int) -> float:
  P, K = x.shape
  sel = Tensor(sel_np, device=x.device).contiguous().realize()

  @TinyJit
  def products(x: Tensor, sel: Tensor) -> Tensor:
    if clamp: sel = sel.maximum(0).minimum(experts - 1)
    outs = []
    for wb in wbs:
      if outputs_outer: y = (x.reshape(1, P, K, 1) * wb.permute(1, 0, 2, 3)[:, sel]).sum(-2, dtype=dtypes.float32).permute(1, 0, 2)
      else: y = (x.reshape(P, 1, K, 1) * wb[sel]).sum(-2, dtype=dtypes.float32)
      outs.append(y.reshape(P, -1).contiguous())
    return Tensor.stack(*outs).contiguous()
  with loop_schedules.rows_schedules():
    for _ in range(3): products(x, sel).numpy()
    times = []
    for _ in range(11):
      t0 = time.perf_counter()
      products(x, sel).numpy()
      times.append(time.perf_counter() - t0)
  return 1e3 * sorted(times)[5]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--used", type=int, default=4)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--out", type=int, default=384)
  ap.add_argument("--inputs", type=int, default=512)
  ap.add_argument("--matrices", type=int, default=8)
  ap.add_argument("--device", default=None, help="a stage's device string (default: a stage's default, the CPU here)")
  a = ap.parse_args()
  from pyruntime.stage.compute.model import resolve_device
  device = resolve_device(a.device)
  print(cpu(), "on", device)
  VEC = loop_schedules.VEC
  wbs = [Tensor.randn(a.experts, a.out // VEC, a.inputs, VEC, dtype=dtypes.float16, device=device).contiguous().realize() for _ in range(a.matrices)]
  x = Tensor.randn(a.rows * a.used, a.inputs, device=device).contiguous().realize()
  rng = np.random.default_rng(0)
  pairs = np.concatenate([rng.choice(a.experts, a.used, replace=False) for _ in range(a.rows)]).astype(np.int32)
  first = None
  for clamp in (True, False):
    for name, order in (("rows' order", pairs), ("sorted by expert", np.sort(pairs))):
      for outer in (False, True):
        ms = variant(wbs, x, order, clamp, outer, a.experts)
        first = first or ms
        print(f"{'clamped' if clamp else 'gated  '}  {name:<17} {'output blocks outer' if outer else 'pairs outer        '}  "
              f"{ms:7.2f} ms  ({ms / first:.2f}x)")


if __name__ == "__main__":
  main()
