"""The boundary schema: what crosses a cut between two pipeline stages (docs/stage-ownership.md#boundary-schemas).

A model of L blocks is cut into contiguous ranges. The cut in front of block `point` carries, per token:
- point 0 (head ingress): the token ids, `token_ids` u32;
- 0 < point < L (between stages): the raw residual stream, `hidden_states` (dim values, float32 by default so a
  split run is bit-identical to the unsplit one, or float16 to halve the bytes);
- point L (tail egress): the sampled token id, `token_id` u32 (or the last position's logits when asked for).

Dense architectures carry exactly `hidden_states`; mixture-of-experts boundaries also require `router_logits` (float32,
one per expert: the last MoE block before the cut), MLA boundaries `mla_position_state` (uint32: the position each row
stands for). A record holds its tokens' tensors one after the other: all hidden_states rows, then all router_logits
rows, then the positions.
A stage refuses a boundary of another architecture (`BoundaryArchitectureMismatch`) or of another schema
(`BoundarySchemaMismatch`: another point, other tensors, another dtype or width).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyruntime import errors

DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "uint32": np.dtype("<u4")}
MOE_ARCHS = frozenset({"qwen3moe", "qwen2moe", "qwen35moe", "mixtral", "deepseek2", "glm4moe", "gpt-oss", "llama4",
                       "olmoe", "granitemoe", "dbrx", "arctic", "grok", "phimoe"})
MLA_ARCHS = frozenset({"deepseek2", "kimi-k2", "glm4moe-mla"})

TOKEN_IDS, HIDDEN, TOKEN_ID = "token_ids", "hidden_states", "token_id"
ROUTER, MLA_POS = "router_logits", "mla_position_state"


def residual_tensors(arch: str) -> tuple[str, ...]:
  """The tensors a between-stages boundary of `arch` must carry, in order."""
  return (HIDDEN,) + ((ROUTER,) if arch in MOE_ARCHS else ()) + ((MLA_POS,) if arch in MLA_ARCHS else ())


@dataclass(frozen=True)
class Boundary:
  """One cut: the architecture, the block index in front of which it sits, and the per-token tensors it carries."""
  arch: str
  point: int
  tensors: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (dtype name, values per token)

  def __post_init__(self):
    if not self.tensors: raise errors.BoundarySchemaMismatch("a boundary carries at least one tensor")
    for name, spec in self.tensors.items():
      if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] in DTYPES and isinstance(spec[1], int) and spec[1] > 0):
        raise errors.BoundarySchemaMismatch(f"tensor {name!r}: expected (dtype in {sorted(DTYPES)}, width > 0), got {spec!r}")
      object.__setattr__(self, "tensors", {k: (v[0], int(v[1])) for k, v in self.tensors.items()})

  # --- constructors ---------------------------------------------------------------------------
  @classmethod
  def token_ids(cls, arch: str) -> Boundary: return cls(arch, 0, {TOKEN_IDS: ("uint32", 1)})
  @classmethod
  def hidden(cls, arch: str, point: int, dim: int, dtype: str = "float32") -> Boundary:
    if dtype not in ("float32", "float16"): raise errors.BoundarySchemaMismatch(f"hidden_states dtype must be float32 or float16, not {dtype!r}")
    return cls(arch, point, {HIDDEN: (dtype, dim)})
  @classmethod
  def residual(cls, arch: str, point: int, dim: int, dtype: str = "float32", experts: int = 0) -> Boundary:
    """The between-stages boundary of `arch`'s family: hidden_states, plus for MoE the router logits (float32, one per
    expert) of the last MoE block before the cut, plus for MLA the position (uint32) each residual row stands for."""
    b = cls.hidden(arch, point, dim, dtype)
    extra = {ROUTER: ("float32", experts), MLA_POS: ("uint32", 1)}
    return cls(arch, point, {k: b.tensors.get(k) or extra[k] for k in residual_tensors(arch)})
  @classmethod
  def sampled(cls, arch: str, num_blocks: int) -> Boundary: return cls(arch, num_blocks, {TOKEN_ID: ("uint32", 1)})

  @property
  def kind(self) -> str:
    names = set(self.tensors)
    if names == {TOKEN_IDS}: return "token_ids"
    if names == {TOKEN_ID}: return "result"  # logits asked for by a stream travel in its records, under this schema
    return "residual"
  @property
  def token_bytes(self) -> int: return sum(DTYPES[dt].itemsize * w for dt, w in self.tensors.values())

  def validate(self) -> Boundary:
    """The rules (docs/stage-ownership.md) for the boundary's own architecture: a residual boundary carries exactly what it must."""
    if self.kind == "residual" and tuple(self.tensors) != residual_tensors(self.arch):
      raise errors.BoundarySchemaMismatch(f"a {self.arch} residual boundary carries exactly {list(residual_tensors(self.arch))}, "
                                          f"got {list(self.tensors)}")
    if self.kind == "token_ids" and self.point != 0:
      raise errors.BoundarySchemaMismatch(f"token ids enter only at block 0 (the head), not at block {self.point}")
    return self

  def check(self, other: Boundary | dict) -> None:
    """Accept `other` (what the upstream sends) only if it is this very boundary; raise the named mismatch otherwise."""
    other = other if isinstance(other, Boundary) else Boundary.from_dict(other)
    if other.arch != self.arch:
      raise errors.BoundaryArchitectureMismatch(f"boundary of architecture {other.arch!r} offered to a {self.arch!r} stage")
    if other.point != self.point:
      raise errors.BoundarySchemaMismatch(f"boundary at block {other.point} offered to a stage whose input is block {self.point}")
    if other.tensors != self.tensors:
      raise errors.BoundarySchemaMismatch(f"boundary carries {other.tensors}, this stage expects {self.tensors}")

  # --- payloads -------------------------------------------------------------------------------
  def tokens_in(self, nbytes: int) -> int:
    """How many tokens a payload of `nbytes` holds; the named error when it is not a whole number of tokens."""
    if self.kind == "token_ids" or self.kind == "result":
      if nbytes % 4: raise errors.PayloadNotU32Aligned(f"payload of {nbytes} bytes is not a whole number of u32 token ids")
      if nbytes == 0: raise errors.ActivationExtentInvalid("empty payload: no token ids")
      return nbytes // 4
    if nbytes == 0 or nbytes % self.token_bytes:
      raise errors.ActivationExtentInvalid(f"payload of {nbytes} bytes is not a whole number of tokens of {self.token_bytes} bytes "
                                           f"({', '.join(f'{k} {w} x {dt}' for k, (dt, w) in self.tensors.items())})")
    return nbytes // self.token_bytes

  def ingress_array(self, payload: Any) -> np.ndarray:
    """A zero-copy numpy view of a payload: (T,) uint32 token ids, or (T, dim) hidden states."""
    return next(iter(self.ingress_arrays(payload).values()))

  def ingress_arrays(self, payload: Any) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of each tensor of a payload: (T,) for token ids, (T, width) for the rest."""
    mv = memoryview(payload).cast("B")
    n, off, out = self.tokens_in(mv.nbytes), 0, {}
    for name, (dt, w) in self.tensors.items():
      arr = np.frombuffer(mv, dtype=DTYPES[dt], count=n * w, offset=off)
      out[name] = arr if self.kind == "token_ids" else arr.reshape(n, w)
      off += n * w * DTYPES[dt].itemsize
    return out

  # --- wire form ------------------------------------------------------------------------------
  def to_dict(self) -> dict:
    return {"arch": self.arch, "point": self.point, "tensors": {k: [dt, w] for k, (dt, w) in self.tensors.items()}}
  @classmethod
  def from_dict(cls, d: dict) -> Boundary:
    try: return cls(str(d["arch"]), int(d["point"]), {str(k): (v[0], v[1]) for k, v in dict(d["tensors"]).items()})
    except (KeyError, TypeError, ValueError, IndexError) as e:
      raise errors.BoundarySchemaMismatch(f"not a boundary description: {d!r} ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class StageBoundary:
  """A stage's two cuts: what it accepts (`ingress`, at its first block) and what it emits (`egress`, after its last)."""
  ingress: Boundary
  egress: Boundary

  @property
  def arch(self) -> str: return self.ingress.arch
  @property
  def point(self) -> int: return self.ingress.point
  @property
  def tensors(self) -> dict[str, tuple[str, int]]: return self.ingress.tensors

  def check_ingress(self, upstream: StageBoundary | Boundary | dict) -> None:
    """Refuse an upstream whose output is not what this stage takes. `upstream` is the previous stage's StageBoundary
    (its egress is compared), a Boundary, or either's `to_dict()`."""
    if isinstance(upstream, StageBoundary): upstream = upstream.egress
    elif isinstance(upstream, dict) and "egress" in upstream: upstream = upstream["egress"]
    self.ingress.check(upstream)

  def ingress_array(self, payload: Any) -> np.ndarray: return self.ingress.ingress_array(payload)

  def to_dict(self) -> dict:
    return {"arch": self.arch, "ingress": self.ingress.to_dict(), "egress": self.egress.to_dict()}
  @classmethod
  def from_dict(cls, d: dict) -> StageBoundary:
    try: return cls(Boundary.from_dict(d["ingress"]), Boundary.from_dict(d["egress"]))
    except (KeyError, TypeError) as e: raise errors.BoundarySchemaMismatch(f"not a stage boundary description: {d!r}") from e

  @classmethod
  def for_range(cls, arch: str, start: int, end: int, num_blocks: int, dim: int, dtype: str = "float32", experts: int = 0) -> StageBoundary:
    ingress = Boundary.token_ids(arch) if start == 0 else Boundary.residual(arch, start, dim, dtype, experts)
    egress = Boundary.sampled(arch, num_blocks) if end == num_blocks else Boundary.residual(arch, end, dim, dtype, experts)
    return cls(ingress.validate(), egress.validate())
