"""Drive one real `python -m pyruntime.stage` process over its JSON-lines control channel."""
from __future__ import annotations

import json
import select
import subprocess
import sys
import time


class StageProc:
  def __init__(self, env: dict | None = None) -> None:
    self.p = subprocess.Popen([sys.executable, "-m", "pyruntime.stage"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    self.seen: list[dict] = []

  def send(self, command: str, **args) -> None:
    self.p.stdin.write(json.dumps({"command": command, **args}) + "\n")
    self.p.stdin.flush()

  def send_raw(self, line: str) -> None:
    self.p.stdin.write(line + "\n")
    self.p.stdin.flush()

  def next_event(self, timeout: float = 120.0) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      ready, _, _ = select.select([self.p.stdout], [], [], 0.1)
      if ready:
        line = self.p.stdout.readline()
        if not line: return None  # EOF: the process is gone
        ev = json.loads(line)
        self.seen.append(ev)
        return ev
    raise TimeoutError(f"no event within {timeout} s; seen {self.seen}")

  def expect(self, name: str, timeout: float = 120.0) -> dict:
    while (ev := self.next_event(timeout)) is not None:
      if ev["event"] == name: return ev
      if ev["event"] == "WorkerFatal": raise AssertionError(f"expected {name}, got {ev}")
    raise AssertionError(f"the stage exited before {name}; seen {self.seen}; stderr {self.p.stderr.read()[-2000:]}")

  def fatal(self, timeout: float = 120.0) -> dict:
    """The WorkerFatal event, after which the process must exit on its own, non-zero."""
    while (ev := self.next_event(timeout)) is not None:
      if ev["event"] == "WorkerFatal":
        assert self.p.wait(timeout=10) != 0
        return ev
    raise AssertionError(f"the stage exited without WorkerFatal; seen {self.seen}")

  def setup(self, model: str, start: int, end: int, device: str = "CPU", **role) -> dict:
    self.send("InitializeWorker", device=device)
    self.expect("WorkerReady")
    self.send("ConfigureRole", stage=role.pop("stage", 0), start=start, end=end, **role)
    self.expect("RoleConfigured")
    self.send("LoadWeights", model=model)
    return self.expect("WeightsLoaded")

  def close(self) -> None:
    if self.p.poll() is None:
      self.p.kill()
    self.p.wait()
    for f in (self.p.stdin, self.p.stdout, self.p.stderr):
      try: f.close()
      except OSError: pass
