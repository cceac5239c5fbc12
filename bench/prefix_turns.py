"""A conversation's turns with the prefix cache and without it, side by side in one run, for each family.

  python bench/prefix_turns.py [--families llama,qwen35] [--turns 4] [--system-tokens 300] [--size small|1b] [--json]

Each family's random model is bench/families.py's file at `--size`. One launcher with the prefix cache (the default
budget) and one without (`prefix_cache=0`), one stage each, greedy; a chat whose system prompt is `--system-tokens` token
ids, each turn asking for 16 tokens and resending the whole history as token ids (the reply's own ids: what a client's
text would give back on a real model). Per turn: the time to the first token on each launcher, the tokens the cached one
read from the cache, and whether both answered the same tokens. A hybrid's prompt costs most (its recurrence runs one
row after another, in chunks of 16 rows), so a cached prefix saves it most; what a snapshot costs shows in the first
turn (each stage copies the slot's state aside at every block boundary).

Printed first: the CPU; then per family and turn both launchers' first-token times and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from pyruntime.bench.families import family_model  # noqa: E402
from pyruntime.bench.machine import cpu  # noqa: E402

QUESTION = 12  # token ids each turn adds


def turn(lm, ids: list[int]) -> tuple[float, list[int], int]:
  """(seconds to the first token, the answer's ids, prompt tokens read from the cache)."""
  from pyruntime.engine.launcher import Done
  t0, first = time.perf_counter(), None
  for ev in lm.generate(prompt_ids=ids, max_tokens=16, ignore_eos=True, temperature=0):
    first = first or time.perf_counter() - t0
    if isinstance(ev, Done): return first, ev.token_ids, ev.usage.cached_tokens
  raise RuntimeError("no Done")


def family_turns(path: str, turns: int, system: int) -> list[dict]:
  from pyruntime.engine.launcher import Launcher
  out = []
  with Launcher(path, stages=1, max_context=1024, warmup=True) as on, Launcher(path, stages=1, max_context=1024, prefix_cache=0, warmup=True) as off:
    vocab = on.tokenizer.vocab_size
    history = [(7 * i + 3) % (vocab - 10) + 5 for i in range(system)]
    for t in range(turns):
      history += [(11 * (t + 1) * j + 1) % (vocab - 10) + 5 for j in range(QUESTION)]
      (t_on, a, cached), (t_off, b, _) = turn(on, history), turn(off, history)
      out.append({"turn": t + 1, "prompt": len(history), "cached": cached, "first_token_s": round(t_on, 4),
                  "uncached_first_token_s": round(t_off, 4), "speedup": round(t_off / t_on, 2), "same_tokens": a == b})
      history += a
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--families", default="llama,qwen35")
  ap.add_argument("--turns", type=int, default=4)
  ap.add_argument("--system-tokens", type=int, default=300)
  ap.add_argument("--size", default="small", choices=("small", "1b"))
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  print(cpu(), f"({a.size} models)")
  results = {}
  for f in a.families.split(","):
    results[f] = family_turns(family_model(f, a.size), a.turns, a.system_tokens)
    for r in results[f]:
      print(f"{f:10s} turn {r['turn']}  prompt {r['prompt']:4d}  cached {r['cached']:4d}  first token {r['first_token_s'] * 1e3:8.1f} ms"
            f"  without the cache {r['uncached_first_token_s'] * 1e3:8.1f} ms  ({r['speedup']:.2f}x)  same tokens: {r['same_tokens']}")
  if a.json: print(json.dumps(results))


if __name__ == "__main__":
  main()
