"""CUDA's captured graphs, built so that a kernel whose launch size depends on a variable can be a node.

tinygrad 0.13's CUDAGraph adds each kernel node with its launch size evaluated at every variable = 0, and sets the
real sizes from the variables' values at each replay. A launch size that scales with a variable (the rows path's
attention over `kv32 * 32` cache positions, tinygrad's own model's over `start_pos`) is then 0 at build time, and the
driver refuses a node with an empty grid: `cuGraphAddKernelNode` fails with CUDA Error 1 (invalid argument) on the
first captured step, so no stage ran on a GPU (seen on an H200, driver 580; bench/results/2026-12-04-gpu-first-run.md).
`FixedSizeCUDAGraph` builds the nodes with every launch dimension at least 1; each replay sets the real sizes as before
(the same kernels, arguments and order, so the same bits). It is the graph class of every CUDA device once `install()`
ran, which the stage model does on import.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from tinygrad.runtime.graph.cuda import CUDAGraph
from tinygrad.runtime.ops_cuda import CUDADevice
from tinygrad.uop.ops import ProgramInfo

from pyruntime.stage.compute.cpu_graph import graph_of_every

_building = threading.local()
_stock_launch_dims = ProgramInfo.launch_dims


def _launch_dims(spec: ProgramInfo, var_vals: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
  global_size, local_size = _stock_launch_dims(spec, var_vals)
  if not getattr(_building, "on", False): return global_size, local_size
  return tuple(max(1, d) for d in global_size), None if local_size is None else tuple(max(1, d) for d in local_size)


@contextlib.contextmanager
def nonempty_launch_sizes() -> Iterator[None]:
  """Within: this thread's ProgramInfo.launch_dims gives no dimension under 1 (what a graph node is built with)."""
  _building.on = True
  try: yield
  finally: _building.on = False


class FixedSizeCUDAGraph(CUDAGraph):
  def __init__(self, *args, **kwargs) -> None:
    with nonempty_launch_sizes(): super().__init__(*args, **kwargs)


def install() -> None:
  """Make FixedSizeCUDAGraph the graph of every CUDA device, opened already or later (importing tinygrad's CUDA
  backend loads no CUDA library: this runs on any machine)."""
  ProgramInfo.launch_dims = _launch_dims  # type: ignore[method-assign]  # unchanged outside nonempty_launch_sizes()
  graph_of_every(CUDADevice, "CUDA", FixedSizeCUDAGraph)
