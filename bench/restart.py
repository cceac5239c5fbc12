"""How long `pyruntime serve` is away after a stage dies: its start, a restart after a stage is killed while it serves,
and a restart after a stage of the restarting pipeline is killed during its warm-up, side by side in one run.

  python bench/restart.py [--model PATH] [--stages 2] [--warm-kill-after 1.0] [--json]

Each figure runs from the kill (or the command) to /health saying ok with the expected restart count. The server is
a `pyruntime serve` process of its own, as users run it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def health(port: int) -> dict | None:
  try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r: return json.loads(r.read())
  except Exception:  # noqa: BLE001 - not up (yet), or 503 while recovering
    return None


def stage_pids(pid: int) -> list[int]:
  out = []
  for p in os.listdir("/proc"):
    if not p.isdigit(): continue
    try:
      with open(f"/proc/{p}/stat") as f: ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{p}/cmdline", "rb") as f: cmd = f.read()
    except (OSError, ValueError, IndexError): continue
    if ppid == pid and b"pyruntime.stage" in cmd: out.append(int(p))
  return sorted(out)


def until_ok(port: int, restarts: int, t0: float, timeout: float = 900) -> float:
  while time.monotonic() - t0 < timeout:
    if (h := health(port)) is not None and h.get("status") == "ok" and h.get("restarts", 0) >= restarts: return time.monotonic() - t0
    time.sleep(0.1)
  raise TimeoutError(f"no ok health within {timeout} s")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M)")
  ap.add_argument("--stages", type=int, default=2)
  ap.add_argument("--warm-kill-after", type=float, default=1.0, help="seconds after the new stages appear to kill one")
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "pyruntime", "serve", "--port", str(port), "--stages", str(a.stages)] + (["--model", a.model] if a.model else [])
  t0 = time.monotonic()
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    res = {"start_s": round(until_ok(port, 0, t0), 2)}
    first = stage_pids(proc.pid)
    t0 = time.monotonic()
    os.kill(first[-1], signal.SIGKILL)
    res["restart_after_a_kill_s"] = round(until_ok(port, 1, t0), 2)
    serving = stage_pids(proc.pid)
    t0 = time.monotonic()
    os.kill(serving[-1], signal.SIGKILL)
    while len(new := [p for p in stage_pids(proc.pid) if p not in serving]) < a.stages: time.sleep(0.01)
    time.sleep(a.warm_kill_after)
    os.kill(new[-1], signal.SIGKILL)
    res["restart_after_a_kill_during_warm_up_s"] = round(until_ok(port, 2, t0), 2)
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
  print(json.dumps(res) if a.json else "\n".join(f"{k}: {v}" for k, v in res.items()))


if __name__ == "__main__":
  main()
