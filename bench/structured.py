"""Structured output's cost: the same chat requests free and under a JSON schema (response_format) or as a tool call
(--tools: tool_choice naming the function, docs/tools.md), side by side in one run, at C=1 and C=8 concurrent streams;
output tokens per second per stream and in all, and the grammar's preparation.

  python bench/structured.py [--model PATH] [--concurrency 1,8] [--requests 8] [--max-tokens 48] [--repeats 3] [--tools] [--json]

Each request asks a question whose answer fits a small schema (a city and a country); the free requests get the same
prompt tokens (with --tools: the tools' system turn, rendered) and, with ignore_eos, as many tokens as the constrained
answer to the same question took in the run just before (a grammar ends an answer early; a short answer decodes
more of its tokens beside the other streams' prompts, so unequal lengths made C=8 read 0.37x); the prefix cache is
off for both. (Until 2026-12-04 the free side of --tools got the plain chat prompt, ~40 tokens against the tools'
~236: the C=8 "0.37x" recorded before was those prompts' prefill, not the grammar.) Per stream: its decode tokens/s (Done.timings);
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


TOOL = {"type": "function", "function": {"name": "record_place", "description": "Record a place", "parameters": SCHEMA}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}


def level(lm, c: int, requests: int, max_tokens: int, constrained: bool, tools: bool = False, budgets: dict | None = None) -> dict:
  """One side at one level. `budgets`: request index -> max_tokens (the free side gets what the constrained answer to
  the same question took: a grammar ends its answer early, and a stream's rate depends on how much of it runs
  beside the others' prompts)."""
  from pyruntime.engine.launcher import Done
  choice = {"type": "function", "function": {"name": "record_place"}}
  way = {"tools": [TOOL], "tool_choice": choice} if tools else {"response_format": FORMAT}
  # the same prompt tokens on both sides (the tools' system turn too), none from the prefix cache (the side run second
  # would find the first's prompts there)
  kw = {**(way if constrained else {"ignore_eos": True}), "prefix_cache": False}

  def request(msgs: list[dict]) -> dict:
    if constrained or not tools: return {"messages": msgs}
    from pyruntime.text.chat import render_chat
    from pyruntime.text.tools import check_tools
    return {"prompt": render_chat(lm.tokenizer, msgs, tools=check_tools([TOOL], choice)), "raw": True}
  done: list = []
  lengths: dict[int, int] = {}
  lock = threading.Lock()

  def client(k: int) -> None:
    for i in range(k, requests, c):
      msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}]
      budget = (budgets or {}).get(i, max_tokens)
      d = next(ev for ev in lm.generate(**request(msgs), max_tokens=budget, **kw) if isinstance(ev, Done))
      with lock: done.append(d); lengths[i] = len(d.token_ids)
  t0 = time.monotonic()
  threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.monotonic() - t0
  tokens = sum(len(d.token_ids) for d in done)
  return {"lengths": lengths, "concurrency": c, "constrained": constrained, "requests": len(done), "tokens": tokens,
          "tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 2),
          "ttft_s": round(statistics.median(d.timings.ttft_s for d in done), 2),
          "stream_decode_tokens_per_s": round(statistics.median(d.timings.decode_tokens_per_s for d in done), 2),
          "valid_json": sum(1 for d in done if _parses(d.tool_calls[0].arguments if d.tool_calls else d.text)) if constrained else None}


def _parses(text: str) -> bool:
  try: json.loads(text); return True
  except ValueError: return False


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--concurrency", default="1,8")
  ap.add_argument("--requests", type=int, default=8, help="requests per level and side")
  ap.add_argument("--max-tokens", type=int, default=48)
  ap.add_argument("--tools", action="store_true", help="constrain as a named tool call instead of a response_format")
  ap.add_argument("--repeats", type=int, default=3, help="free/constrained pairs per level (medians reported)")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.engine.launcher import Launcher
  from pyruntime.text.grammar import check, grammar_for
  from pyruntime.text.tools import FORMATS, check_tools
  with Launcher(a.model, stages=2, max_context=1024, warmup=True) as lm:
    t0 = time.perf_counter()
    if a.tools: grammar = FORMATS["hermes"].grammar(check_tools([TOOL], {"type": "function", "function": {"name": "record_place"}}), lm.tokenizer)
    else: grammar = grammar_for(FORMAT)
    t1 = time.perf_counter(); check(grammar, lm.tokenizer); t2 = time.perf_counter()
    prep = {"constraint": "tool call" if a.tools else "response_format", "grammar_from_schema_ms": round(1e3 * (t1 - t0), 2),
            "check_against_vocabulary_ms_first": round(1e3 * (t2 - t1), 1)}
    level(lm, 1, 2, 8, True, a.tools); level(lm, 1, 2, 8, False, a.tools)  # warm: templates, the vocabulary bridge, the mask buffers
    rows = []
    for c in (int(x) for x in a.concurrency.split(",")):
      # the two sides alternate, `repeats` times: this machine's noise between two runs of one side is larger than
      # the difference measured, so the figures are medians over the pairs
      pairs = []
      for _ in range(a.repeats):
        cr = level(lm, c, a.requests, a.max_tokens, True, a.tools)
        pairs.append((level(lm, c, a.requests, a.max_tokens, False, a.tools, budgets=cr["lengths"]), cr))
      for side, runs in (("free", [p[0] for p in pairs]), ("constrained", [p[1] for p in pairs])):
        row = {**{k: v for k, v in runs[0].items() if k != "lengths"}, "side": side,
               "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
               "stream_decode_tokens_per_s": round(statistics.median(r["stream_decode_tokens_per_s"] for r in runs), 2)}
        if side == "constrained":
          row["vs_free_runs"] = [round(cr["stream_decode_tokens_per_s"] / fr["stream_decode_tokens_per_s"], 3) for fr, cr in pairs]
          row["stream_vs_free"] = round(statistics.median(row["vs_free_runs"]), 3)
          # the same tokens on both sides: all of them over the level's wall time is the steadier figure at C=8, where
          # a stream's own rate depends on how many of its tokens fell beside the other streams' prompts
          row["aggregate_vs_free_runs"] = [round(cr["tokens_per_s"] / fr["tokens_per_s"], 3) for fr, cr in pairs]
          row["aggregate_vs_free"] = round(statistics.median(row["aggregate_vs_free_runs"]), 3)
          row["valid_json"] = sum(r["valid_json"] for r in runs)
          row["requests"] = sum(r["requests"] for r in runs)
        rows.append(row)
  out = {"preparation": prep, "levels": rows}
  print(json.dumps(out) if a.json else json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
