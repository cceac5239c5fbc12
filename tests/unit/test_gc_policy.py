"""Garbage is collected on the main thread only, never on tinygrad's CPU worker threads, where a collection that frees
a device buffer waits on the queue that thread serves (pyruntime/stage/gc_policy.py: seen as a CI hang)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

from pyruntime.stage.gc_policy import collect_due

COLLECTIONS_BY_THREAD = textwrap.dedent("""
  import gc, json, sys, threading
  from tinygrad import Tensor
  if sys.argv[1] == "policy":
    from pyruntime.stage.gc_policy import collect_due, collect_on_this_thread
    collect_on_this_thread()
  else: collect_due = lambda: 0
  seen = set()
  gc.callbacks.append(lambda phase, info: seen.add(threading.current_thread().name) if phase == "start" else None)
  gc.set_threshold(1, 1000, 1000)  # a young collection at nearly every allocation, on whichever thread allocates
  for i in range(20):
    (Tensor.rand(16, 16) @ Tensor.rand(16, 16)).realize().numpy()
    collect_due()
  print(json.dumps(sorted(seen)))
""")


def collections_by_thread(mode: str) -> list[str]:
  out = subprocess.run([sys.executable, "-c", COLLECTIONS_BY_THREAD, mode], capture_output=True, text=True, timeout=120,
                       env={"DEV": "CPU", **os.environ})
  assert out.returncode == 0, out.stderr
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_tinygrad_workers_collect_garbage_unless_the_policy_is_on():
  """Without the policy, tinygrad's worker threads run collections too (so this test can see the hazard); with it,
  only the main thread does."""
  assert set(collections_by_thread("auto")) - {"MainThread"}
  assert collections_by_thread("policy") == ["MainThread"]


def test_collect_due_collects_what_the_automatic_policy_would():
  assert not gc.isenabled()  # conftest turned the policy on for the tests' own process too
  class Cycle: pass
  for _ in range(gc.get_threshold()[0] + 1):
    c = Cycle(); c.me = c
  del c
  assert gc.get_count()[0] > gc.get_threshold()[0] and collect_due() >= 0 and gc.get_count()[0] < gc.get_threshold()[0]
  for _ in range(2):  # that young collection may have made an older generation due (each older one at most once)
    if collect_due() == -1: break
  assert collect_due() == -1  # nothing due: a cheap check
  assert threading.current_thread() is threading.main_thread()
