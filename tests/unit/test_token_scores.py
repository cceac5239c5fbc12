"""Log-probabilities at the tail (pyruntime/stage/compute/logprobs.py), their record on the ring (protocol.TokenScore) and the
seeds of a request's choices (params.choice_seed)."""
from __future__ import annotations

import numpy as np
import pytest

from pyruntime.params import choice_seed
from pyruntime.protocol import TokenScore, logprob_payload, read_logprob_payload
from pyruntime.stage.compute.logprobs import log_softmax, score


def test_log_softmax_is_float64_and_normalised():
  x = np.random.default_rng(0).standard_normal(5000).astype(np.float32) * 8
  lp = log_softmax(x)
  assert lp.dtype == np.float64 and np.exp(lp).sum() == pytest.approx(1.0, abs=1e-12)
  assert np.allclose(lp, x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum()), atol=1e-9)


def test_score_takes_the_top_k_likeliest_first_ties_by_lower_id():
  x = np.array([1.0, 3.0, 2.0, 3.0, 0.5, 3.0], dtype=np.float32)
  s = score(x, 4, 4)
  assert s.token == 4 and s.logprob == pytest.approx(log_softmax(x)[4])
  assert [t for t, _ in s.top] == [1, 3, 5, 2]  # three tied at 3.0 (lower id first), then 2.0
  assert [lp for _, lp in s.top] == sorted((lp for _, lp in s.top), reverse=True)
  assert score(x, 0, 0).top == [] and len(score(x, 0, 6).top) == 6 and len(score(x, 0, 9).top) == 6


def test_a_score_crosses_the_ring_unchanged():
  s = TokenScore(49151, -0.123456789012345, [(7, -0.5), (49151, -0.123456789012345), (0, -30.25)])
  assert read_logprob_payload(logprob_payload(s, 3), 3) == s
  assert read_logprob_payload(logprob_payload(TokenScore(3, -1.5), 0), 0) == TokenScore(3, -1.5)
  assert len(logprob_payload(s, 3)) == 12 + 12 * 3


def test_choice_seeds_keep_choice_zero_and_differ_per_choice():
  assert choice_seed(42, 0) == 42 and choice_seed(None, 3) is None
  seeds = [choice_seed(42, i) for i in range(64)]
  assert len(set(seeds)) == 64 and all(0 <= s < 2 ** 64 for s in seeds)
  assert seeds == [choice_seed(42, i) for i in range(64)]  # reproducible, whatever n
  assert choice_seed(43, 1) != choice_seed(42, 1)


def test_score_agrees_with_a_full_sort_of_the_row():
  rng = np.random.default_rng(1)
  for _ in range(20):
    x = rng.integers(-40, 40, size=3000).astype(np.float32) / 4  # many ties
    lp = log_softmax(x)
    want = sorted(range(x.size), key=lambda i: (-lp[i], i))[:20]
    s = score(x, int(want[-1]), 20)
    assert [t for t, _ in s.top] == want and [v for _, v in s.top] == [float(lp[i]) for i in want] and s.logprob == float(lp[want[-1]])
