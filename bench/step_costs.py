"""What one whole-model stage's steps cost on the rows path, alone (no rings, no launcher): a decode step of 1 and of
`--rows` rows at a short and a long position (what eight streams' own keys and values add as contexts grow), and a
prompt's first chunk by its length in a slot just closed, as a new stream finds it (the short graphs of 8 and 16
rows, then the chunk graph). The numbers behind the families bench's 8-stream ratios and first tokens.

  python bench/step_costs.py [--model PATH | --family llama|qwen3moe|...] [--size small|1b] [--positions 40,400]
                             [--rows 8] [--lengths 1,8,16,17,32,64,128] [--context N] [--weights packed] [--json]

Printed first: the CPU. Medians of `--repeats` calls after one that may capture. Decode rows past the first are other
slots at the same position, each holding a prompt of that length (computed first, not timed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def step_ms(call, repeats: int) -> float:
  call()  # a new window or chunk length may capture its graph here
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    call()
    ts.append(time.perf_counter() - t)
  return round(1000 * float(np.median(ts)), 2)


def measure(path: str, positions: list[int], rows: int, lengths: list[int], weights: str, repeats: int, context: int = 0) -> dict:
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.stage.compute.model import StageModel
  ctx = context or max([*positions, *lengths]) + 64
  m = StageModel.load(path, 0, read_header(path).num_blocks, max_context=ctx, slots=rows, decode="batched", weights=weights, graph_cache=None)
  ids = lambda n: (np.arange(n) * 7 + 3).astype(np.uint32) % m.vocab_size  # noqa: E731 - any valid tokens
  out: dict = {"decode_ms": {}, "prompt_ms": {}}
  for p in positions:
    for s in range(rows):
      m.reset_slot(s)
      m.prefill_rows(s, ids(p), 0).numpy()
    for n in (1, rows):
      step = lambda n=n, p=p: m.forward_batch(list(range(n)), np.full(n, 5, np.uint32), [p] * n).numpy()  # noqa: E731
      out["decode_ms"][f"pos {p}, {n} rows"] = step_ms(step, repeats)
  def prompt(n: int) -> None:
    m.reset_slot(0)
    m.prefill_rows(0, ids(n), 0).numpy()
  for n in lengths: out["prompt_ms"][n] = step_ms(lambda n=n: prompt(n), repeats)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--family", default=None, help="a random model of bench/families.py's families instead of a file")
  ap.add_argument("--size", default="small")
  ap.add_argument("--positions", default="40,400")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--lengths", default="1,8,16,17,32,64,128")
  ap.add_argument("--weights", default="packed")
  ap.add_argument("--repeats", type=int, default=15)
  ap.add_argument("--context", type=int, default=0, help="the stage's context (default: the longest position or prompt, + 64)")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # families.py, beside this file
  from pyruntime.bench.machine import cpu
  if a.family:
    from families import family_model
    path = family_model(a.family, a.size)
  else:
    from pyruntime.modelfile.source import default_model_path
    path = a.model or str(default_model_path())
  r = measure(path, [int(x) for x in a.positions.split(",")], a.rows, [int(x) for x in a.lengths.split(",")], a.weights, a.repeats, a.context)
  if a.json: return print(json.dumps({"cpu": cpu(), "model": a.family or path, **r}))
  print(cpu())
  print(f"{a.family or path} ({a.weights})")
  for k, v in r["decode_ms"].items(): print(f"  decode, {k}: {v} ms")
  one = {k.split(",")[0]: v for k, v in r["decode_ms"].items() if k.endswith(" 1 rows")}
  for k, v in r["decode_ms"].items():
    if not k.endswith(" 1 rows"): print(f"  {k}: {v / one[k.split(',')[0]]:.2f}x one row")
  for n, v in r["prompt_ms"].items(): print(f"  prompt of {n} tokens: {v} ms")


if __name__ == "__main__":
  main()
