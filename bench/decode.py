"""Decode speed beside llama.cpp: the same GGUF file, the same prompts, greedy, a fixed number of tokens, in one run.

  python bench/decode.py [--model PATH | --model-size 1b|3b] [--stages 1,2] [--streams 1,8] [--tokens 128] [--threads 2] [--weights auto] [--json]
  pip install -e '.[bench]'     # llama-cpp-python, the peer (built from source: minutes; `.ci/setup --test` builds it
                                # as below, with this CPU's AVX-512 units where it has them)

A VM that lists AMX in /proc/cpuinfo without running it kills a `-march=native` build of the peer with SIGILL on its
first batch (`tilezero`); build it without AMX there:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
    -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install --force-reinstall --no-deps llama-cpp-python==0.3.36

Sides, one after the other in this process (llama.cpp) and in the launcher's stage processes (pyruntime):
- **llama.cpp** (llama-cpp-python's low-level API, `--threads` threads): the prompts of S streams evaluated as one
  batch, then S tokens per `llama_decode` call (one per stream, each its own sequence), argmax of each row's logits.
- **pyruntime** (`Launcher`, `--stages` stages, each weights mode of `--weights`: the default `auto`, or e.g.
  `auto,float16` to see packed weights beside float16 ones in the same run): S streams at once through `generate`, greedy,
  `ignore_eos`, speculation off (a plain decode step each token).

For each: the load time (llama.cpp: the model and its context; pyruntime: the launcher's start, every graph made ready),
decode tokens/s (every token after each stream's first, over the time from the first first token to the
last token: for pyruntime the later prompts, computed in that time, count against it), the prompt's time, and
the process's resident memory after loading (llama.cpp: this process's; pyruntime: its stage processes', summed).
Printed first: the CPU's model and vector features; both sides' figures side by side with their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

from pyruntime.bench.machine import cpu
from pyruntime.bench.sized_model import SIZES, sized_model

from pyruntime.stage.memory_use import describe

PROMPTS = [
  "Write a short story about a lighthouse keeper who finds a message in a bottle.",
  "Explain how a refrigerator works to a ten-year-old.",
  "List the planets of the solar system and one fact about each.",
  "Describe the water cycle in a few paragraphs.",
  "What are the main causes of the French Revolution?",
  "Write a poem about autumn leaves falling in a quiet park.",
  "Give three tips for learning a new language quickly.",
  "Summarise the plot of Romeo and Juliet.",
]


def rss_mb(pids: list[int]) -> float:
  total = 0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/status") as f: total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS"))
    except (OSError, StopIteration): pass
  return round(total / 1024, 1)


def llama_cpp_side(model: str, streams: list[int], tokens: int, threads: int) -> dict:
  import ctypes

  import llama_cpp as L
  import numpy as np
  S = max(streams)
  from llama_cpp import _internals
  t_load = time.perf_counter()
  llm = L.Llama(model_path=model, n_ctx=S * 1024, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
  # S sequences in one context, sharing one KV cache: what llama.cpp's server does for S parallel slots (Llama() itself
  # takes no n_seq_max, so the context is made again with it)
  llm.context_params.n_seq_max, llm.context_params.kv_unified = S, True
  llm._ctx = _internals.LlamaContext(model=llm._model, params=llm.context_params, verbose=False)
  ctx, vocab = llm._ctx.ctx, llm.n_vocab()
  out: dict = {"rss_mb": rss_mb([os.getpid()]), "version": L.__version__, "load_s": round(time.perf_counter() - t_load, 1)}
  batch = L.llama_batch_init(512 * S, 0, S)
  try:
    for s_count in streams:
      prompts = [llm.tokenize(p.encode(), add_bos=True) for p in PROMPTS[:s_count]]
      L.llama_memory_clear(L.llama_get_memory(ctx), True)
      last = []
      batch.n_tokens = 0
      for s, ids in enumerate(prompts):
        for i, t in enumerate(ids):
          n = batch.n_tokens
          batch.token[n], batch.pos[n], batch.n_seq_id[n] = t, i, 1
          batch.seq_id[n][0], batch.logits[n] = s, int(i == len(ids) - 1)
          batch.n_tokens += 1
        last.append(batch.n_tokens - 1)
      t0 = time.perf_counter()
      if L.llama_decode(ctx, batch) != 0: raise RuntimeError("llama_decode failed on the prompts")
      nxt = [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax()) for i in last]
      t_first = time.perf_counter()
      pos = [len(ids) for ids in prompts]
      for _ in range(tokens - 1):
        batch.n_tokens = s_count
        for s in range(s_count):
          batch.token[s], batch.pos[s], batch.n_seq_id[s], batch.logits[s] = nxt[s], pos[s], 1, 1
          batch.seq_id[s][0] = s
        if L.llama_decode(ctx, batch) != 0: raise RuntimeError("llama_decode failed on a decode step")
        nxt = [int(np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, s), ctypes.POINTER(ctypes.c_float)), shape=(vocab,)).argmax())
               for s in range(s_count)]
        pos = [p + 1 for p in pos]
      t_end = time.perf_counter()
      out[s_count] = {"decode_tokens_per_s": round(s_count * (tokens - 1) / (t_end - t_first), 1),
                      "prompt_s": round(t_first - t0, 3), "prompt_tokens": sum(map(len, prompts))}
  finally:
    L.llama_batch_free(batch)
  return out


def _stream(lm, i: int, tokens: int, firsts: list, lasts: list, dones: list) -> None:
  """Stream i of a pyruntime run: when its first and last events came, and its Done."""
  for ev in lm.generate(PROMPTS[i], raw=True, max_tokens=tokens, ignore_eos=True, temperature=0, speculative=False, prefix_cache=False):
    now = time.perf_counter()
    if not firsts[i]: firsts[i] = now
    lasts[i] = now
    if type(ev).__name__ == "Done": dones[i] = ev


def pyruntime_side(model: str, stages: int, streams: list[int], tokens: int, weights: str = "auto", prefill_share: float | None = None) -> dict:
  from pyruntime.engine.launcher import Launcher
  out: dict = {}
  share = {} if prefill_share is None else {"prefill_share": prefill_share}
  # warmup: every window captured before the clock starts
  with Launcher(model, stages=stages, max_streams=max(streams), max_context=1024, warmup=True, weights=weights, **share) as lm:
    out["rss_mb"] = rss_mb([h.proc.pid for h in lm.handles])
    out["load_s"] = round(lm.load_s, 1)  # spawn, weights, and every graph made ready (from the graph cache, or captured)
    out["weights"] = list(lm.planned.weights)
    for _ in lm.generate(PROMPTS[0], raw=True, max_tokens=4, temperature=0): pass  # a first request, untimed
    for s_count in streams:
      firsts, lasts, dones = [0.0] * s_count, [0.0] * s_count, [None] * s_count
      t0 = time.perf_counter()
      threads = [threading.Thread(target=_stream, args=(lm, i, tokens, firsts, lasts, dones)) for i in range(s_count)]
      for t in threads: t.start()
      for t in threads: t.join()
      n = sum(len(d.token_ids) - 1 for d in dones)
      out[s_count] = {"decode_tokens_per_s": round(n / (max(lasts) - min(firsts)), 1),
                      "prompt_s": round(max(d.timings.ttft_s for d in dones), 3), "first_tokens_s": round(max(firsts) - t0, 3),
                      "prompt_tokens": sum(len(d.prompt_token_ids) for d in dones)}
    out["memory"] = [s.get("memory") for s in lm.stage_stats()]  # where each stage's memory went (pyruntime/stage/memory_use.py)
  return out



def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--model-size", choices=list(SIZES), default=None,
                  help="a random llama of Llama 3.2's shapes with the bundled tokenizer (bench/sized_model.py), instead of --model")
  ap.add_argument("--stages", default="1,2")
  ap.add_argument("--streams", default="1,8")
  ap.add_argument("--tokens", type=int, default=128)
  ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
  ap.add_argument("--weights", default="auto", help="weights modes of the pyruntime sides, comma-separated")
  ap.add_argument("--prefill-share", type=float, default=None,
                  help="the launcher's prefill_share (default its own): 0 computes a new prompt in whole chunks beside decoding streams")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.modelfile.source import default_model_path
  model = str(sized_model(a.model_size)) if a.model_size else a.model or str(default_model_path())
  streams = [int(s) for s in a.streams.split(",")]
  res: dict = {"cpu": cpu(), "model": os.path.basename(model), "tokens": a.tokens,
               "llama.cpp": llama_cpp_side(model, streams, a.tokens, a.threads)}
  for st in (int(s) for s in a.stages.split(",")):
    for w in a.weights.split(","):
      name = f"pyruntime {st} stage{'s' * (st > 1)}" + (f" {w}" if w != "auto" else "")
      res[name] = pyruntime_side(model, st, streams, a.tokens, w, a.prefill_share)
  if a.json: print(json.dumps(res, indent=1))
  print(res["cpu"])
  ref = res["llama.cpp"]
  for side, r in res.items():
    if not isinstance(r, dict): continue
    for s in streams:
      ratio = r[s]["decode_tokens_per_s"] / ref[s]["decode_tokens_per_s"]
      print(f"{side:28s} {s} stream{'s' * (s > 1):1s}  decode {r[s]['decode_tokens_per_s']:7.1f} tok/s ({ratio:4.2f}x llama.cpp)"
            f"  prompt {r[s]['prompt_s']:6.2f} s for {r[s]['prompt_tokens']} tokens  rss {r['rss_mb']} MB  load {r['load_s']} s")
    for i, m in enumerate(r.get("memory") or []):
      if m: print(f"{'':28s} stage {i} {describe(m)}")


if __name__ == "__main__":
  main()
