"""pyruntime/stage/compute/cuda_graph.py off the GPU: what CUDA graph nodes are built with (the GPU run is bench/gpu_check.sh)."""
from tinygrad.uop.ops import ProgramInfo, UOp

from pyruntime.stage.compute import cuda_graph


def test_graph_nodes_are_built_with_nonempty_launch_sizes_and_replays_keep_the_real_ones():
  kv = UOp.variable("kv32", 0, 64)
  spec = ProgramInfo(global_size=(kv * 32, 1, 1), local_size=(32, kv, 1), vars=(kv,))
  cuda_graph.install()
  assert spec.launch_dims({"kv32": 0}) == ((0, 1, 1), (32, 0, 1))  # what a replay at kv32=0 would launch, unchanged
  with cuda_graph.nonempty_launch_sizes():
    assert spec.launch_dims({"kv32": 0}) == ((1, 1, 1), (32, 1, 1))  # what tinygrad's CUDAGraph builds a node with
    assert spec.launch_dims({"kv32": 3}) == ((96, 1, 1), (32, 3, 1))
  assert spec.launch_dims({"kv32": 5}) == ((160, 1, 1), (32, 5, 1))


def test_every_cuda_device_opened_gets_the_fixed_graph_class_once():
  from tinygrad.runtime.graph.cuda import CUDAGraph
  from tinygrad.runtime.ops_cuda import CUDADevice
  cuda_graph.install()
  stock = CUDADevice.__init__._stock_init
  cuda_graph.install()  # again (each stage model import): one wrapper around tinygrad's own, not one around another
  assert CUDADevice.__init__._stock_init is stock and not hasattr(stock, "_stock_init")
  assert issubclass(cuda_graph.FixedSizeCUDAGraph, CUDAGraph)
