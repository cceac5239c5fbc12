"""A request's generation parameters, defined once: name, type, bounds, default and help text of every field.

The CLI builds its options from these definitions, the OpenAI parser checks request fields with them, the launcher
validates a `generate` call with them and the stage rebuilds the `SamplingParams` of an OPEN record with them, so
the four cannot drift apart. The bounds are OpenAI's where it has the field (temperature [0, 2], top_p (0, 1],
penalties [-2, 2]); the rest follow llama.cpp's meaning. No tinygrad, no numpy: the launcher and the server import it.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from pyruntime import errors

INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Param:
  name: str
  kind: type                 # int or float (an int is accepted where a float is asked for, a bool never)
  default: Any
  help: str                  # what the CLI shows; says what the neutral value means
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False      # lo itself is refused
  nullable: bool = False     # None is a value of its own (the help says which)

  @property
  def flag(self) -> str: return "--" + self.name.replace("_", "-")

  def check(self, v: Any) -> Any:
    """v if it is valid, else InvalidOption naming the field; the same words wherever the value came from."""
    if v is None and self.nullable: return v
    if self.kind is int:
      if isinstance(v, bool) or not isinstance(v, numbers.Integral): raise errors.InvalidOption(self.name, f"must be an integer, got {show(v)}")
    elif not _finite(v): raise errors.InvalidOption(self.name, f"must be a finite number, got {show(v)}")
    hi = self.hi if self.hi is not None or self.kind is not int else INT64_MAX  # no 300-digit integers downstream
    if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
      raise errors.InvalidOption(self.name, f"must be {'greater than' if self.lo_open else 'at least'} {self.lo}, got {show(v)}")
    if hi is not None and v > hi: raise errors.InvalidOption(self.name, f"must be at most {hi}, got {show(v)}")
    return v


def show(v: Any, limit: int = 80) -> str:
  """repr(v) cut to `limit` characters (a client's value quoted back in an error message)."""
  try: r = repr(v)
  except (ValueError, RecursionError): r = f"<{type(v).__name__} too large to print>"   # huge int, deep nesting
  return r if len(r) <= limit else r[:limit - 3] + "..."


def _finite(v: Any) -> bool:
  if isinstance(v, bool) or not isinstance(v, numbers.Real): return False
  try: return math.isfinite(v)
  except OverflowError: return False   # an int too large for a float


def _param(kind: type, default: Any, help: str, **bounds: Any) -> Any:
  """A SamplingParams field: its default, and the rest of its definition as metadata (see SAMPLING)."""
  return field(default=default, metadata={"kind": kind, "help": help, **bounds})


@dataclass
class SamplingParams:
  """The sampler's parameters (docs/serving.md#sampling); also the `sampling` object of an OPEN record."""
  temperature: float = _param(float, 0.0, "0: greedy", lo=0.0, hi=2.0)
  top_k: int = _param(int, 0, "keep the k most likely tokens; 0: off", lo=0)
  top_p: float = _param(float, 1.0, "nucleus sampling; 1: off", lo=0.0, hi=1.0, lo_open=True)
  min_p: float = _param(float, 0.0, "keep tokens with p >= min_p * p_max; 0: off", lo=0.0, hi=1.0)
  seed: int | None = _param(int, None, "sampling seed (default: random)", lo=0, hi=2**64 - 1, nullable=True)
  repetition_penalty: float = _param(float, 1.0, "1: off", lo=0.0, lo_open=True)
  frequency_penalty: float = _param(float, 0.0, "0: off", lo=-2.0, hi=2.0)
  presence_penalty: float = _param(float, 0.0, "0: off", lo=-2.0, hi=2.0)
  penalty_last_n: int | None = _param(int, None, "tokens the penalties look back over; 0: none, -1: all (default: all)", lo=-1,
                                      nullable=True)

  def validate(self) -> SamplingParams:
    for p in SAMPLING.values(): p.check(getattr(self, p.name))
    return self

  @property
  def greedy(self) -> bool: return self.temperature == 0
  @property
  def has_penalties(self) -> bool:
    return self.penalty_last_n != 0 and (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

  def to_dict(self) -> dict: return asdict(self)
  @classmethod
  def from_dict(cls, d: Mapping[str, Any] | None, unknown: type[errors.PyruntimeError] = errors.InvalidOption) -> SamplingParams:
    """Validated params from options by name; an unknown name raises `unknown` (InvalidOption in an OPEN record,
    UnsupportedFeature from a caller of the launcher: a feature pyruntime does not have)."""
    d = dict(d or {})
    if extra := sorted(set(d) - set(SAMPLING)): raise unknown(extra[0], f"unknown sampling option (known: {sorted(SAMPLING)})")
    return cls(**d).validate()


SAMPLING: dict[str, Param] = {f.name: Param(f.name, default=f.default, **f.metadata) for f in fields(SamplingParams)}
MAX_CHOICES = 128  # the most streams one request may start: n times its prompts (OpenAI's own limit for n)
MAX_TOKENS = Param("max_tokens", int, 256, "most tokens to generate", lo=1, nullable=True)  # None: up to the context


def choice_seed(seed: int | None, index: int) -> int | None:
  """The seed of choice `index` of a request that asks for several (OpenAI's `n`): choice 0 keeps the request's seed, so
  n=1 is unchanged, and every choice is reproducible whatever n. None (a random seed) stays random."""
  if seed is None or index == 0: return seed
  return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little")


def check_request(max_tokens: int | None, sampling: Mapping[str, Any], stop: str | Sequence[str] | None = None) -> SamplingParams:
  """A generation's options, as `Launcher.submit` takes them: InvalidOption naming the first bad one."""
  MAX_TOKENS.check(max_tokens)
  validate_stop(stop)
  return SamplingParams.from_dict(sampling, unknown=errors.UnsupportedFeature)


# OpenAI allows 4 stop strings; llama.cpp and vLLM have no limit. We allow more than OpenAI so
# clients that send a few extra (chat UIs, agents) work, but keep a bound on the per-token cost.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000


def validate_stop(stop: str | Sequence[str] | None) -> list[str]:
  """The stop strings of a request as a list; raises InvalidOption('stop') when malformed."""
  if stop is None: return []
  if isinstance(stop, str): stop = [stop]
  if not isinstance(stop, (list, tuple)):
    raise errors.InvalidOption("stop", f"must be a string or a list of strings, not {type(stop).__name__}")
  if len(stop) > MAX_STOP_STRINGS: raise errors.InvalidOption("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
  for i, s in enumerate(stop):
    if not isinstance(s, str): raise errors.InvalidOption("stop", f"stop[{i}] must be a string, not {type(s).__name__}")
    if not s: raise errors.InvalidOption("stop", f"stop[{i}] is empty")
    if len(s) > MAX_STOP_LENGTH: raise errors.InvalidOption("stop", f"stop[{i}] is longer than {MAX_STOP_LENGTH} characters")
  return list(stop)
