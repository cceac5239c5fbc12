"""A sampling CPU profiler for a stage's hot loop, on when PYRUNTIME_PROFILE is set.

Every PYRUNTIME_PROFILE_INTERVAL_MS (default 5) a daemon thread samples the data loop
thread's current line; every PYRUNTIME_PROFILE_REPORT_S (default 10) and at exit it emits a
`ProfileReport` event with the hottest lines and the process's CPU time over wall time.
Sampling Python frames costs nothing in the loop itself, which is the point.
"""
from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from typing import Any, Callable


def start_profiler(emit: Callable[..., Any], thread_name: str = "data-loop", top: int = 25) -> None:
  interval = float(os.environ.get("PYRUNTIME_PROFILE_INTERVAL_MS", "5")) / 1000
  report_every = float(os.environ.get("PYRUNTIME_PROFILE_REPORT_S", "10"))
  counts: collections.Counter[str] = collections.Counter()
  t_wall, t_cpu = time.monotonic(), time.process_time()
  lock = threading.Lock()

  def report() -> None:
    with lock: hottest, total = counts.most_common(top), sum(counts.values())
    wall = time.monotonic() - t_wall
    emit("ProfileReport", samples=total, wall_s=round(wall, 3), cpu_over_wall=round((time.process_time() - t_cpu) / max(wall, 1e-9), 3),
         lines=[{"where": where, "samples": n} for where, n in hottest])

  def sample() -> None:
    last = time.monotonic()
    while True:
      time.sleep(interval)
      target = next((t for t in threading.enumerate() if t.name == thread_name), None)
      frame = sys._current_frames().get(target.ident) if target is not None and target.ident else None
      if frame is not None:
        with lock: counts[f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"] += 1
      if time.monotonic() - last >= report_every:
        report()
        last = time.monotonic()

  threading.Thread(target=sample, name="profiler", daemon=True).start()
  atexit.register(report)
