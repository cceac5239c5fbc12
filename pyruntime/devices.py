"""Which tinygrad device each stage runs on: one GPU per stage when there are GPUs, else the CPU.

A device string is `BASE[:INDEX][:RENDERER[:ARCH]]`: `CUDA`, `CUDA:1`, `CUDA:PTX`, `CUDA:1:PTX`, `NULL:2:CUDA:sm_90`,
`CPU:CLANGJIT:x86_64,x86-64-v3` (a CPU target names a cpu and features: commas, dashes and pluses in the ARCH only).
A numeric second field is the device's index; anything else there is a renderer (and what follows it an architecture).
tinygrad opens the device `BASE[:INDEX]`, and its `DEV` variable carries only `BASE[:RENDERER[:ARCH]]`: tinygrad reads
`DEV=CUDA:1` as CUDA with a renderer named `1` (docs/control-channel.md#devices).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
  base: str               # tinygrad's backend: CPU, CUDA, CL, NULL, ...
  index: int | None       # which device of that backend; None: its first
  renderer: str = ""      # a renderer of that backend by tinygrad's name (PTX, X86, CUDA on NULL, ...), "" its default
  arch: str = ""          # the renderer's target architecture (sm_90), "" the device's own

  @property
  def name(self) -> str:
    """The device as tinygrad opens it (`CUDA:1`; index 0 is tinygrad's `CUDA`)."""
    return self.base if not self.index else f"{self.base}:{self.index}"

  @property
  def target(self) -> str:
    """What `DEV` must say for this device's renderer to be chosen: never the index."""
    return ":".join(x for x in (self.base, self.renderer, self.arch) if x)

  def __str__(self) -> str:
    return ":".join(x for x in (self.base, "" if self.index is None else str(self.index), self.renderer, self.arch) if x)


_FIELD = re.compile(r"[A-Za-z0-9_.]+")
_ARCH = re.compile(r"[A-Za-z0-9_.,+-]+")  # a CPU's target names a cpu and features: x86_64,x86-64-v3 or arm64,apple-m1,-sve


def parse_device(spec: str) -> DeviceSpec:
  """The one reading of a device string (module docstring); `InvalidOption("device", ...)` naming what is wrong."""
  from pyruntime.errors import InvalidOption
  if not isinstance(spec, str): raise InvalidOption("device", f"a device is a string such as 'CUDA:1', not {spec!r}")
  fields = spec.strip().split(":")
  if not all(_FIELD.fullmatch(f) for f in fields[:-1]) or not _ARCH.fullmatch(fields[-1]) or not fields[0].isalpha() \
     or (not _FIELD.fullmatch(fields[-1]) and len(fields) - (fields[1].isdigit() if len(fields) > 1 else 0) != 3):
    raise InvalidOption("device", f"{spec!r} is not BASE[:INDEX][:RENDERER[:ARCH]] "
                                  "(e.g. CUDA, CUDA:1, CUDA:1:PTX, NULL:CUDA:sm_90, CPU:CLANGJIT:x86_64,x86-64-v3)")
  base, rest = fields[0].upper(), fields[1:]
  index = int(rest.pop(0)) if rest and rest[0].isdigit() else None
  if len(rest) > 2 or (rest and rest[0].isdigit()):
    raise InvalidOption("device", f"{spec!r}: after {base}{'' if index is None else f':{index}'} come at most a renderer and an architecture")
  return DeviceSpec(base, index, rest[0].upper() if rest else "", rest[1] if len(rest) > 1 else "")


def tinygrad_backends() -> set[str]:
  """The backends the installed tinygrad has (its `runtime/ops_*.py`), found without importing it; empty if unknown."""
  import importlib.util
  spec = importlib.util.find_spec("tinygrad")
  roots = spec.submodule_search_locations or [] if spec is not None else []
  return {os.path.basename(p)[4:-3].upper() for root in roots for p in glob.glob(os.path.join(root, "runtime", "ops_*.py"))}


def check_opens(device: str) -> None:
  """What can be known before any stage is spawned of whether `device` opens here, without loading tinygrad: a backend
  tinygrad has, a GPU present for CUDA/NV/AMD (its index among those visible), an OpenCL driver for CL, NVIDIA's
  compiler for CUDA kernels. `InvalidOption("device", ...)` naming what is missing (the launch plan's preflight)."""
  from pyruntime.errors import InvalidOption
  spec = parse_device(device)
  if (backends := tinygrad_backends()) and spec.base not in backends:
    raise InvalidOption("device", f"{device}: tinygrad has no backend {spec.base!r} (it has {', '.join(sorted(backends))})")
  if spec.base in ("CUDA", "NV"):
    if (n := gpu_count()) == 0: raise InvalidOption("device", f"{device}: no NVIDIA GPU is visible here (/dev/nvidia*, CUDA_VISIBLE_DEVICES)")
    if (spec.index or 0) >= n: raise InvalidOption("device", f"{device}: index {spec.index}, but {n} NVIDIA GPU(s) are visible")
  if spec.base in ("AMD", "HIP") and not os.path.exists("/dev/kfd"): raise InvalidOption("device", f"{device}: no AMD GPU here (/dev/kfd)")
  if spec.base == "CL" and not (os.environ.get("OCL_ICD_VENDORS") or glob.glob("/etc/OpenCL/vendors/*.icd")):
    raise InvalidOption("device", f"{device}: no OpenCL driver is installed (/etc/OpenCL/vendors; PoCL runs on the CPU: apt install pocl-opencl-icd)")
  if (spec.base == "CUDA" and spec.renderer in ("", "CUDA")) or (spec.base == "NULL" and spec.renderer == "CUDA"):
    if not nvrtc_available():
      raise InvalidOption("device", f"{device}: CUDA kernels need NVIDIA's NVRTC, which is not installed (pip install nvidia-cuda-nvrtc-cu12)")


def nvrtc_available() -> bool:
  """NVIDIA's runtime compiler can be loaded: named by NVRTC_PATH, in its PyPI wheel, or in a system folder."""
  import ctypes.util
  if os.environ.get("NVRTC_PATH"): return os.path.exists(os.environ["NVRTC_PATH"])
  saved = {k: os.environ.get(k) for k in ("NVRTC_PATH", "NVJITLINK_PATH")}
  found = "NVRTC_PATH" in nvidia_compilers()
  for k, v in saved.items():  # only a look: the stage points tinygrad at the wheels itself
    if v is None: os.environ.pop(k, None)
  return found or ctypes.util.find_library("nvrtc") is not None


def nvidia_compilers() -> dict[str, str]:
  """Point tinygrad at NVIDIA's compilers from their PyPI wheels (nvidia-cuda-nvrtc-cu12, nvidia-nvjitlink-cu12) when
  installed and not named already: tinygrad looks for the libraries only in system folders, or where NVRTC_PATH /
  NVJITLINK_PATH say. Needed where CUDA kernels are compiled without a CUDA toolkit installed (the NULL:CUDA compile
  lane). Returns what it set; must run before tinygrad first loads either library."""
  import importlib.util
  out: dict[str, str] = {}
  spec = importlib.util.find_spec("nvidia")
  for var, sub, lib in (("NVRTC_PATH", "cuda_nvrtc", "libnvrtc.so.12"), ("NVJITLINK_PATH", "nvjitlink", "libnvJitLink.so.12")):
    if os.environ.get(var) or spec is None: continue
    for root in spec.submodule_search_locations or []:
      if os.path.isfile(path := os.path.join(root, sub, "lib", lib)): out[var] = os.environ[var] = path; break
  return out


def gpu_count() -> int:
  """NVIDIA GPUs visible to this process (CUDA_VISIBLE_DEVICES respected), without importing a CUDA runtime."""
  if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
    return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def host_cpu() -> list[str]:
  """The lines of /proc/cpuinfo that say what this CPU is and can do (model name, feature flags), once each; [] where
  there is no such file."""
  try: text = open("/proc/cpuinfo").read()
  except OSError: return []
  return list(dict.fromkeys(ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))))


def cpu_device() -> str:
  # DEV=CPU compiles kernels with clang; CPU:X86 needs no compiler but runs slower.
  return "CPU" if shutil.which("clang") else "CPU:X86"


def default_devices(n_stages: int) -> list[str]:
  if (dev := os.environ.get("PYRUNTIME_DEVICE")):
    return [str(parse_device(d)) for d in _split(dev, n_stages)]
  if (gpus := gpu_count()) > 0:
    return [f"CUDA:{i % gpus}" for i in range(n_stages)]
  return [cpu_device()] * n_stages


def parse_devices(spec: str | list[str] | None, n_stages: int) -> list[str]:
  """`None`/"auto" → defaults; "CPU" → every stage; "CUDA:0,CUDA:1" → one per stage. Each checked (parse_device)."""
  if spec is None or spec == "auto": return default_devices(n_stages)
  return [str(parse_device(d)) for d in _split(spec, n_stages)]


def _split(spec: str | list[str], n_stages: int) -> list[str]:
  devs = [d.strip() for d in (_devices_in(spec) if isinstance(spec, str) else spec) if d.strip()]
  if len(devs) == 1: return devs * n_stages
  if len(devs) != n_stages:
    from pyruntime.errors import InvalidOption
    raise InvalidOption("device", f"{len(devs)} devices given for {n_stages} stages")
  return devs


def _devices_in(spec: str) -> list[str]:
  """A comma-separated list of devices: a comma also separates a CPU target's features (`CPU:CLANGJIT:x86_64,x86-64-v3`),
  so a piece that does not start with a backend's name (one of tinygrad's, or any all-letter word where tinygrad is not
  found) belongs to the device before it."""
  backends, out = tinygrad_backends(), []
  for piece in spec.split(","):
    head = piece.strip().split(":")[0]
    new = head.upper() in backends if backends else head.isalpha()
    if out and not new and out[-1].count(":") >= 2: out[-1] += "," + piece
    else: out.append(piece)
  return out


def available_memory() -> int:
  """Bytes of host memory available now (Linux's MemAvailable), else the physical memory."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"): return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError): pass
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
