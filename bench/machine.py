"""The machine a benchmark ran on, in one line: the CPU model and the vector flags that matter here (machines differ:
AVX-512/AMX Xeons, AVX2-only EPYCs), so figures are read beside the hardware that made them."""
from __future__ import annotations

import os
import platform


def cpu() -> str:
  info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
  name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), platform.processor() or "?")
  flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
  vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "f16c") if f in flags]
  return f"{name}, {os.cpu_count()} cores, " + (" ".join(vector) or "no AVX2")
