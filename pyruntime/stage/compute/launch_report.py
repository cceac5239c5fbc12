"""What a captured graph launches, read from tinygrad's captured schedule: each kernel's name, grid and block sizes
(threads launched), and the compiled program (source and binary). bench/kernels.py reports it per decode step; the
compile lane (tests/integration/test_device_lanes.py) checks that every graph became sm_90 code."""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from tinygrad import TinyJit
from tinygrad.helpers import prod
from tinygrad.uop.ops import Ops, UOp

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Launch:
  name: str
  device: str
  global_size: tuple[int, ...]
  local_size: tuple[int, ...]
  source: str
  binary: bytes
  outputs: int = 0  # elements of the buffer it writes (its first output)
  reads: frozenset[UOp] = frozenset()  # the buffers it reads (a view's base), the graph's inputs not among them

  @property
  def threads(self) -> int | None:
    """Threads launched (grid × block), None where a size depends on the step (a symbolic context length)."""
    return None if -1 in self.global_size + self.local_size else prod(self.global_size) * prod(self.local_size)

  @property
  def cuda_sm(self) -> int | None:
    """The SM architecture a CUDA ELF binary (cubin) was compiled for (its e_flags' low byte), else None."""
    return self.binary[48] if self.binary[:4] == b"\x7fELF" and len(self.binary) > 52 else None


def launches(jit: TinyJit) -> list[Launch]:
  """Every kernel launch of one replay of a captured graph, in order: a traced block's function called for each of the
  stage's blocks counts its kernels once a call (copies are not kernels)."""
  if jit.captured is None: raise ValueError("the graph is not captured yet")
  return list(_walk(jit.captured.linear))


def projections(ls: list[Launch], weights: set[UOp]) -> list[Launch]:
  """The launches that read one of `weights` (StageModel.projection_buffers: a projection's kernels)."""
  return [k for k in ls if k.reads & weights]


def _walk(linear: UOp) -> Iterator[Launch]:
  for call in linear.src:
    if call.op is not Ops.CALL or not call.src: continue
    head = call.src[0]
    if head.op is Ops.PROGRAM: yield _launch(call)
    elif head.op is Ops.CUSTOM_FUNCTION: yield from (k for body in head.src if body.op is Ops.LINEAR for k in _walk(body))


def _elements(u: UOp | None) -> int:
  if u is None or u.op not in (Ops.BUFFER, Ops.BUFFER_VIEW) or not u.shape: return 0
  return u.shape[0] if isinstance(u.shape[0], int) else 0


def _launch(call: UOp) -> Launch:
  from tinygrad.engine.realize import get_call_arg_uops, get_call_outs_ins

  from pyruntime.stage.compute.graph_cache import base_buffer
  prog = call.src[0]
  src, info = {s.op: s.arg for s in prog.src}, prog.arg
  size = lambda xs: tuple(x if isinstance(x, int) else -1 for x in xs or ())  # noqa: E731 -- -1: a symbolic size
  args, (outs, ins) = get_call_arg_uops(call), get_call_outs_ins(call)
  out = args[outs[0]] if outs and outs[0] < len(args) else None
  return Launch(_ANSI.sub("", info.name), str(src.get(Ops.DEVICE, "")), size(info.global_size), size(info.local_size),
                src.get(Ops.SOURCE, ""), src.get(Ops.BINARY, b""), _elements(out),
                frozenset(b for i in ins if i < len(args) and (b := base_buffer(args[i])).op is Ops.BUFFER))
