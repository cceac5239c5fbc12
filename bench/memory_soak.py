"""Memory under a long mixed load: does a server's resident memory stay flat? (#60: "memory flat under an hour").

  python bench/memory_soak.py [--minutes 60] [--clients 6] [--every 30] [--model PATH | --model-size 1b] [--kv-budget N] [--json]

Starts the OpenAI server over a launcher here (bench/serve.py's server_here: 2 stages, every graph captured first), then
--clients threads send real traffic through HTTP for --minutes, each request drawn by a seeded generator from a mix:
chat conversations that resend their growing history (the prefix cache fills, evicts and hits), plain completions of
random prompt and answer lengths, `n`=2 choices, log-probabilities, JSON-mode structured output, and streams the client
drops after a few tokens (cancellation). Every --every seconds it samples each stage process's resident memory and its
breakdown by kind (pyruntime/stage/memory_use.py, as /stats has it) and the launcher process's own.

Printed: one line per sample; then, after the first 20% of the run (caches and pools filling), the least-squares
slope of the total resident memory in MB per hour, its range, and the requests served and failed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from typing import Any

from pyruntime.bench.machine import cpu
from pyruntime.bench.serve import SYSTEM, chat_body, make_text, server_here, stream


def rss_mb(pid: int) -> float:
  try:
    with open(f"/proc/{pid}/status") as f: return int(next(ln.split()[1] for ln in f if ln.startswith("VmRSS"))) / 1024
  except (OSError, StopIteration): return 0.0


def one_request(cl: Any, url: str, model: str, rng: random.Random, history: list[dict]) -> str:
  """One request of the mix; returns its kind. `history` is this client's conversation (grown, or reset)."""
  kind = rng.choice(["chat", "chat", "chat", "completion", "n2", "logprobs", "json", "dropped"])
  if kind == "chat":
    if len(history) > 9 or not history: history[:] = [{"role": "system", "content": SYSTEM}]
    history.append({"role": "user", "content": make_text(rng, rng.randint(20, 300)) + " What do you think?"})
    res = stream(cl, url + "/v1/chat/completions", chat_body(model, history, rng.randint(4, 24)))
    history.append({"role": "assistant", "content": res["text"]})
  elif kind == "dropped":  # a client that leaves mid-answer: the server cancels its stream
    body = {"model": model, "prompt": make_text(rng, rng.randint(20, 400)), "max_tokens": 64, "stream": True, "ignore_eos": True}
    with cl.stream("POST", url + "/v1/completions", json=body) as r:
      for i, _ in enumerate(r.iter_lines()):
        if i >= 3: break
  else:
    body: dict = {"model": model, "prompt": make_text(rng, rng.randint(10, 600)), "max_tokens": rng.randint(1, 32),
                  "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 1 << 30)}
    if kind == "n2": body["n"] = 2
    if kind == "logprobs": body |= {"logprobs": 3, "echo": rng.random() < 0.5}
    if kind == "json":
      body = chat_body(model, [{"role": "user", "content": "Describe a city as JSON."}], rng.randint(8, 32),
                       response_format={"type": "json_object"})
      r = cl.post(url + "/v1/chat/completions", json=body)
    else: r = cl.post(url + "/v1/completions", json=body)
    if r.status_code != 200: raise RuntimeError(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")
  return kind


def client(url: str, model: str, i: int, until: float, counts: dict, lock: threading.Lock) -> None:
  import httpx
  rng, history = random.Random(7000 + i), []
  with httpx.Client(timeout=900) as cl:
    while time.monotonic() < until:
      try: kind, ok = one_request(cl, url, model, rng, history), True
      except Exception as e:  # counted, and the load goes on: the point is the memory over time
        kind, ok = f"failed: {type(e).__name__}: {str(e)[:120]}", False
      with lock: counts[kind if ok else "failed"] = counts.get(kind if ok else "failed", 0) + 1
      if not ok: print(kind, flush=True)


def slope_mb_per_h(ts: list[float], ys: list[float]) -> float:
  n = len(ts)
  if n < 2: return 0.0
  mt, my = sum(ts) / n, sum(ys) / n
  den = sum((t - mt) ** 2 for t in ts)
  return 0.0 if den == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den * 3600


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--minutes", type=float, default=60.0)
  ap.add_argument("--clients", type=int, default=6)
  ap.add_argument("--every", type=float, default=30.0, help="seconds between memory samples")
  ap.add_argument("--model", default=None)
  ap.add_argument("--model-size", default=None, help="a sized model (bench/sized_model.py) instead of --model")
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument("--max-streams", type=int, default=8)
  ap.add_argument("--max-context", type=int, default=2048)
  ap.add_argument("--kv-budget", type=int, default=0, help="the launcher's kv_budget (0: none): a soak of preemption too")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  if a.model_size:
    from pyruntime.bench.sized_model import sized_model
    a.model = str(sized_model(a.model_size))
  a.weights = "auto"
  print(cpu(), flush=True)
  samples: list[dict] = []
  counts: dict = {}
  lock = threading.Lock()
  with server_here(a, 2.0) as (url, lm):
    model = lm.model_name
    t0 = time.monotonic()
    until = t0 + a.minutes * 60
    threads = [threading.Thread(target=client, args=(url, model, i, until, counts, lock), daemon=True) for i in range(a.clients)]
    for t in threads: t.start()
    while time.monotonic() < until:
      time.sleep(min(a.every, max(0.0, until - time.monotonic())))
      stats = lm.stage_stats()
      stages = [rss_mb(h.proc.pid) for h in lm.handles]
      s = {"t_s": round(time.monotonic() - t0, 1), "stages_mb": [round(x, 1) for x in stages], "launcher_mb": round(rss_mb(os.getpid()), 1),
           "memory": [st.get("memory") for st in stats], "requests": dict(counts), "kv": lm.scheduler_stats()["kv"]}
      s["total_mb"] = round(sum(stages) + s["launcher_mb"], 1)
      samples.append(s)
      kinds = ", ".join(f"{m.get('prefix_cache', 0) / 1e6:.0f}/{m.get('other_buffers', 0) / 1e6:.0f}/{m.get('kv_resident', 0) / 1e6:.0f}/"
                        f"{m.get('rest', 0) / 1e6:.0f}" for m in s["memory"] if m)
      print(f"{s['t_s']:8.0f} s  total {s['total_mb']:8.1f} MB  stages {s['stages_mb']}  launcher {s['launcher_mb']} MB  "
            f"(prefix cache/other buffers/kv/rest MB per stage: {kinds})  requests {sum(counts.values())}"
            + (f"  preempted {s['kv']['preempted']} (peak {s['kv']['peak']} of {s['kv']['budget']})" if s["kv"]["budget"] else ""), flush=True)
    for t in threads: t.join(timeout=900)
  settled = [s for s in samples if s["t_s"] >= 0.2 * a.minutes * 60]
  ys = [s["total_mb"] for s in settled]
  res = {"cpu": cpu(), "model": os.path.basename(a.model or "default"), "minutes": a.minutes, "clients": a.clients,
         "slope_mb_per_h": round(slope_mb_per_h([s["t_s"] for s in settled], ys), 1),
         "settled_min_mb": min(ys, default=0), "settled_max_mb": max(ys, default=0), "requests": counts}
  if a.json: print(json.dumps({"summary": res, "samples": samples}))
  print(f"after the first 20%: total resident {res['settled_min_mb']}..{res['settled_max_mb']} MB, slope {res['slope_mb_per_h']} MB/h; "
        f"requests {counts}")


if __name__ == "__main__":
  main()
