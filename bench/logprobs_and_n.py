"""What evaluators and agent SDKs ask for, and what it costs, side by side in one run (docs/serving.md):

- logprobs: decode tokens/s with `logprobs=K` against without, at C=1 and C=8 concurrent streams (the same prompts,
  ignore_eos, the same lengths; the two sides alternate --repeats times, medians of the per-pair ratios);
- n: one request with n=4 choices against four requests at once (the same prompt, the same four seeds, sampled):
  the wall time until all four answers are in (the n side computes the prompt once; the four requests, arriving
  together, each compute it).

  python bench/logprobs_and_n.py [--model PATH] [--top K] [--tokens 64] [--prompt-words 300] [--repeats 3] [--json]

The prefix cache is on for the n comparison (that is how choices share a prompt) with a salt per run, so no run finds
another's prompt; off for the logprobs one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from pyruntime.bench.machine import cpu

QUESTIONS = ["Explain how a rainbow forms.", "Describe the water cycle.", "Why do leaves change colour in autumn?",
             "How does a bicycle stay upright?", "What makes the sea salty?", "How do bees make honey?",
             "Why is the sky dark at night?", "How does a compass work?"]


def streams(lm: Any, c: int, tokens: int, **kw: Any) -> tuple[float, float]:
  """C streams at once, each `tokens` long: (aggregate decode tokens/s, median per-stream decode tokens/s)."""
  from pyruntime.engine.launcher import Done
  done: list = []
  lock = threading.Lock()

  def one(i: int) -> None:
    d = next(ev for ev in lm.generate(messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens=tokens,
                                      ignore_eos=True, prefix_cache=False, temperature=0, **kw) if isinstance(ev, Done))
    with lock: done.append(d)
  t0 = time.monotonic()
  threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.monotonic() - t0
  return sum(len(d.token_ids) for d in done) / wall, statistics.median(d.timings.decode_tokens_per_s for d in done)


def choices(lm: Any, prompt: str, tokens: int, salt: str, together: bool) -> float:
  """Four sampled answers to one prompt: one request with n=4, or (together=False) four requests submitted at once with
  the seeds the n request's choices get. Seconds until the last is done."""
  from pyruntime.engine.launcher import Done
  from pyruntime.params import choice_seed
  left, finished = [4], threading.Event()

  def on(*args: Any) -> None:
    if isinstance(args[-1], (Done, BaseException)):
      left[0] -= 1
      if not left[0]: finished.set()
  kw = {"prompt": prompt, "raw": True, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.8, "cache_salt": salt}
  t0 = time.monotonic()
  if together: lm.submit(**kw, seed=7, n=4, on_event=on)
  else:
    for i in range(4): lm.submit(**kw, seed=choice_seed(7, i), on_event=on)
  finished.wait(600)
  return time.monotonic() - t0


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--top", type=int, default=5, help="top_logprobs asked for")
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--prompt-words", type=int, default=300, help="the n comparison's prompt length, in words")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.engine.launcher import Launcher
  out: dict[str, Any] = {"cpu": cpu(), "top": a.top, "tokens": a.tokens}
  with Launcher(a.model, stages=2, max_context=1024, warmup=True) as lm:
    streams(lm, 2, 8); streams(lm, 2, 8, logprobs=a.top)  # warm
    for c in (1, 8):
      pairs = [(streams(lm, c, a.tokens), streams(lm, c, a.tokens, logprobs=a.top)) for _ in range(a.repeats)]
      out[f"C={c}"] = {"plain_tokens_per_s": round(statistics.median(p[0][0] for p in pairs), 2),
                       "logprobs_tokens_per_s": round(statistics.median(p[1][0] for p in pairs), 2),
                       "aggregate_ratio_runs": [round(p[1][0] / p[0][0], 3) for p in pairs],
                       "aggregate_ratio": round(statistics.median(p[1][0] / p[0][0] for p in pairs), 3),
                       "stream_ratio": round(statistics.median(p[1][1] / p[0][1] for p in pairs), 3)}
    words = " ".join(QUESTIONS[i % len(QUESTIONS)] for i in range(a.prompt_words // 6))
    prompt = f"Read this and answer briefly.\n{words}\nAnswer:"
    choices(lm, prompt, 4, "warm", True)
    runs = [(choices(lm, prompt, a.tokens, f"s{r}", False), choices(lm, prompt, a.tokens, f"n{r}", True)) for r in range(a.repeats)]
    out["n=4"] = {"prompt_tokens": len(lm.prompt_ids(prompt, raw=True)), "four_requests_s": round(statistics.median(r[0] for r in runs), 2),
                  "one_request_n4_s": round(statistics.median(r[1] for r in runs), 2),
                  "speedup_runs": [round(r[0] / r[1], 3) for r in runs], "speedup": round(statistics.median(r[0] / r[1] for r in runs), 3)}
  print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
