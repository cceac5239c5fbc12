"""A stage's device buffers after its warm-up, largest totals first: what the memory breakdown's "other buffers" are.

  python bench/memory_buffers.py [MODEL.gguf] [--context 4096] [--slots 8] [--weights packed]

Loads the whole model as one stage (the rows path), warms it up as a stage process does (every graph captured), then
lists every allocated buffer by (size, dtype): the KV caches, the weights, and the int8 arenas in which tinygrad's
JIT places each graph's intermediates (its memory planner), one per graph.
"""
from __future__ import annotations

import argparse
import collections
import gc

from pyruntime.bench.machine import cpu
from tinygrad.device import Buffer
from tinygrad.helpers import GlobalCounters

from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.source import resolve_model
from pyruntime.stage.compute.model import StageModel


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("model", nargs="?", default="default")
  ap.add_argument("--context", type=int, default=4096)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--weights", default="packed")
  a = ap.parse_args()
  print(cpu())
  path = resolve_model(a.model)
  m = StageModel.load(path, 0, read_header(path).num_blocks, max_context=a.context, decode="batched", slots=a.slots, weights=a.weights)
  mb = lambda n: f"{n / 1e6:.0f} MB"  # noqa: E731
  print(f"loaded: {mb(GlobalCounters.mem_used_per_device.get(m.device, 0))} in buffers, weights {mb(m.resident_bytes)}")
  m.warm_up()
  print(f"warmed up: {mb(GlobalCounters.mem_used_per_device.get(m.device, 0))} in buffers")
  sizes = collections.Counter((b.nbytes, str(b.dtype)) for b in gc.get_objects() if isinstance(b, Buffer) and b.is_allocated() and b._base is None)
  for (n, dt), c in sorted(sizes.items(), key=lambda kv: -kv[0][0] * kv[1])[:15]: print(f"{n / 1e6:9.2f} MB x{c:<3d} {dt}")


if __name__ == "__main__":
  main()
