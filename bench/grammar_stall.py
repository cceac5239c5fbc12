"""Does one stream's grammar delay another stream's tokens? A free-text stream's inter-token gaps alone, beside the
same requests unconstrained, and beside them under hostile schemas (pathological patterns, `format: email`,
`patternProperties`, recursion), side by side in one run on the same launcher: its median and p99 gap in each. Other
streams cost it gaps anyway (their prompts' steps, bigger batches): what a grammar adds is the hostile row against the
free row; the issue's target is p99 beside the hostile ones ≤ 2× its median there.

  python bench/grammar_stall.py [--model PATH] [--stages 2] [--tokens 160] [--hostile 3] [--repeats 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from pyruntime.bench.machine import cpu

HOSTILE = [{"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|aa)*b$"}}, "required": ["s"]},
           {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(\\w+\\s?)*$"}}, "required": ["s"]},
           {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a|b)*a(a|b){20}"}}, "required": ["s"]},
           {"type": "object", "properties": {"s": {"type": "string", "format": "email"}}, "required": ["s"]},
           {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}},
           {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["v"]}]


def victim_gaps(lm, tokens: int) -> list[float]:
  """The free stream's gaps between tokens (s), from its second token on."""
  from pyruntime.engine.events import Delta, Done
  times: list[float] = []
  done = threading.Event()
  def on(ev) -> None:
    if isinstance(ev, Delta) and ev.token_ids: times.append(time.monotonic())
    if isinstance(ev, (Done, BaseException)): done.set()
  lm.submit("Tell me a long story about a lighthouse keeper.", max_tokens=tokens, ignore_eos=True, temperature=0, prefix_cache=False, on_event=on)
  done.wait(600)
  return [b - a for a, b in zip(times[1:], times[2:], strict=False)]


def other_load(lm, n: int, stop: threading.Event, hostile: bool) -> list[int]:
  """`n` streams in a loop: the hostile structured requests, or the same requests free (ignore_eos: as many tokens)."""
  count = [0]
  def loop(i: int) -> None:
    k = i
    while not stop.is_set():
      schema = HOSTILE[k % len(HOSTILE)]
      k += 1
      way = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} if hostile else {"ignore_eos": True}
      try:
        for _ in lm.generate(messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=48, prefix_cache=False, **way): pass
        count[0] += 1
      except Exception as e:  # noqa: BLE001 - a refused schema is a result too
        print(f"  hostile request refused: {type(e).__name__}: {str(e)[:100]}")
  threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
  for t in threads: t.start()
  return count


def figures(gaps: list[float]) -> dict:
  q = statistics.quantiles(gaps, n=100)
  return {"median_ms": round(1000 * statistics.median(gaps), 2), "p99_ms": round(1000 * q[98], 2), "max_ms": round(1000 * max(gaps), 2)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument("--tokens", type=int, default=160)
  ap.add_argument("--hostile", type=int, default=3, help="other requests in flight at once (hostile structured, or the same free)")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.engine.launcher import Launcher
  print(cpu())
  with Launcher(a.model, stages=a.stages, max_streams=8, warmup=True) as lm:
    victim_gaps(lm, 16)  # first-use costs out of the way
    rows = []
    for r in range(a.repeats):
      row: dict = {"repeat": r, "alone": figures(victim_gaps(lm, a.tokens))}
      for hostile in (False, True):
        stop = threading.Event()
        count = other_load(lm, a.hostile, stop, hostile)
        time.sleep(0.5)
        row["beside_hostile" if hostile else "beside_free"] = {**figures(victim_gaps(lm, a.tokens)), "answered": count[0]}
        stop.set()
        time.sleep(1.5)
      rows.append(row)
      for k in ("alone", "beside_free", "beside_hostile"):
        f = row[k]
        print(f"repeat {r} {k:<15} median {f['median_ms']:>7} ms  p99 {f['p99_ms']:>7} ms  max {f['max_ms']:>7} ms  "
              f"p99/median {f['p99_ms'] / f['median_ms']:.2f}")
  if a.json: print(json.dumps(rows))


if __name__ == "__main__":
  main()
