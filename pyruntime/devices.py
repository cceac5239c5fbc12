"""Which tinygrad device each stage runs on: one GPU per stage when there are GPUs, else the CPU."""
from __future__ import annotations

import glob
import os
import shutil


def gpu_count() -> int:
  """NVIDIA GPUs visible to this process (CUDA_VISIBLE_DEVICES respected), without importing a CUDA runtime."""
  if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def cpu_device() -> str:
  # DEV=CPU compiles kernels with clang; CPU:X86 needs no compiler but runs slower.
  return "CPU" if shutil.which("clang") else "CPU:X86"


def default_devices(n_stages: int) -> list[str]:
  if (dev := os.environ.get("PYRUNTIME_DEVICE")):
    return [dev] * n_stages
  if (gpus := gpu_count()) > 0:
    return [f"CUDA:{i % gpus}" for i in range(n_stages)]
  return [cpu_device()] * n_stages


def parse_devices(spec: str | list[str] | None, n_stages: int) -> list[str]:
  """`None`/"auto" → defaults; "CPU" → every stage; "CUDA:0,CUDA:1" → one per stage."""
  if spec is None or spec == "auto": return default_devices(n_stages)
  devs = [d.strip() for d in (spec.split(",") if isinstance(spec, str) else spec) if d.strip()]
  if len(devs) == 1: return devs * n_stages
  if len(devs) != n_stages:
    from pyruntime.errors import InvalidOption
    raise InvalidOption("device", f"{len(devs)} devices given for {n_stages} stages")
  return devs


def available_memory() -> int:
  """Bytes of host memory available now (Linux's MemAvailable), else the physical memory."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"): return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError): pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
