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


def log_softmax(logits: np.ndarray) -> np.ndarray:
  x = np.asarray(logits, dtype=np.float64).reshape(-1)
  m = x.max()
  return x - (m + np.log(np.exp(x - m).sum()))


def score(logits: np.ndarray, token: int, k: int) -> TokenScore:
  """`token`'s log-probability under `logits` and the k most likely tokens' (most likely first; equal values: lower
  id first, so the order never depends on the partition's internals)."""
  lp = log_softmax(logits)
  top: list[tuple[int, float]] = []
  if k > 0:
    k = min(k, lp.size)
    cand = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    # the k-th value may be tied by tokens outside `cand`: take every token at least as likely, then order and cut
    cand = np.flatnonzero(lp >= lp[cand].min())
    order = np.lexsort((cand, -lp[cand]))[:k]
    top = [(int(cand[i]), float(lp[cand[i]])) for i in order]
  return TokenScore(int(token), float(lp[token]), top)
