"""What a kv_budget costs and saves: the same streams with no budget (every stream's positions fit) and with budgets
that force preemption, side by side in one run (docs/streams.md, "A budget for keys and values: preemption").

  python bench/preemption.py [--model PATH | --model-size 1b|3b] [--streams 8] [--prompt 200] [--tokens 300]
                             [--budgets 0,2048,1024] [--stages 1] [--prefix-cache 8192] [--json] [--client]

Each budget runs on a launcher of its own (--stages stages, max_streams = --streams, the context the smallest budget
or the prompt and tokens need): --streams requests submitted at once, each a different prompt of about --prompt
tokens, greedy, `ignore_eos`, --tokens tokens. Printed per budget: the wall time of the whole run and the tokens per
second over it (ratio to no budget), the streams preempted, the most positions the open streams held at once, the
largest keys-and-values resident bytes any stage reported while it ran (sampled every second, and after), and
whether every stream's tokens equal the no-budget run's.

--client runs each budget as `pyruntime serve` (a process of its own, `--kv-budget`) driven by the official OpenAI
client instead: the streams as concurrent streamed chat completions (odd ones seeded at temperature 0.8, every third
in JSON mode), each answer's text compared with the no-budget server's; the preemptions read from /metrics.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

from pyruntime.bench.machine import cpu
from pyruntime.bench.sized_model import SIZES, sized_model

WORDS = ("river", "stone", "garden", "engine", "letter", "winter", "market", "signal", "forest", "window", "silver", "harbor")


def prompt(i: int, n: int) -> str:
  """About n tokens of text that differs from the other streams' from its first word (no shared prefix)."""
  words = [WORDS[(i * 7 + k * (i + 3)) % len(WORDS)] for k in range(n)]
  return f"Stream {i}: " + " ".join(words)


def run(model: str, budget: int, a: argparse.Namespace, context: int) -> dict:
  from pyruntime.engine.launcher import Done, Launcher
  with Launcher(model, stages=a.stages, max_streams=a.streams, max_context=context, kv_budget=budget, prefix_cache=a.prefix_cache,
                warmup=True) as lm:
    for _ in lm.generate("warm up", max_tokens=4): pass  # a first request, untimed
    dones: list = [None] * a.streams
    ended = threading.Semaphore(0)
    kv_resident = [0]

    def sink(i: int):
      def on_event(ev: object) -> None:
        if isinstance(ev, (Done, Exception)): dones[i] = ev; ended.release()
      return on_event

    def sample() -> None:
      for s in lm.stage_stats():
        kv_resident[0] = max(kv_resident[0], (s.get("memory") or {}).get("kv_resident", 0))

    t0 = time.perf_counter()
    for i in range(a.streams):
      lm.submit(prompt(i, a.prompt), raw=True, max_tokens=a.tokens, ignore_eos=True, temperature=0, speculative=False, on_event=sink(i))
    left = a.streams
    while left:
      if ended.acquire(timeout=1.0): left -= 1
      else: sample()
    wall = time.perf_counter() - t0
    sample()
    kv = lm.scheduler_stats()["kv"]
  bad = [d for d in dones if not isinstance(d, Done)]
  if bad: raise RuntimeError(f"budget {budget}: {bad[0]!r}")
  n = sum(len(d.token_ids) for d in dones)
  return {"budget": budget, "wall_s": round(wall, 2), "tokens_per_s": round(n / wall, 1), "preempted": kv["preempted"], "peak": kv["peak"],
          "kv_resident_mb": round(kv_resident[0] / 2**20, 1), "tokens": [d.token_ids for d in dones],
          "prompt_tokens": sum(d.usage.prompt_tokens for d in dones)}


def serve(model: str, budget: int, a: argparse.Namespace, context: int) -> dict:
  """The streams as chat completions through the official client against `pyruntime serve --kv-budget budget`."""
  import socket
  import subprocess
  import sys
  import urllib.request

  from openai import OpenAI
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "pyruntime", "serve", "--model", model, "--port", str(port), "--stages", str(a.stages), "--max-streams",
         str(a.streams), "--max-context", str(context), "--kv-budget", str(budget), "--prefix-cache", str(a.prefix_cache)]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
      if proc.poll() is not None: raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
      try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
          if json.loads(r.read()).get("status") == "ok": break
      except OSError: time.sleep(1)
    cl = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    texts: list = [None] * a.streams

    def one(i: int) -> None:
      extra = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
      if i % 3 == 2: extra["response_format"] = {"type": "json_object"}
      msgs = [{"role": "user", "content": prompt(i, a.prompt) + " Say something about these words."}]
      stream = cl.chat.completions.create(model="default", messages=msgs, max_tokens=a.tokens, stream=True, **extra)
      texts[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(a.streams)]
    for th in threads: th.start()
    for th in threads: th.join()
    wall = time.perf_counter() - t0
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r: metrics = r.read().decode()
    preempted = next((float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("pyruntime_streams_preempted_total ")), 0.0)
    return {"budget": budget, "wall_s": round(wall, 2), "preempted": int(preempted), "texts": texts}
  finally:
    proc.terminate()
    proc.wait(60)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--model-size", choices=list(SIZES), default=None, help="a random llama of Llama 3.2's shapes (bench/sized_model.py)")
  ap.add_argument("--streams", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=200, help="words per prompt (about as many tokens)")
  ap.add_argument("--tokens", type=int, default=300)
  ap.add_argument("--budgets", default="0,2048,1024", help="kv_budget values, comma-separated; 0 (no budget) is the reference")
  ap.add_argument("--stages", type=int, default=1)
  ap.add_argument("--prefix-cache", type=int, default=8192, help="the launchers' prefix_cache (where preempted positions go)")
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--client", action="store_true", help="through `pyruntime serve` and the official OpenAI client")
  a = ap.parse_args()
  from pyruntime.modelfile.source import default_model_path
  model = str(sized_model(a.model_size)) if a.model_size else a.model or str(default_model_path())
  budgets = [int(b) for b in a.budgets.split(",")]
  context = min([b for b in budgets if b] or [4096])  # one context for every run: the same graphs, the same plan
  print(f"# {cpu()}")
  print(f"# {model}: {a.streams} streams x ({a.prompt}-word prompt + {a.tokens} tokens), {a.stages} stage(s), context {context}, "
        f"prefix cache {a.prefix_cache}")
  if a.client:
    rows = [serve(model, b, a, context) for b in budgets]
    print(f"{'kv_budget':>10} {'wall s':>8} {'preempted':>9}  same texts as no budget")
    for r in rows: print(f"{r['budget'] or 'none':>10} {r['wall_s']:>8} {r['preempted']:>9}  {r['texts'] == rows[0]['texts']}")
    return
  rows = [run(model, b, a, context) for b in budgets]
  ref = rows[0]
  print(f"{'kv_budget':>10} {'wall s':>8} {'tok/s':>8} {'ratio':>6} {'preempted':>9} {'peak held':>9} {'kv resident MB':>14}  same tokens")
  for r in rows:
    same = r["tokens"] == ref["tokens"]
    print(f"{r['budget'] or 'none':>10} {r['wall_s']:>8} {r['tokens_per_s']:>8} {r['tokens_per_s'] / ref['tokens_per_s']:>6.2f} "
          f"{r['preempted']:>9} {r['peak']:>9} {r['kv_resident_mb']:>14}  {same}")
  if a.json: print(json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows]))


if __name__ == "__main__":
  main()
