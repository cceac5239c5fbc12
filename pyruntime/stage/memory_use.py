"""Where a stage process's memory goes (the `memory` of its QueryStats: /stats, `inspect --server`, bench/decode.py).

Resident bytes of the process, by kind. On a CPU the device's buffers live in this process and tinygrad maps them
lazily, so a buffer's resident share is the pages something wrote (asked of the kernel with mincore); on an accelerator
they are device memory, all of it committed, and the process's resident memory is the host side only.

- rss, rss_file: the process's resident bytes (/proc/self/status), and of them the file-backed ones (the GGUF's pages a
  head's embedding rows were gathered from, the libraries' code);
- weights: the stage's parameters as held (StageModel.resident_bytes);
- kv_reserved, kv_resident: the KV caches' (and recurrent states') bytes, and how many of them are resident;
- other_buffers: tinygrad's other live buffers (staging, the captured graphs' intermediates);
- allocator_cache: freed buffers tinygrad's allocator keeps for reuse;
- prefix_cache: the prefix cache's host pool;
- rest: what none of these explain (the interpreter, tinygrad and numpy, compiled kernels, the mmap'd file).
"""
from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE


def process_rss() -> tuple[int, int]:
  """(resident bytes, of them file-backed) of this process; (0, 0) where /proc is not there. (tinygrad's CPU buffers are
  shared anonymous memory: RssShmem, neither anonymous nor file-backed in the kernel's count.)"""
  try:
    with open("/proc/self/status") as f: fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.strip().endswith("kB")}
  except OSError: return 0, 0
  return fields.get("VmRSS", 0), fields.get("RssFile", 0)


_libc: Any = None


def resident(addr: int, size: int) -> int:
  """Bytes of [addr, addr + size) in resident pages (mincore); `size` where that cannot be asked."""
  global _libc
  if size <= 0: return 0
  if _libc is None: _libc = ctypes.CDLL(None, use_errno=True)
  start = addr - addr % PAGE
  pages = -(-(addr + size - start) // PAGE)
  vec = (ctypes.c_ubyte * pages)()
  if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0: return size
  return min(size, int((np.frombuffer(vec, np.uint8) & 1).sum()) * PAGE)


def buffer_resident(t: Any) -> int:
  """Resident bytes of a realized tinygrad tensor's buffer: its touched pages on a CPU, all of it elsewhere."""
  buf = t.uop.buffer
  if not buf.is_allocated(): return 0
  addr = getattr(getattr(buf, "_buf", None), "va_addr", None)
  return resident(int(addr), buf.nbytes) if buf.device.startswith("CPU") and addr is not None else buf.nbytes


def breakdown(model: Any, prefix_cache_bytes: int = 0) -> dict[str, int]:
  """The stage's resident memory by kind (the module's docstring), in bytes."""
  from tinygrad import Device
  from tinygrad.helpers import GlobalCounters
  rss, rss_file = process_rss()
  out = {"rss": rss, "rss_file": rss_file, "prefix_cache": prefix_cache_bytes}
  if model is None: return out | {"rest": rss - prefix_cache_bytes}
  states = model.state_tensors()
  reserved = sum(t.nbytes() for t in states)
  live = GlobalCounters.mem_used_per_device.get(model.device, 0)
  cache = sum(size * len(kept) for (size, _), kept in getattr(Device[model.device].allocator, "cache", {}).items())
  out |= {"weights": model.resident_bytes, "kv_reserved": reserved, "kv_resident": sum(buffer_resident(t) for t in states),
          "other_buffers": max(0, live - model.resident_bytes - reserved), "allocator_cache": cache}
  in_process = model.device.startswith("CPU")  # elsewhere the device's buffers are not this process's resident memory
  held = out["weights"] + out["kv_resident"] + out["other_buffers"] + cache if in_process else 0
  return out | {"rest": max(0, rss - held - prefix_cache_bytes)}



def describe(m: dict) -> str:
  """A breakdown as one line, in MB (bench/decode.py, `pyruntime inspect --server`)."""
  mb = lambda k: f"{m.get(k, 0) / 1e6:.0f}"  # noqa: E731
  return (f"rss {mb('rss')} MB: weights {mb('weights')}, kv {mb('kv_resident')} of {mb('kv_reserved')} reserved, other buffers "
          f"{mb('other_buffers')}, allocator cache {mb('allocator_cache')}, prefix cache {mb('prefix_cache')}, rest {mb('rest')} "
          f"(file-backed {mb('rss_file')})")
