"""Tail sampling, on the device that holds the logits, one token id out.

Order (docs/serving.md#sampling): penalties -> temperature -> top_k -> top_p -> min_p -> draw.
- temperature == 0: greedy; penalised greedy applies the penalties before the argmax.
- penalties follow llama.cpp over the last `penalty_last_n` tokens of the history (None or -1: the whole history,
  0: none): repetition divides a positive logit by the penalty and multiplies a non-positive one; then
  logit -= count * frequency_penalty + (count > 0) * presence_penalty.
- top_k keeps the k largest logits (ties at the k-th value are all kept), top_p the smallest set of most likely tokens
  whose probability reaches p (ties at the cut kept), min_p the tokens with p >= min_p * p_max.
- the draw is an inverse-CDF pick from a uniform number of the Sampler's own numpy Generator (seeded: same seed, same
  inputs -> same tokens, whatever other streams do); the pick itself runs on the device.

No sort of the vocabulary is needed: the top-k and top-p cut-offs are found by a 32-step bisection over the float
bit patterns (exact), the CDF pick by a bisection over token indices; each step is a reduce over the vocabulary
and all steps are the same kernels.
The graphs are TinyJit'ed and shared by every Sampler of the same device, vocabulary and feature set.
"""
from __future__ import annotations

import math
import threading

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from pyruntime import errors
from pyruntime.params import SamplingParams

# params vector layout (float32)
_TEMP, _REP, _FREQ, _PRES, _TOPP, _MINP, _U, _TOPK = range(8)
_NPARAMS = 8


# --- device graphs ------------------------------------------------------------------------------
def _order_key(x: Tensor) -> Tensor:
  """float32 -> uint32 with the same order (a monotone map of the bit patterns); NaN not expected."""
  bits = x.bitcast(dtypes.uint32)
  return (bits >= 0x80000000).where(bits.bitwise_xor(0xFFFFFFFF), bits.bitwise_or(0x80000000))


def _largest_threshold(key: Tensor, ok) -> Tensor:
  """The largest t in [0, 2**32) with ok(key >= t) (ok must be monotone and true at t = 0). A plain bisection on int64
  bounds, so all 32 steps are the same kernels (compiled once)."""
  key = key.cast(dtypes.int64)
  lo = Tensor.zeros(1, dtype=dtypes.int64, device=key.device).contiguous()
  hi = Tensor.full((1,), 2**32, dtype=dtypes.int64, device=key.device).contiguous()
  for _ in range(32):
    mid = (lo + hi) // 2
    c = ok(key >= mid)
    lo, hi = c.where(mid, lo).contiguous(), c.where(hi, mid).contiguous()
  return lo


def _penalize(lg: Tensor, counts: Tensor | None, params: Tensor) -> Tensor:
  """llama.cpp's penalties: repetition on seen tokens (divide positive logits, multiply the others), then
  logit -= count * frequency + (count > 0) * presence."""
  if counts is None: return lg
  seen = counts > 0
  rep = params[_REP]
  lg = seen.where((lg <= 0).where(lg * rep, lg / rep), lg)
  return lg - (counts * params[_FREQ] + seen.where(1.0, 0.0) * params[_PRES])


def _sample_graph(logits: Tensor, counts: Tensor | None, params: Tensor, greedy: bool, topk: bool, topp: bool, minp: bool,
                  mask: Tensor | None = None) -> Tensor:
  V = logits.shape[0]
  lg = _penalize(logits.float(), counts, params)
  if mask is not None: lg = lg + mask  # a grammar's: 0 where a token is allowed, -inf where not
  if greedy: return lg.argmax().reshape(1).cast(dtypes.int32)
  lg = lg / params[_TEMP]
  keep = Tensor.ones(V, dtype=dtypes.bool, device=lg.device)
  if topk:
    key = _order_key(lg)
    k = params[_TOPK]
    t = _largest_threshold(key, lambda m: m.cast(dtypes.float32).sum() >= k)
    keep = keep & (key >= t)
  lg = keep.where(lg, -math.inf)
  e = (lg - lg.max()).exp()  # unnormalised probabilities of the kept tokens, max 1
  if topp:
    key = _order_key(lg)
    target = params[_TOPP] * e.sum()
    t = _largest_threshold(key, lambda m: m.where(e, 0.0).sum() >= target)
    e = (key >= t).where(e, 0.0)
  if minp: e = (e >= params[_MINP]).where(e, 0.0)  # p / p_max >= min_p
  # inverse CDF: the token i with S(i) < x <= S(i+1), S(j) = sum of e over tokens < j, by bisection over indices
  idx = Tensor.arange(V, device=lg.device)
  total = e.sum()
  x = (params[_U] * total).maximum(1e-30)  # total >= 1 (the max token has e = 1); u = 0 must not pick a masked token
  lo = Tensor.zeros(1, dtype=dtypes.int32, device=lg.device).contiguous()
  hi = Tensor.full((1,), V + 1, dtype=dtypes.int32, device=lg.device).contiguous()
  for _ in range(V.bit_length()):  # the largest j in [0, V] with S(j) < x (S(0) = 0 < x)
    mid = (lo + hi) // 2
    c = (idx < mid).where(e, 0.0).sum() < x
    lo, hi = c.where(mid, lo).contiguous(), c.where(hi, mid).contiguous()
  i = lo
  i = i.minimum(V - 1)
  # rounding guard: the pick must be a kept token (the sums above and `total` are separate reductions)
  return ((idx == i).where(e, 0.0).sum() > 0).where(i, e.argmax()).cast(dtypes.int32)


_jits: dict[tuple, TinyJit] = {}
_jits_lock = threading.Lock()


def _jit_for(key: tuple) -> TinyJit:
  with _jits_lock:
    if (j := _jits.get(key)) is None:
      _, _, greedy, pen, topk, topp, minp, masked = key

      def fn(logits: Tensor, *inputs: Tensor) -> Tensor:  # (counts if pen) (mask if masked) params
        counts, mask = inputs[0] if pen else None, inputs[int(pen)] if masked else None
        return _sample_graph(logits, counts, inputs[-1], greedy, topk, topp, minp, mask).contiguous()
      j = _jits[key] = TinyJit(fn)
      j.cnt = 1  # nothing lazy to realize once: capture on the first call
    return j


class Sampler:
  """One stream's sampler: its parameters, its own random generator, its device buffers."""

  def __init__(self, params: SamplingParams | None = None, vocab_size: int = 0, device: str | None = None):
    self.params = (params or SamplingParams()).validate()
    if not isinstance(vocab_size, int) or vocab_size < 1: raise errors.InvalidOption("vocab_size", f"must be positive, got {vocab_size!r}")
    self.vocab_size, self.device = vocab_size, device
    p = self.params
    self.rng = np.random.default_rng(p.seed)
    self.topk = not p.greedy and 0 < p.top_k < vocab_size
    self.topp = not p.greedy and p.top_p < 1.0
    self.minp = not p.greedy and p.min_p > 0.0
    self._params = Tensor.empty(_NPARAMS, dtype=dtypes.float32, device=device)
    self._params.uop.buffer.ensure_allocated()
    self._hostp = np.array([p.temperature, p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.top_p, p.min_p, 0.0,
                            p.top_k], dtype=np.float32)
    self._counts = None
    self._mask: Tensor | None = None  # a constrained stream's allowed tokens (sample(mask=...)), made on first use
    if p.has_penalties:
      self._counts = Tensor.empty(vocab_size, dtype=dtypes.float32, device=device)
      self._counts.uop.buffer.ensure_allocated()

  def skip(self, n: int) -> None:
    """Make the draws of n samples already taken (a resumed stream's): the next sample draws what it would have."""
    if not self.params.greedy: self.rng.random(n, dtype=np.float32)  # the same numbers as n draws of one

  def counts(self, history: list[int]) -> np.ndarray:
    """Occurrences of each token id in the penalty window of `history`."""
    n = self.params.penalty_last_n
    window = history if n is None or n < 0 else (history[-n:] if n > 0 else [])
    ids = np.asarray(window, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < self.vocab_size)]
    return np.bincount(ids, minlength=self.vocab_size).astype(np.float32)

  def adjusted_logits(self, logits: Tensor, history: list[int] | None = None) -> Tensor:
    """The logits after the penalties and the temperature (on the device, not JIT'ed): for inspection and tests."""
    counts = Tensor(self.counts(list(history or [])), device=logits.device) if self.params.has_penalties else None
    params = Tensor(self._hostp, device=logits.device)
    lg = _penalize(logits.reshape(self.vocab_size).float(), counts, params)
    return lg if self.params.greedy else lg / params[_TEMP]

  def sample(self, logits: Tensor, history: list[int] | None = None, mask: np.ndarray | None = None) -> int:
    """Pick the next token from `logits` ((vocab,) or (1, vocab), any float dtype, on the device). `mask` (vocab,
    float32: 0 where a token is allowed, -inf where not; pyruntime/text/grammar.py) is added to them first."""
    if logits.shape[-1] != self.vocab_size or logits.numel() != self.vocab_size:
      raise errors.InvalidOption("logits", f"expected {self.vocab_size} logits, got shape {logits.shape}")
    logits = logits.reshape(self.vocab_size)
    if logits.dtype != dtypes.float32: logits = logits.float()
    if not logits.uop.is_realized: logits = logits.contiguous().realize()
    if logits.device != self._params.device: logits = logits.to(self._params.device).realize()
    if mask is not None:
      if self._mask is None:
        self._mask = Tensor.empty(self.vocab_size, dtype=dtypes.float32, device=self._params.device)
        self._mask.uop.buffer.ensure_allocated()
      self._mask.uop.buffer.copyin(memoryview(np.ascontiguousarray(mask, np.float32)).cast("B"))
    if not self.params.greedy: self._hostp[_U] = self.rng.random(dtype=np.float32)
    self._params.uop.buffer.copyin(memoryview(self._hostp).cast("B"))
    key = (str(self._params.device), self.vocab_size, self.params.greedy, self._counts is not None, self.topk, self.topp, self.minp,
           mask is not None)
    inputs = []
    if self._counts is not None:
      c = self.counts(list(history or []))
      self._counts.uop.buffer.copyin(memoryview(c).cast("B"))
      inputs.append(self._counts)
    if mask is not None: inputs.append(self._mask)
    out = _jit_for(key)(logits, *inputs, self._params)
    return int(out.numpy().reshape(-1)[0])


def apply_penalties_host(logits: np.ndarray, counts: np.ndarray, p: SamplingParams) -> np.ndarray:
  """The penalties in numpy (llama.cpp's formulas), for tests and for checking the device graph."""
  lg = logits.astype(np.float32).copy()
  seen = counts > 0
  r = np.float32(p.repetition_penalty)
  lg[seen] = np.where(lg[seen] <= 0, lg[seen] * r, lg[seen] / r)
  return lg - (counts * np.float32(p.frequency_penalty) + seen.astype(np.float32) * np.float32(p.presence_penalty))
