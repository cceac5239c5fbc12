"""A pipeline over two hosts beside one host, in one run (docs/hosts.md).

  python bench/hosts.py [--model PATH] [--tokens 64] [--repeats 3] [--json]

1. The bridge beside the ring: records of 64 B, 2,304 B (a SmolLM2 residual row) and 64 KiB, written into a ring and
   read (a) from the same ring, (b) from a second ring that a bridge continues over TCP loopback. Throughput (records/s)
   and one record's latency (written, then waited for on the far side, one at a time; median). In one process: the
   bridge's two threads share the GIL with the writer and the reader, as an agent's do with nothing else.
2. The pipeline: SmolLM2 in 2 stages on one host, and on two Ray nodes of a local cluster (ray.cluster_utils; each
   stage on its own node, so every token crosses three bridges), alternating; greedy, the same tokens checked; the
   median time between tokens of one stream (C=1) and the difference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time


def ring_vs_bridge(size: int, n: int) -> dict:
  from pyruntime.transport.bridge import BridgeReceiver, BridgeSender, link_hello
  from pyruntime.transport.ring import Arena, RingSpec
  secret, hello = os.urandom(32), link_hello("bench", 0, "", "bench")
  payload = os.urandom(size)
  out = {}
  for mode in ("ring", "bridge"):
    with Arena.create([RingSpec(1 << 22, 1 << 17, 4)] * 2) as a:
      w = a.writer(0)
      if mode == "ring": r, links = a.reader(0), []
      else:
        rx = BridgeReceiver(a.writer(1), secret, hello)
        links = [rx, BridgeSender(a.reader(0), rx.address, secret, hello)]
        r = a.reader(1)
      t = threading.Thread(target=lambda w=w: [w.write(i, payload) for i in range(n)])
      t0 = time.perf_counter()
      t.start()
      for _ in range(n):
        r.read(timeout=30)
        r.release()
      rate = n / (time.perf_counter() - t0)
      t.join()
      lat = []
      for i in range(min(n, 2000)):
        t1 = time.perf_counter()
        w.write(i, payload)
        r.read(timeout=30)
        lat.append(time.perf_counter() - t1)
        r.release()
      for link in links: link.close()
      out[mode] = {"records_per_s": round(rate), "mb_per_s": round(rate * size / 1e6, 1), "latency_us_p50": round(1e6 * statistics.median(lat), 1)}
  return out


def token_gaps(lm, prompt: str, tokens: int) -> tuple[list[int], float]:
  from pyruntime.engine.launcher import Delta, Done
  times, ids = [], []
  for ev in lm.generate(prompt, raw=True, max_tokens=tokens, temperature=0.0, ignore_eos=True):
    if isinstance(ev, Delta): times.append(time.perf_counter())
    elif isinstance(ev, Done): ids = ev.token_ids
  gaps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # from the second token: decode steps only
  return ids, statistics.median(gaps)


def pipelines(model: str | None, tokens: int, repeats: int) -> dict:
  import ray
  from ray.cluster_utils import Cluster

  from pyruntime.engine.launcher import Launcher
  c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
  c.add_node(num_cpus=1, object_store_memory=80 << 20)
  ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
  c.wait_for_nodes()
  prompt = "The history of the lighthouse begins with fires lit on hills by the sea."
  try:
    with Launcher(model, stages=2) as one, Launcher(model, stages=2, placement="ray", hosts=2) as two:
      token_gaps(one, prompt, 8), token_gaps(two, prompt, 8)  # warm
      steps: dict[str, list[float]] = {"one_host_ms": [], "two_hosts_ms": []}
      for _ in range(repeats):
        a, ga = token_gaps(one, prompt, tokens)
        b, gb = token_gaps(two, prompt, tokens)
        assert a == b, "two hosts gave other tokens than one"
        steps["one_host_ms"].append(1e3 * ga)
        steps["two_hosts_ms"].append(1e3 * gb)
      bridges = two.placement.bridge_stats()
  finally:
    ray.shutdown()
    c.shutdown()
  one_ms, two_ms = statistics.median(steps["one_host_ms"]), statistics.median(steps["two_hosts_ms"])
  return {"decode_step_ms_c1": {"one_host": round(one_ms, 2), "two_hosts": round(two_ms, 2), "difference": round(two_ms - one_ms, 2)},
          "runs": {k: [round(v, 2) for v in vs] for k, vs in steps.items()}, "bridges": bridges}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--records", type=int, default=20000)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  res = {"bridge_vs_ring": {f"{size}B": ring_vs_bridge(size, a.records if size < 65536 else a.records // 10) for size in (64, 2304, 65536)},
         "pipeline": pipelines(a.model, a.tokens, a.repeats)}
  if a.json: print(json.dumps(res, indent=1)); return
  for size, r in res["bridge_vs_ring"].items():
    print(f"{size:>7}: ring {r['ring']['records_per_s']:>8} rec/s {r['ring']['latency_us_p50']:>7} us   "
          f"bridge {r['bridge']['records_per_s']:>8} rec/s {r['bridge']['latency_us_p50']:>7} us   "
          f"({r['bridge']['mb_per_s']} MB/s)")
  d = res["pipeline"]["decode_step_ms_c1"]
  print(f"decode step, C=1: one host {d['one_host']} ms, two hosts {d['two_hosts']} ms, difference {d['difference']} ms")


if __name__ == "__main__":
  main()
