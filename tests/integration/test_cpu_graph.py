"""Captured graphs on the CPU replayed by the native launch loop (pyruntime/stage/compute/cpu_graph.py): the same bits as
tinygrad's own graph, on both decode paths, with the native loop actually in use."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: the shared helpers

# In a fresh process (PYRUNTIME_NATIVE_GRAPH is read at import): a prompt, decode steps alone and batched, on tinygrad's
# kernels (reference) and the rows path; prints every logit's bits (hashed) and which graph classes ran them.
RUN = r"""
import collections, hashlib, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from tinymodels import TINY_MODELS, write_tiny_gguf
from tinygrad.engine.realize import graph_cache
from pyruntime.modelfile.gguf import read_header
from pyruntime.modelfile.plan import num_blocks
from pyruntime.stage.compute.model import StageModel
path = write_tiny_gguf(f"{sys.argv[2]}/llama_tied.gguf", **TINY_MODELS["llama_tied"])
out = {}
for decode, weights in (("reference", "quantized"), ("batched", "float32")):
  m = StageModel.load(path, 0, num_blocks(read_header(path)), max_context=128, slots=3, decode=decode, weights=weights, graph_cache=None)
  h = hashlib.sha256()
  prompt = np.arange(5, 45, dtype=np.uint32)
  for slot in range(2):
    lg = m.forward(slot, prompt[slot:], 0, prefill=True).numpy()
    h.update(lg.tobytes())
    for pos in range(40 - slot, 46 - slot):
      lg = m.forward(slot, np.array([int(lg.reshape(-1, lg.shape[-1])[-1].argmax())], np.uint32), pos, prefill=False).numpy()
      h.update(lg.tobytes())
  if m.batched: h.update(m.forward_batch([0, 1], np.array([3, 4], np.uint32), [46, 45]).numpy().tobytes())
  out[f"{decode}-{weights}"] = h.hexdigest()
out["graphs"] = dict(collections.Counter(type(g).__name__ for g in graph_cache.values()))
print(json.dumps(out))
"""


def run(tmp_path, native: str) -> dict:
  os.makedirs(tmp_path, exist_ok=True)
  env = {**os.environ, "PYRUNTIME_NATIVE_GRAPH": native, "DEV": "CPU"}
  p = subprocess.run([sys.executable, "-c", RUN, HERE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=400)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


def test_native_loop_changes_no_bit(tmp_path):
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    stock, ours = pool.map(lambda n: run(tmp_path / n, n), ("0", "1"))
  assert set(stock.pop("graphs")) == {"HCQGraph"}
  graphs = ours.pop("graphs")
  assert graphs.get("NativeCPUGraph", 0) >= 4, graphs  # the prefill and decode graphs of both paths, in batches
  assert ours == stock
