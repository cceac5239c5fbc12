"""Speculative decoding (n-gram drafts, docs/speculation.md) on and off, side by side in one run: one launcher with
--speculative ngram, each request sent with speculation and without it (the request-level opt-out), alternating, at
C=1 and C=8 concurrent streams, on two prompt sets: answers that repeat spans of the prompt (rewrite, extract, edit
code, quote: REPEAT) and free-form chat (CHAT). Greedy, so the two sides must give the same text, which is checked.

  python bench/speculative.py [--model PATH] [--concurrency 1,8] [--max-tokens 128] [--draft-tokens 7] [--json]
  python bench/speculative.py --speculative model:DRAFT.gguf      # a draft model instead (bench/draft_model.py makes one)
  python bench/speculative.py --family qwen35 --concurrency 1      # a random model of bench/families.py's small size

With `--family` (a random model: its answers never repeat its prompt, so prompt lookup finds nothing) the drafts come
from OpenAI's `prediction` instead, sent with each speculative request: RIGHT, the plain answer's own text (most
drafts agree), and WRONG, an unrelated text (none do: what a round that fails costs once the stream stops drafting).

Per level and side: completion tokens per second of wall time (request to last token, summed over requests, over
their summed time), and the drafts' acceptance.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))  # families.py, beside this file

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great "
             "lens until it shone, and wound the clockwork that turned the beam across the dark water. Ships passing the "
             "rocks at night trusted that light more than any chart.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
REPEAT = [
  f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
  f"Rewrite this Python function, renaming the variable `subtotal` to `base`. Output only the code.\n\n{CODE}",
  f"Quote the second sentence of this paragraph:\n\n{PARAGRAPH}",
  f"Add a docstring to this function and output the whole function:\n\n{CODE}",
  f"Extract every sentence that mentions the light or the lens, in order:\n\n{PARAGRAPH}",
  f"Copy this code and add type hints to the arguments:\n\n{CODE}",
  f"Repeat this text twice:\n\n{PARAGRAPH[:160]}",
  f"Correct any spelling mistakes and return the full text:\n\n{PARAGRAPH.replace('lighthouse', 'lighthose')}",
]
CHAT = ["Why is the sky blue?", "Give me three tips for sleeping better.", "What is a good name for a cat?",
        "Explain what a CPU cache is.", "Write a haiku about autumn.", "How do I boil an egg?",
        "What are the planets of the solar system?", "Describe a busy market in the morning."]


def run(lm, prompts: list[str], c: int, max_tokens: int, speculative: bool, predictions: list[str] | None = None,
        raw: bool = False) -> tuple[dict, list[str]]:
  """`raw`: the prompts as they are, not as a user's chat message (a random model's side); with `predictions`, each
  speculative request drafts from its own."""
  from pyruntime.engine.launcher import Done
  done: dict[int, Done] = {}

  def client(k: int) -> None:
    for i in range(k, len(prompts), c):
      ask = {"prompt": prompts[i], "raw": True} if raw else {"messages": [{"role": "user", "content": prompts[i]}]}
      if predictions is not None and speculative: ask["prediction"] = predictions[i]
      done[i] = next(ev for ev in lm.generate(**ask, max_tokens=max_tokens, speculative=speculative, prefix_cache=False)
                     if isinstance(ev, Done))
  t0 = time.monotonic()
  threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
  for t in threads: t.start()
  for t in threads: t.join()
  wall = time.monotonic() - t0
  ds = [done[i] for i in range(len(prompts))]
  tokens, seconds = sum(len(d.token_ids) for d in ds), sum(d.timings.elapsed_s for d in ds)
  drafted, accepted = sum(d.timings.drafted_tokens for d in ds), sum(d.timings.accepted_tokens for d in ds)
  return ({"tokens": tokens, "tokens_per_s": round(tokens / seconds, 2), "wall_tokens_per_s": round(tokens / wall, 2),
           "rounds": sum(d.timings.draft_rounds for d in ds), "drafted": drafted, "accepted": accepted,
           "acceptance": round(accepted / drafted, 3) if drafted else None}, [d.text for d in ds])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--concurrency", default="1,8")
  ap.add_argument("--max-tokens", type=int, default=128)
  ap.add_argument("--draft-tokens", type=int, default=7)
  ap.add_argument("--speculative", default="ngram", help="ngram, or model:PATH (a draft model)")
  ap.add_argument("--repeats", type=int, default=2, help="on/off pairs per level (medians reported)")
  ap.add_argument("--family", default=None, help="a random model of this family (bench/families.py), prediction drafts")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  if a.family: return family_side(a)
  from pyruntime.engine.launcher import Launcher
  rows = []
  with Launcher(a.model, stages=2, max_context=2048, warmup=True, speculative=a.speculative, draft_tokens=a.draft_tokens) as lm:
    run(lm, REPEAT[:2], 1, 16, True); run(lm, REPEAT[:2], 1, 16, False)  # warm: every graph a verify record takes
    for name, prompts in (("repeat", REPEAT), ("chat", CHAT)):
      for c in (int(x) for x in a.concurrency.split(",")):
        pairs = []
        for _ in range(a.repeats):
          off, t_off = run(lm, prompts, c, a.max_tokens, False)
          on, t_on = run(lm, prompts, c, a.max_tokens, True)
          if t_on != t_off: raise SystemExit(f"{name} C={c}: speculation changed the text: {t_on} != {t_off}")
          pairs.append((off, on))
        ratio = statistics.median(on["tokens_per_s"] / off["tokens_per_s"] for off, on in pairs)
        rows.append({"prompts": name, "concurrency": c, "off": pairs[-1][0], "on": pairs[-1][1], "on_vs_off": round(ratio, 3),
                     "on_vs_off_runs": [round(on["tokens_per_s"] / off["tokens_per_s"], 3) for off, on in pairs], "same_text": True})
  print(json.dumps(rows) if a.json else json.dumps(rows, indent=1))


def family_side(a: argparse.Namespace) -> None:
  """A random model of `a.family`: plain decoding, then drafts from a RIGHT and a WRONG prediction, same launcher."""
  from families import family_model
  from pyruntime.bench.machine import cpu

  from pyruntime.engine.launcher import Launcher
  prompts = [f"{p[:90]} {i}" for i, p in enumerate(REPEAT + CHAT)][:8]
  rows = []
  with Launcher(family_model(a.family), stages=1, max_context=1024, warmup=True, speculative=a.speculative, draft_tokens=a.draft_tokens) as lm:
    run(lm, prompts[:2], 1, 16, False, raw=True)
    for c in (int(x) for x in a.concurrency.split(",")):
      for _ in range(a.repeats):
        off, texts = run(lm, prompts, c, a.max_tokens, False, raw=True)
        for name, preds in (("right", texts), ("wrong", [PARAGRAPH] * len(prompts))):
          on, t_on = run(lm, prompts, c, a.max_tokens, True, preds, raw=True)
          if t_on != texts:
            i = next(i for i, (x, y) in enumerate(zip(t_on, texts, strict=True)) if x != y)
            raise SystemExit(f"{a.family} {name} C={c}: speculation changed the text of prompt {i}: {t_on[i]!r} != {texts[i]!r}")
          rows.append({"family": a.family, "prediction": name, "concurrency": c, "off": off, "on": on,
                       "on_vs_off": round(on["tokens_per_s"] / off["tokens_per_s"], 3)})
  if a.json: print(json.dumps(rows)); return
  print(cpu(), f"({a.family}, small random model, 1 stage)")
  for r in rows:
    on = r["on"]
    print(f"{r['family']:10s} C={r['concurrency']} prediction {r['prediction']:5s} plain {r['off']['tokens_per_s']:7.1f} tok/s  drafts "
          f"{on['tokens_per_s']:7.1f} tok/s ({r['on_vs_off']:.2f}x)  rounds {on['rounds']:4d}  accepted {on['accepted']}/{on['drafted']}")


if __name__ == "__main__":
  main()
