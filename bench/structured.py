"""Structured output's cost: the same chat requests free and under a JSON schema (response_format), side by side in one
run, at C=1 and C=8 concurrent streams; output tokens per second per stream and in all, and the grammar's preparation.

  python bench/structured.py [--model PATH] [--concurrency 1,8] [--requests 8] [--max-tokens 48] [--json]

Each request asks a question whose answer fits a small schema (a city and a country); the free requests get the same
budget with ignore_eos, so both sides generate about as many tokens. Per stream: its decode tokens/s (Done.timings);
in all: every output token over the level's wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 60}, "country": {"type": "string", "maxLength": 60},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "country", "population"], "additionalProperties": False}
QUESTIONS = ["What is the capital of France?", "Name a big city in Japan.", "Which city hosts the Colosseum?", "Where is the Golden Gate?",
             "Name the largest city in Brazil.", "What is the capital of Canada?", "Which city is famous for its canals?",
             "Name a city on the Nile."]


def level(lm, c: int, requests: int, max_tokens: int, constrained: bool) -> dict:
  from pyruntime.launcher import Done
  kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}} if constrained else {"ignore_eos": True}
  done: list = []
  lock = threading.Lock()

  def client(k: int) -> None:
    for i in range(k, requests, c):
      msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}]
      d = next(ev for ev in lm.generate(messages=msgs, max_tokens=max_tokens, **kw) if isinstance(ev, Done))
      with lock: done.append(d)
  t0 = time.monotonic()
  threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.monotonic() - t0
  tokens = sum(len(d.token_ids) for d in done)
  return {"concurrency": c, "constrained": constrained, "requests": len(done), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
          "stream_decode_tokens_per_s": round(statistics.median(d.timings.decode_tokens_per_s for d in done), 2),
          "valid_json": sum(1 for d in done if _parses(d.text)) if constrained else None}


def _parses(text: str) -> bool:
  try: json.loads(text); return True
  except ValueError: return False


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--concurrency", default="1,8")
  ap.add_argument("--requests", type=int, default=8, help="requests per level and side")
  ap.add_argument("--max-tokens", type=int, default=48)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.grammar import check, grammar_for
  from pyruntime.launcher import Launcher
  with Launcher(a.model, stages=2, max_context=1024, warmup=True) as lm:
    t0 = time.perf_counter(); grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": SCHEMA}}); t1 = time.perf_counter()
    check(grammar, lm.tokenizer); t2 = time.perf_counter()
    prep = {"grammar_from_schema_ms": round(1e3 * (t1 - t0), 2), "check_against_vocabulary_ms_first": round(1e3 * (t2 - t1), 1)}
    level(lm, 1, 2, 8, True); level(lm, 1, 2, 8, False)  # warm: templates, the vocabulary bridge, the mask buffers
    rows = []
    for c in (int(x) for x in a.concurrency.split(",")):
      free, constrained = level(lm, c, a.requests, a.max_tokens, False), level(lm, c, a.requests, a.max_tokens, True)
      constrained["vs_free"] = round(constrained["tokens_per_s"] / free["tokens_per_s"], 3)
      constrained["stream_vs_free"] = round(constrained["stream_decode_tokens_per_s"] / free["stream_decode_tokens_per_s"], 3)
      rows += [free, constrained]
  out = {"preparation": prep, "levels": rows}
  print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
