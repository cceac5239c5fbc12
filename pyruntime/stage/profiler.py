"""A sampling CPU profiler for a stage's hot loop, on when PYRUNTIME_PROFILE is set.

Every PYRUNTIME_PROFILE_INTERVAL_MS (default 5) a daemon thread samples the line of our own code
(the innermost frame in the pyruntime package; time inside tinygrad or numpy counts for the line
that called it) that the stage's main thread, which runs the data loop, is at; every PYRUNTIME_PROFILE_REPORT_S (default 10) and at exit it emits a
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

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pyruntime/, every layer


def start_profiler(emit: Callable[..., Any], thread: threading.Thread | None = None, top: int = 25) -> Callable[[], None]:
  """Start sampling `thread` (default: the main thread). Returns the function that emits a report (the stage calls it on
  its way out too: an exit by os._exit skips atexit)."""
  target = thread or threading.main_thread()
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
      frame = sys._current_frames().get(target.ident) if target.ident else None
      inner = frame
      while frame is not None and PACKAGE not in frame.f_code.co_filename: frame = frame.f_back
      frame = frame or inner
      if frame is not None:
        with lock: counts[f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"] += 1
      if time.monotonic() - last >= report_every:
        report()
        last = time.monotonic()

  threading.Thread(target=sample, name="profiler", daemon=True).start()
  atexit.register(report)
  return report
