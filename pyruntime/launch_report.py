"""What a captured graph launches, read from tinygrad's captured schedule: each kernel's name, grid and block sizes
(threads launched), and the compiled program (source and binary). bench/kernels.py reports it per decode step; the
compile lane (tests/test_device_lanes.py) checks that every graph became sm_90 code."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tinygrad import TinyJit
from tinygrad.helpers import prod
from tinygrad.uop.ops import Ops

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Launch:
  name: str
  device: str
  global_size: tuple[int, ...]
  local_size: tuple[int, ...]
  source: str
  binary: bytes

  @property
  def threads(self) -> int: return prod(self.global_size) * prod(self.local_size)

  @property
  def cuda_sm(self) -> int | None:
    """The SM architecture a CUDA ELF binary (cubin) was compiled for (its e_flags' low byte), else None."""
    return self.binary[48] if self.binary[:4] == b"\x7fELF" and len(self.binary) > 52 else None


def launches(jit: TinyJit) -> list[Launch]:
  """Every kernel of a captured graph, in launch order (copies and graph calls are not kernels)."""
  if jit.captured is None: raise ValueError("the graph is not captured yet")
  out = []
  for u in jit.captured.linear.toposort():
    if u.op is not Ops.PROGRAM: continue
    src = {s.op: s.arg for s in u.src}
    info, size = u.arg, lambda xs: tuple(x if isinstance(x, int) else -1 for x in xs or ())  # -1: symbolic
    out.append(Launch(_ANSI.sub("", info.name), str(src.get(Ops.DEVICE, "")), size(info.global_size), size(info.local_size),
                      src.get(Ops.SOURCE, ""), src.get(Ops.BINARY, b"")))
  return out
