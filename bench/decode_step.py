"""A whole-model stage's decode step on the rows path, alone (no rings, no launcher): milliseconds per one-row step and
the digest of the logits of a prompt and four decode steps (the same digest: the same bits). To compare two checkouts,
run it under each in turn, side by side in one shell loop (bench/results/2026-12-03-fused-projections.md):

  python bench/decode_step.py [--model PATH] [--weights float32] [--steps 30]
  for i in 1 2 3; do PYTHONPATH=/tmp/before python bench/decode_step.py; python bench/decode_step.py; done

or two settings of the environment, alternated in pairs of processes, with each pair's ratio (B over A):

  python bench/decode_step.py --sides PYRUNTIME_NATIVE_GRAPH=0 PYRUNTIME_NATIVE_GRAPH=1 --pairs 3
  python bench/decode_step.py --sides PYRUNTIME_WEIGHTS=float16 PYRUNTIME_WEIGHTS=packed --rows 8
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from pyruntime.bench.machine import cpu


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--weights", default=os.environ.get("PYRUNTIME_WEIGHTS", "float32"))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--rows", type=int, default=1, help="streams decoding together (one row each per step)")
  ap.add_argument("--device", default=os.environ.get("PYRUNTIME_DEVICE"), help="e.g. CPU:CLANGJIT:x86_64,x86-64-v3 (an AVX2 machine's code)")
  ap.add_argument("--sides", nargs=2, metavar=("A", "B"), help="two VAR=VALUE[,VAR=VALUE] settings to compare")
  ap.add_argument("--pairs", type=int, default=3)
  a = ap.parse_args()
  if a.sides: return compare(a)
  import pyruntime
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.source import default_model_path
  from pyruntime.stage.compute.model import StageModel
  path = a.model or str(default_model_path())
  t0 = time.monotonic()
  m = StageModel.load(path, 0, read_header(path).num_blocks, max_context=512, slots=max(2, a.rows), decode="batched", weights=a.weights,
                     graph_cache=None,
                     **({"device": a.device} if a.device else {}))
  h = hashlib.sha256()
  lg = m.forward(0, np.arange(100, 140, dtype=np.uint32), 0).numpy()
  h.update(lg.tobytes())
  tok, pos = int(lg.argmax()), 40
  for _ in range(4):
    out = m.forward_batch([0], np.asarray([tok], np.uint32), [pos]).numpy()
    h.update(out.tobytes())
    tok, pos = int(out.reshape(-1, out.shape[-1])[0].argmax()), pos + 1
  for s in range(1, a.rows): m.forward(s, np.arange(100, 100 + pos, dtype=np.uint32), 0).numpy()
  slots, toks = list(range(a.rows)), np.full(a.rows, tok, np.uint32)
  m.forward_batch(slots, toks, [pos] * a.rows).numpy()  # captures this window's graph
  t1, each = time.monotonic(), []
  for _ in range(a.steps):
    t = time.perf_counter()
    m.forward_batch(slots, toks, [pos] * a.rows).numpy()
    each.append(1000 * (time.perf_counter() - t))
  step = (time.monotonic() - t1) / a.steps
  prompt = []  # a 256-row prompt chunk, the prefill graph captured already
  for _ in range(3):
    m.reset_slot(0)
    t = time.perf_counter()
    m.forward(0, np.arange(1000, 1256, dtype=np.uint32) % m.vocab_size, 0).numpy()  # a small random model's vocabulary too
    prompt.append(1000 * (time.perf_counter() - t))
  print(json.dumps({"code": pyruntime.__file__.rsplit("/pyruntime/", 1)[0], "weights": a.weights, "rows": a.rows, "device": a.device or "default",
                    "digest": h.hexdigest()[:16],
                    "load_s": round(t1 - t0, 1), "decode_step_ms": round(1000 * step, 1),
                    "p10_p50_p90_ms": [round(float(x), 1) for x in np.percentile(each, [10, 50, 90])],
                    "prompt_256_ms": round(statistics.median(prompt))}))


def compare(a: argparse.Namespace) -> None:
  """Side A then side B, each a process of its own (the settings are read at import), --pairs times."""
  print(cpu())
  args = [sys.executable, __file__, "--steps", str(a.steps), "--rows", str(a.rows)] + (["--weights", a.weights] if "--weights" in sys.argv else [])
  args += (["--model", a.model] if a.model else []) + (["--device", a.device] if a.device else [])
  ratios = []
  for i in range(a.pairs):
    ms = []
    for side in a.sides:
      env = {**os.environ, **dict(kv.split("=", 1) for kv in side.split(","))}
      r = json.loads(subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
      ms.append(r["decode_step_ms"])
      print(f"pair {i + 1} {side:32s} {r['decode_step_ms']:7.1f} ms/step  256-row prompt {r['prompt_256_ms']:5d} ms  digest {r['digest']}  "
            f"weights {r['weights']}")
    ratios.append(ms[1] / ms[0])
    print(f"pair {i + 1} ratio B/A {ratios[-1]:.2f}")
  print(f"median ratio B/A {statistics.median(ratios):.2f}")


if __name__ == "__main__":
  main()
