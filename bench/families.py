"""Every model family at one size, pyruntime beside tinygrad's own single-process model on the same file, in one run.

  python bench/families.py [--families llama,qwen3moe,glm4moe,deepseek2,qwen35,qwen35moe] [--tokens 48] [--streams 1,8] [--size small|1b] [--json]

The files are random models written by tests/tinymodels.py at one size, Q8_0, with the tiny tokenizer's vocabulary
(300 tokens: the output projection costs next to nothing, so these figures are the blocks'). `small` (the default):
dim 512, 8 blocks, 8 heads / 4 KV heads of 64; dense FFN 1536; MoE 16 experts x 384, 4 used: the same active FFN; the
hybrid's GatedDeltaNet blocks with a state of 64 and every 2nd block attention. `1b`: Llama 3.2 1B's blocks (dim 2048,
16 blocks, 32 heads / 8 KV heads of 64, dense FFN 8192: 1.0B parameters in blocks); MoE 16 experts x 1024, 4 used
(1.6B parameters in experts, an active FFN of 4096: half the dense one). deepseek2: the MoE's experts (softmax over every
expert, not renormalised) under latent attention as DeepSeek-V2-Lite has it (no low-rank query): at 1b its dims (latent
512, rotary 64, 128 per head without rotation, values 128), at small a quarter of its latent (128, 32, 32, 64). Sides:

- **pyruntime**: a one-stage Launcher (the CPU's default weights, graphs captured at start: `warmup`), S streams at
  once, greedy, `ignore_eos`: aggregate decode tokens/s over the time from the first first token to the last token;
  and with several streams, **steady**: the tokens that arrived while every stream was decoding (from the last stream's
  first token to the first stream's last), over that time: decoding alone, without the other streams' prompt chunks
  that the whole window holds.
- **tinygrad**: `Transformer.from_gguf` and its `generate` in this process, one stream, the same prompt: tokens/s over
  the tokens after the first.

Printed first: the CPU; then per family each side's tokens/s and pyruntime's ratios (8 streams / 1, 1 stream / tinygrad's),
and the steady 8-stream figure and its ratio to one stream.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from pyruntime.bench.machine import cpu  # noqa: E402

SIZES = {"small": dict(dim=512, n_blocks=8, n_heads=8, n_kv_heads=4, head_dim=64, hidden=1536, context=1024),
         "1b": dict(dim=2048, n_blocks=16, n_heads=32, n_kv_heads=8, head_dim=64, hidden=8192, context=1024)}
EXPERT_FF = {"small": 384, "1b": 1024}  # 16 experts, 4 used
# latent attention as DeepSeek-V2-Lite has it (no low-rank query): its dims at 1b, a quarter of the latent at small
MLA_DIMS = {"small": dict(q_lora=0, kv_lora=128, rope=32, nope=32, v=64), "1b": dict(q_lora=0, kv_lora=512, rope=64, nope=128, v=128)}
FAMILY_ARGS = {
  "llama": dict(arch="llama", tied=True),
  "qwen3moe": dict(arch="qwen3moe", tied=False, qk_norm=True, rope_theta=1e6, moe=dict(experts=16, used=4, ff=384)),
  # a leading dense block, sigmoid routing with an expert bias, renormalised and scaled, a gated shared expert
  "glm4moe": dict(arch="glm4moe", tied=False, qkv_bias=True, rope_dim=32, post_norm=True,
                  moe=dict(experts=16, used=4, ff=384, shared=1, lead=1, bias=True, scale=2.5, norm=True, shared_gate=True)),
  # DeepSeek-V2's routing: softmax over every expert, the top k gathered, not renormalised
  "deepseek2": dict(arch="deepseek2", tied=False, moe=dict(experts=16, used=4, ff=384, norm=False), mla=MLA_DIMS["small"]),
  "qwen35": dict(arch="qwen35", tied=True, rope_dim=32, post_norm=True,
                 ssm=dict(conv_kernel=4, state_size=64, group_count=4, time_step_rank=8, inner_size=512, interval=2)),
  # the hybrid with routed experts and a gated shared expert in every block (Qwen3.5-35B-A3B's layout)
  "qwen35moe": dict(arch="qwen35moe", tied=False, rope_dim=32, post_norm=True,
                    ssm=dict(conv_kernel=4, state_size=64, group_count=4, time_step_rank=8, inner_size=512, interval=2),
                    moe=dict(experts=16, used=4, ff=384, shared=1, shared_gate=True)),
}
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest"


def write_model(folder: str, family: str, size: str = "small") -> str:
  from gguf import GGMLQuantizationType as Q
  from tinymodels import write_tiny_gguf
  types = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0}
  args = dict(FAMILY_ARGS[family])
  if "moe" in args: args["moe"] = {**args["moe"], "ff": EXPERT_FF[size]}
  if "mla" in args: args["mla"] = MLA_DIMS[size]
  return str(write_tiny_gguf(os.path.join(folder, f"{family}.gguf"), **SIZES[size], **args, types=types))


def family_model(family: str, size: str = "small") -> str:
  """A random model of `family` at `size` in a new temporary folder (other benchmarks' `--family`)."""
  return write_model(tempfile.mkdtemp(prefix=f"{family}-"), family, size)


def pyruntime_side(path: str, streams: list[int], tokens: int) -> dict:
  from pyruntime.engine.launcher import Launcher
  out: dict = {}
  with Launcher(path, stages=1, max_streams=max(streams), max_context=512, warmup=True) as lm:
    for _ in lm.generate(PROMPT, raw=True, max_tokens=4, temperature=0): pass  # a first request, untimed
    for s in streams:
      firsts, lasts, n, arrivals = [0.0] * s, [0.0] * s, [0] * s, [[] for _ in range(s)]
      threads = [threading.Thread(target=_stream, args=(lm, i, tokens, firsts, lasts, n, arrivals)) for i in range(s)]
      for t in threads: t.start()
      for t in threads: t.join()
      out[s] = round(sum(n) / (max(lasts) - min(firsts)), 1)
      lo, hi = max(firsts), min(lasts)  # every stream decoding
      if s > 1 and hi > lo: out[f"{s} steady"] = round(sum(k for a in arrivals for t, k in a if lo < t <= hi) / (hi - lo), 1)
  return out


def _stream(lm, i: int, tokens: int, firsts: list, lasts: list, n: list, arrivals: list) -> None:
  from pyruntime.engine.launcher import Delta, Done
  for ev in lm.generate(f"{PROMPT} {i}", raw=True, max_tokens=tokens, ignore_eos=True, temperature=0, prefix_cache=False):
    now = time.perf_counter()
    firsts[i] = firsts[i] or now
    lasts[i] = now
    if isinstance(ev, Delta): arrivals[i].append((now, len(ev.token_ids)))
    if isinstance(ev, Done): n[i] = len(ev.token_ids) - 1


def tinygrad_side(path: str, tokens: int) -> float | str:
  """tokens/s of tinygrad's own model, or why it could not run (a comparison side that fails is reported, not fatal)."""
  # tinygrad walks a MoE model's graph recursively: at 1b depth the default limit is too low (RecursionError)
  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 50_000))
  try: return _tinygrad_rate(path, tokens)
  except (Exception, RecursionError) as e: return f"failed: {type(e).__name__}"
  finally: sys.setrecursionlimit(limit)


def _tinygrad_rate(path: str, tokens: int) -> float:
  from tinygrad.llm.model import Transformer

  from pyruntime.text.tokenizer import Tokenizer
  model, _ = Transformer.from_gguf(path, max_context=512)
  ids = Tokenizer.from_gguf(path).encode(PROMPT)
  gen = model.generate(list(ids))
  next(gen)
  for _ in range(3): next(gen)  # its graphs captured, untimed
  t0 = time.perf_counter()
  for _ in range(tokens - 1): next(gen)
  return round((tokens - 1) / (time.perf_counter() - t0), 1)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--families", default=",".join(FAMILY_ARGS))
  ap.add_argument("--tokens", type=int, default=48)
  ap.add_argument("--streams", default="1,8")
  ap.add_argument("--size", choices=list(SIZES), default="small")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  streams = [int(s) for s in a.streams.split(",")]
  res: dict = {"cpu": cpu(), "size": SIZES[a.size], "tokens": a.tokens}
  with tempfile.TemporaryDirectory() as folder:
    for fam in a.families.split(","):
      path = write_model(folder, fam, a.size)
      res[fam] = {"pyruntime": pyruntime_side(path, streams, a.tokens), "tinygrad": tinygrad_side(path, a.tokens)}
  if a.json: print(json.dumps(res, indent=1)); return
  print(res["cpu"], f"({a.size} models)")
  for fam in a.families.split(","):
    p, t = res[fam]["pyruntime"], res[fam]["tinygrad"]
    many = f"  {streams[-1]} streams {p[streams[-1]]:6.1f} tok/s ({p[streams[-1]] / p[streams[0]]:.2f}x one)" if len(streams) > 1 else ""
    steady = f"  steady {p[k]:6.1f} tok/s ({p[k] / p[streams[0]]:.2f}x one)" if (k := f"{streams[-1]} steady") in p else ""
    own = f"tinygrad's own {t:6.1f} tok/s  (pyruntime {p[streams[0]] / t:.2f}x)" if isinstance(t, float) else f"tinygrad's own {t}"
    print(f"{fam:10s} pyruntime 1 stream {p[streams[0]]:6.1f} tok/s{many}{steady}  {own}")


if __name__ == "__main__":
  main()
