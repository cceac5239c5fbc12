"""A stage's compute: what runs on its device, apart from the process that drives it (pyruntime/stage/worker.py,
dataloop.py, scheduler.py). The model of its blocks (model.py) over weights loaded in their mode's form (weights.py,
packed.py), the rows path's batched kernels (rows.py) and their loop schedules (loop_schedules.py), captured graphs
and their caches (cpu_graph.py, cuda_graph.py, graph_cache.py, program_cache.py), the prefix cache's KV blocks
(kv_blocks.py), sampling and log-probabilities at the tail (sampling.py, logprobs.py), what it reports of its device
(device_memory.py, launch_report.py), and float16 converted exactly where tinygrad emulates it (half_emulation.py).
Nothing here imports the process side."""
from pyruntime.stage.compute import half_emulation  # noqa: F401  (float16 subnormals kept where float16 is emulated)
