"""A whole-model stage's decode step on the rows path, alone (no rings, no launcher): milliseconds per one-row step and
the digest of the logits of a prompt and four decode steps (the same digest: the same bits). To compare two checkouts,
run it under each in turn, side by side in one shell loop (bench/results/2026-12-03-fused-projections.md):

  python bench/decode_step.py [--model PATH] [--weights float32] [--steps 30]
  for i in 1 2 3; do PYTHONPATH=/tmp/before python bench/decode_step.py; python bench/decode_step.py; done
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--weights", default="float32")
  ap.add_argument("--steps", type=int, default=30)
  a = ap.parse_args()
  import pyruntime
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.source import default_model_path
  from pyruntime.stage.model import StageModel
  path = a.model or str(default_model_path())
  t0 = time.monotonic()
  m = StageModel.load(path, 0, read_header(path).num_blocks, max_context=256, slots=2, decode="batched", weights=a.weights, graph_cache=None)
  h = hashlib.sha256()
  lg = m.forward(0, np.arange(100, 140, dtype=np.uint32), 0).numpy()
  h.update(lg.tobytes())
  tok, pos = int(lg.argmax()), 40
  for _ in range(4):
    out = m.forward_batch([0], np.asarray([tok], np.uint32), [pos]).numpy()
    h.update(out.tobytes())
    tok, pos = int(out.reshape(-1, out.shape[-1])[0].argmax()), pos + 1
  t1 = time.monotonic()
  for _ in range(a.steps): m.forward_batch([0], np.asarray([tok], np.uint32), [pos]).numpy()
  step = (time.monotonic() - t1) / a.steps
  print(json.dumps({"code": pyruntime.__file__.rsplit("/pyruntime/", 1)[0], "weights": a.weights, "digest": h.hexdigest()[:16],
                    "load_s": round(t1 - t0, 1), "decode_step_ms": round(1000 * step, 1)}))


if __name__ == "__main__":
  main()
