"""Log-probabilities at the tail: how likely the model found a token, from the raw logits of its row.

The log-softmax is taken of the logits as the model computed them (float32), before the sampler's penalties,
temperature, top-k/top-p/min-p and any grammar mask: what the model thinks, not what the sampler was allowed to pick
(docs/serving.md#log-probabilities). It is computed on the host in float64 from a copy of the row, so a row's numbers
depend on its logits alone: the rows path gives a row the same logits alone or in any batch (docs/prompt-path.md), and
so the same log-probabilities.
"""
from __future__ import annotations

import numpy as np

from pyruntime.protocol import TokenScore

_scratch: dict[int, np.ndarray] = {}  # float64 work rows by vocabulary size: a fresh 400 kB array per token costs its page faults


def log_sum_exp(x: np.ndarray) -> float:
  """log(sum(exp(x))) of a float32 row, in float64 (shifted by the max, so nothing overflows)."""
  m = float(x.max())
  buf = _scratch.get(x.size)
  if buf is None: buf = _scratch[x.size] = np.empty(x.size, dtype=np.float64)
  np.subtract(x, m, out=buf, dtype=np.float64)
  np.exp(buf, out=buf)
  return m + float(np.log(buf.sum()))


def log_softmax(logits: np.ndarray) -> np.ndarray:
  x = np.asarray(logits, dtype=np.float32).reshape(-1)
  return x.astype(np.float64) - log_sum_exp(x)


def score(logits: np.ndarray, token: int, k: int) -> TokenScore:
  """`token`'s log-probability under `logits` and the k most likely tokens' (most likely first; equal values: lower
  id first, which is the order successive argmaxes find them in: for k <= 20 cheaper than a partition of the row)."""
  x = np.asarray(logits, dtype=np.float32).reshape(-1)
  lse = log_sum_exp(x)
  top: list[tuple[int, float]] = []
  if k > 0:
    y = x.copy()
    for _ in range(min(k, y.size)):
      i = int(y.argmax())
      top.append((i, float(x[i]) - lse))
      y[i] = -np.inf
  return TokenScore(int(token), float(x[token]) - lse, top)
