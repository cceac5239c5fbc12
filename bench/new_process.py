"""A new process answering one question, caches warm, beside llama.cpp's new process: the same file, the same question,
sides in turn, in one run (issue #36's target: pyruntime at most 3x llama.cpp).

    python bench/new_process.py [--model PATH] [--repeats 3] [--tokens 16] [--stages 2] [--json]
    pip install -e '.[bench]'     # llama-cpp-python, the peer

- **pyruntime**: `pyruntime generate QUESTION --max-tokens N --stages S --json`, a new process each time; its own load
  time and first token come from the JSON. One run first, not counted, fills the graph cache.
- **llama.cpp**: a new Python process that imports llama_cpp, loads the file (`Llama(...)`) and answers with
  `create_chat_completion(max_tokens=N)`.

Each figure is the process's wall time from spawn to exit (medians of the repeats); the ratio is pyruntime's over
llama.cpp's. Printed first: the CPU's model and vector features.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from pyruntime.bench.machine import cpu

QUESTION = "What is the capital of France?"
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[2]}], max_tokens=int(sys.argv[3]), temperature=0)
print(out["choices"][0]["message"]["content"])
"""


def timed(cmd: list[str]) -> tuple[float, str]:
  t0 = time.monotonic()
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  wall = time.monotonic() - t0
  if p.returncode != 0: raise SystemExit(f"{cmd[:3]} failed ({p.returncode}): {p.stderr[-2000:]}")
  return wall, p.stdout


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--tokens", type=int, default=16)
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  from pyruntime.modelfile.source import default_model_path
  model = a.model or str(default_model_path())
  ours = [sys.executable, "-m", "pyruntime", "generate", QUESTION, "--model", model, "--max-tokens", str(a.tokens),
          "--stages", str(a.stages), "--json"]
  peer = [sys.executable, "-c", LLAMA, model, QUESTION, str(a.tokens)]
  timed(ours)  # fills the graph cache (and tinygrad's): the figures are a warm-cache start
  rows: dict[str, list] = {"pyruntime": [], "llama.cpp": [], "load_s": [], "ttft_s": []}
  for _ in range(a.repeats):
    wall, out = timed(ours)
    t = json.loads(out.strip().splitlines()[-1])["timings"]
    rows["pyruntime"].append(wall)
    rows["load_s"].append(t["load_s"])
    rows["ttft_s"].append(t["ttft_s"])
    rows["llama.cpp"].append(timed(peer)[0])
  med = {k: statistics.median(v) for k, v in rows.items()}
  result = {"cpu": cpu(), "stages": a.stages, "tokens": a.tokens, "runs": rows, "median": med,
            "ratio": med["pyruntime"] / med["llama.cpp"]}
  if a.json: print(json.dumps(result, indent=1))
  else:
    print(f"cpu: {result['cpu']}")
    print(f"new process, {a.tokens} tokens, medians of {a.repeats}: pyruntime {med['pyruntime']:.2f} s (load {med['load_s']:.2f} s, "
          f"first token {med['ttft_s']:.2f} s), llama.cpp {med['llama.cpp']:.2f} s: {result['ratio']:.1f}x")


if __name__ == "__main__":
  main()
