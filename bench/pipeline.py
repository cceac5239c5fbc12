"""Pipeline benchmark: decode tokens/s and time to first token for 1, 2 and 3 stages against
tinygrad's own single-process `Transformer.generate`, on the same model and device, in one run.

    python bench/pipeline.py [--model M] [--tokens 32] [--stages 1,2,3] [--weights auto,quantized] [--json]
    pyruntime bench pipeline --json

Also reports, per pipeline, the ring time per hop per token (wall time per decoded token minus
the stages' own compute time per token, over the hops a token makes: launcher → head, stage →
stage, tail → launcher) and the launcher's own time per token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPT = "Write one sentence about the sea."


def bench_reference(path: str, prompt_ids: list[int], n_tokens: int, max_context: int) -> dict:
  """tinygrad's single-process model, warmed once (JIT capture), then timed."""
  from tinygrad.llm.model import Transformer

  from pyruntime.stage.compute import cuda_graph
  cuda_graph.install()  # tinygrad 0.13's own CUDA graphs fail on their first variable-sized kernel (see that module)
  t0 = time.monotonic()
  model, _ = Transformer.from_gguf(path, max_context=max_context)
  load_s = time.monotonic() - t0
  rows = []
  for _ in range(2):  # run 0 compiles and captures the JITs; run 1 is the warm measurement
    model._cached_tokens = []
    t0 = time.monotonic()
    times = []
    for i, _tok in enumerate(model.generate(list(prompt_ids))):
      times.append(time.monotonic())
      if i + 1 >= n_tokens: break
    rows.append({"ttft_s": times[0] - t0, "decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0])})
  return {"system": "tinygrad single-process", "stages": 1, "load_s": round(load_s, 3),
          "ttft_s_cold": round(rows[0]["ttft_s"], 4), "ttft_s": round(rows[1]["ttft_s"], 4),
          "decode_tokens_per_s": round(rows[1]["decode_tokens_per_s"], 3)}


def bench_pipeline(path: str, n_stages: int, prompt: str, n_tokens: int, max_context: int, weights: str = "auto") -> dict:
  from pyruntime.engine.launcher import Done, Launcher
  with Launcher(path, stages=n_stages, max_context=max_context, weights=weights) as lm:
    runs = []
    for _ in range(2):
      before = lm.stage_stats()
      oh0 = dict(lm.overhead, cpu_seconds=lm.driver_cpu_s())
      done = next(ev for ev in lm.generate(prompt, raw=True, max_tokens=n_tokens, ignore_eos=True) if isinstance(ev, Done))
      after = lm.stage_stats()
      runs.append((done, before, after, oh0, dict(lm.overhead, cpu_seconds=lm.driver_cpu_s())))
    done, before, after, oh0, oh1 = runs[1]
    decoded = done.usage.completion_tokens - 1
    wall_per_token = 1.0 / done.timings.decode_tokens_per_s if done.timings.decode_tokens_per_s else float("nan")
    # compute per decoded token, summed over stages (prefill record excluded: one record per stage per token after it)
    def delta(key: str) -> float: return sum(a[key] - b[key] for a, b in zip(after, before, strict=True))
    # per decoded token (one record per stage each), the stages' own work: compute, and sampling/egress write
    busy = (delta("compute_s") + delta("emit_s") - delta("prefill_s")) / max(1, decoded)
    emit = delta("emit_s") / max(1, done.usage.completion_tokens)
    hops = n_stages + 1
    n_oh = max(1, oh1["tokens"] - oh0["tokens"])
    launcher_wall = (oh1["seconds"] - oh0["seconds"]) / n_oh
    launcher_cpu = (oh1["cpu_seconds"] - oh0["cpu_seconds"]) / n_oh
    # what is left of a token's wall time once every stage's work and the launcher's own CPU are taken out:
    # the ring writes' wake-ups and the reads' wake-up latency (a waiting stage is parked on its futex)
    ring_per_hop = max(0.0, wall_per_token - busy - launcher_cpu) / hops
    return {"system": f"pyruntime ({'/'.join(dict.fromkeys(lm.weights))})", "stages": n_stages, "split": [list(r) for r in lm.split],
            "load_s": round(lm.load_s, 3),
            "ttft_s_cold": runs[0][0].timings.ttft_s, "ttft_s": done.timings.ttft_s,
            "decode_tokens_per_s": done.timings.decode_tokens_per_s, "decoded_tokens": decoded,
            "ring_us_per_hop_per_token": round(ring_per_hop * 1e6, 1), "launcher_us_per_token": round(launcher_cpu * 1e6, 1),
            "launcher_wall_us_per_token": round(launcher_wall * 1e6, 1), "stage_emit_us_per_record": round(emit * 1e6, 1),
            "token_ids": done.token_ids}


def main(argv: list[str] | None = None) -> int:
  class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter): pass
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=Help)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
  ap.add_argument("--stages", default="1,2,3", help="comma-separated stage counts, one pipeline each")
  ap.add_argument("--max-context", type=int, default=512, help="context of every pipeline and of the reference")
  ap.add_argument("--weights", default="auto", help="comma-separated: each pipeline runs once per weights mode (see Launcher)")
  ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
  a = ap.parse_args(argv)
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.source import resolve_model
  from pyruntime.text.chat import build_prompt_ids
  from pyruntime.text.tokenizer import Tokenizer
  path = str(resolve_model(a.model))
  header = read_header(path)
  ids = build_prompt_ids(Tokenizer.from_gguf_kv(header.kv), header.kv, prompt=PROMPT, raw=True)
  rows = [bench_reference(path, ids, a.tokens, a.max_context)]
  for n in (int(s) for s in a.stages.split(",")):
    for w in a.weights.split(","): rows.append(bench_pipeline(path, n, PROMPT, a.tokens, a.max_context, w))
  ref = rows[0]["decode_tokens_per_s"]
  for r in rows: r["decode_vs_reference"] = round(r["decode_tokens_per_s"] / ref, 3)
  if a.json:
    print(json.dumps(rows))
  else:
    print(f"model {os.path.basename(path)}, {a.tokens} tokens, device {os.environ.get('DEV', 'auto')}")
    for r in rows:
      extra = (f"  ring {r['ring_us_per_hop_per_token']} us/hop/token, launcher {r['launcher_us_per_token']} us CPU "
               f"({r['launcher_wall_us_per_token']} us wall)/token" if "split" in r else "")
      print(f"{r['system']:>32} x{r['stages']}: decode {r['decode_tokens_per_s']:7.2f} tok/s ({r['decode_vs_reference']:.0%} of reference), "
            f"ttft {r['ttft_s']:.3f} s (cold {r['ttft_s_cold']:.2f} s), load {r['load_s']:.1f} s{extra}")
    same = all(r.get("token_ids") == rows[1].get("token_ids") for r in rows[1:])
    print(f"token ids equal across pipelines: {same}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
