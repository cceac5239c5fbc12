"""The launcher's own CPU per token (issue 10's target: at most 50 µs), at C streams in flight, and what one token's
host work (incremental decode, stop strings, the Delta) costs with warm caches and after the thread slept.

    python bench/launcher.py [--model M] [--stages 2] [--tokens 48] [--concurrency 1,8] [--json]
    pyruntime bench launcher

The launcher's driver thread reads each token record from the tail's ring, turns it into text and writes the next
token to the head's ring (pyruntime/engine/driver.py, `Driver.run`); `Launcher.driver_cpu_s()` is that thread's whole CPU time
(reading, text, next tokens, and its health polls and wake-ups between tokens), and `Launcher.overhead` sums the wall
time from the moment a record is read to the moment its work is done. On a CPU host the driver sleeps between tokens while the
stages compute, so it wakes with its caches taken by them: the second half of this benchmark times the same work
back to back and after a 10 ms sleep, which tells how much of the per-token figure is that.
"""
from __future__ import annotations

import argparse
import json
import queue
import threading
import time

PROMPT = "Write one sentence about the sea."


def run_streams(lm, concurrency: int, tokens: int) -> dict:
  """C streams at once, each `tokens` long; the driver's CPU and wall time per token, and the whole process's CPU."""
  before, drv0, cpu0, t0 = dict(lm.overhead), lm.driver_cpu_s(), time.process_time(), time.monotonic()

  def one() -> None:
    for _ in lm.generate(PROMPT, max_tokens=tokens, ignore_eos=True): pass
  threads = [threading.Thread(target=one) for _ in range(concurrency)]
  for t in threads: t.start()
  for t in threads: t.join()
  n = lm.overhead["tokens"] - before["tokens"]
  return {"concurrency": concurrency, "tokens": n, "tokens_per_s": round(n / (time.monotonic() - t0), 2),
          "driver_cpu_us_per_token": round(1e6 * (lm.driver_cpu_s() - drv0) / n, 1),
          "driver_wall_us_per_token": round(1e6 * (lm.overhead["seconds"] - before["seconds"]) / n, 1),
          "process_cpu_us_per_token": round(1e6 * (time.process_time() - cpu0) / n, 1)}


def token_work_warm_and_cold(lm, n: int = 200) -> dict:
  """StreamHandle.push (what the driver does for each token of a running stream) timed back to back, then each
  call after a 10 ms sleep, as the driver runs between two tokens of a CPU pipeline."""
  from pyruntime.engine.driver import StreamHandle
  from pyruntime.engine.request import Request
  token = lm.tokenizer.encode("sea")[0]
  out = {}
  for name, pause in (("warm", 0.0), ("after_10ms_sleep", 0.01)):
    st = StreamHandle(lm.driver, 0, Request([token], 1 << 30, None, ["never seen"]), queue.SimpleQueue().put)
    total = 0
    for _ in range(n):
      if pause: time.sleep(pause)
      t = time.perf_counter_ns()
      st.push(token, False)
      total += time.perf_counter_ns() - t
    out[f"push_us_{name}"] = round(total / n / 1e3, 2)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="GGUF path or source (default: the bundled SmolLM2-135M)")
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument("--tokens", type=int, default=48, help="tokens per stream")
  ap.add_argument("--concurrency", default="1,8", help="streams in flight, comma-separated")
  ap.add_argument("--max-context", type=int, default=512)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.engine.launcher import Launcher
  levels = [int(c) for c in a.concurrency.split(",")]
  with Launcher(a.model, stages=a.stages, max_streams=max(levels), max_context=a.max_context, warmup=True) as lm:
    run_streams(lm, 1, 4)  # the first stream's kernels and the driver's code paths, untimed
    rows = [run_streams(lm, c, a.tokens) for c in levels]
    work = token_work_warm_and_cold(lm)
  if a.json: print(json.dumps({"streams": rows, "token_work": work}, indent=1)); return
  print(f"{'C':>3} {'tok/s':>7} {'driver CPU µs/token':>20} {'driver wall µs/token':>21} {'process CPU µs/token':>21}")
  for r in rows:
    print(f"{r['concurrency']:>3} {r['tokens_per_s']:>7} {r['driver_cpu_us_per_token']:>20} {r['driver_wall_us_per_token']:>21} "
          f"{r['process_cpu_us_per_token']:>21}")
  print(f"one token's host work (StreamHandle.push): {work['push_us_warm']} µs back to back, "
        f"{work['push_us_after_10ms_sleep']} µs after a 10 ms sleep")


if __name__ == "__main__":
  main()
