"""How a step's routed-expert products are best laid out on this machine, side by side in one run.

  python bench/expert_products.py [--rows 8] [--used 4] [--experts 16] [--out 384] [--inputs 512] [--matrices 8] [--device CPU]
  python bench/expert_products.py --packed [--rows 16 --used 8 --experts 128 --out 768 --inputs 2048 --matrices 2]

The rows path (pyruntime/stage/compute/experts.py) computes each of a row's k experts as a product of that row with the
expert's column blocks (experts, out / VEC, in, VEC), read by the row's index. Compared, for rows x used (row, expert)
pairs over `matrices` expert matrices (distinct buffers, as a model's blocks are: together larger than the caches):
- the indices clamped into range (what experts.py does: the kernel loads the chosen block directly) or not (each load
  gated by a bounds check);
- the pairs in the rows' order, or sorted by expert (what grouping rows by expert would give: consecutive pairs read
  the same expert's blocks);
- the pairs' loop outermost, or the output blocks' (for an output block, every pair in turn).
With `--packed` the experts are Q4_0 codes (packed.PackedMatrix, the CPU's default form) and the two ways to read the
chosen ones are compared: the packed arrays gathered by index and then rebuilt (what experts.py did until the
seventeenth session: tinygrad copies every chosen expert's codes into a buffer of their own first), or the values
rebuilt and then indexed (`matrix()[sel]`, what it does: one kernel loads each chosen block by index).
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
  return _median_ms(products, x, sel)


def packed_experts(a: argparse.Namespace, device: str, rng: np.random.Generator) -> list:
  """`a.matrices` expert tensors of random Q4_0 blocks, repacked as the stage holds them."""
  from pyruntime.stage.compute.packed import PackedMatrix, repack
  nb = a.out * a.inputs // 32
  def one() -> object:
    blk = np.zeros((nb, 18), np.uint8)
    blk[:, :2] = (rng.standard_normal((nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    blk[:, 2:] = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    return repack(blk.reshape(-1), 2, (a.out, a.inputs), None, loop_schedules.VEC, True)
  return [PackedMatrix.stack([one() for _ in range(a.experts)]).upload(device) for _ in range(a.matrices)]


def packed_variant(pms: list, x: Tensor, sel_np: np.ndarray, gather_codes: bool, experts: int) -> float:
  P, K = x.shape
  sel = Tensor(sel_np, device=x.device).contiguous().realize()

  @TinyJit
  def products(x: Tensor, sel: Tensor) -> Tensor:
    sel = sel.maximum(0).minimum(experts - 1)
    outs = []
    for pm in pms:
      values = pm._with(None if t is None else t[sel] for t in pm._arrays()).matrix() if gather_codes else pm.matrix()[sel]
      outs.append((x.reshape(P, 1, K, 1) * values).sum(-2, dtype=dtypes.float32).reshape(P, -1).contiguous())
    return Tensor.stack(*outs).contiguous()
  return _median_ms(products, x, sel)


def _median_ms(products, x: Tensor, sel: Tensor) -> float:
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
  ap.add_argument("--packed", action="store_true", help="Q4_0 experts: codes gathered then rebuilt, or rebuilt then indexed")
  a = ap.parse_args()
  from pyruntime.stage.compute.model import resolve_device
  device = resolve_device(a.device)
  print(cpu(), "on", device)
  VEC = loop_schedules.VEC
  rng = np.random.default_rng(0)
  pairs = np.concatenate([rng.choice(a.experts, a.used, replace=False) for _ in range(a.rows)]).astype(np.int32)
  x = Tensor.randn(a.rows * a.used, a.inputs, device=device).contiguous().realize()
  if a.packed:
    pms = packed_experts(a, device, rng)
    first = None
    for gather_codes in (True, False):
      ms = packed_variant(pms, x, pairs, gather_codes, a.experts)
      first = first or ms
      print(f"{'codes gathered, then rebuilt' if gather_codes else 'rebuilt, then indexed       '}  {ms:7.2f} ms  ({ms / first:.2f}x)")
    return
  wbs = [Tensor.randn(a.experts, a.out // VEC, a.inputs, VEC, dtype=dtypes.float16, device=device).contiguous().realize() for _ in range(a.matrices)]
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
