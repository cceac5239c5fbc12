"""Tail sampling (pyruntime/stage/compute/sampling.py): seeds, greedy, top-k / top-p / min-p masks, llama.cpp penalties."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from pyruntime import errors
from pyruntime.stage.compute.sampling import Sampler, SamplingParams, apply_penalties_host

V = 300


def logits_of(values) -> Tensor:
  return Tensor(np.asarray(values, dtype=np.float32)).realize()


def padded(head: list[float], fill: float = -30.0) -> Tensor:
  """A V-sized logits vector whose first entries are `head`, the rest practically impossible."""
  x = np.full(V, fill, dtype=np.float32)
  x[:len(head)] = head
  return logits_of(x)


@pytest.fixture(scope="module")
def flat() -> Tensor:
  """Near-uniform logits over the whole vocabulary: draws spread widely."""
  return logits_of(np.random.default_rng(0).standard_normal(V) * 0.1)


def draws(params: SamplingParams, logits: Tensor, n: int, history=None) -> list[int]:
  s = Sampler(params, V)
  return [s.sample(logits, history or []) for _ in range(n)]


# --- seeds -------------------------------------------------------------------------------------
def test_seeded_runs_repeat_exactly(flat):
  p = SamplingParams(temperature=1.0, seed=1234)
  assert draws(p, flat, 25) == draws(p, flat, 25)
  full = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, seed=7, repetition_penalty=1.1)
  assert draws(full, flat, 15, [1, 2, 3]) == draws(full, flat, 15, [1, 2, 3])


def test_different_seeds_differ(flat):
  a, b = draws(SamplingParams(temperature=1.0, seed=1), flat, 25), draws(SamplingParams(temperature=1.0, seed=2), flat, 25)
  assert a != b
  # ~V equally likely tokens: 25 draws repeat few of them
  assert len(set(a)) > 15 and len(set(b)) > 15


def test_streams_are_independent(flat):
  """A stream's tokens do not depend on what other streams draw in between (own generator per Sampler)."""
  p = SamplingParams(temperature=1.0, seed=99)
  alone = draws(p, flat, 10)
  s, other = Sampler(p, V), Sampler(SamplingParams(temperature=1.0, seed=5), V)
  mixed = []
  for _ in range(10):
    other.sample(flat, []); other.sample(flat, [])
    mixed.append(s.sample(flat, []))
  assert mixed == alone


def test_unseeded_samplers_differ(flat):
  assert draws(SamplingParams(temperature=1.0), flat, 20) != draws(SamplingParams(temperature=1.0), flat, 20)


# --- greedy and the masks ----------------------------------------------------------------------
def test_greedy_is_argmax():
  rng = np.random.default_rng(1)
  for _ in range(5):
    x = rng.standard_normal(V).astype(np.float32) * 3
    assert draws(SamplingParams(), logits_of(x), 1) == [int(x.argmax())]


def test_top_k_1_equals_greedy():
  rng = np.random.default_rng(2)
  for seed in range(4):
    x = rng.standard_normal(V).astype(np.float32)
    assert draws(SamplingParams(temperature=1.5, top_k=1, seed=seed), logits_of(x), 5) == [int(x.argmax())] * 5


def test_top_k_mask():
  x = np.random.default_rng(3).standard_normal(V).astype(np.float32) * 0.05
  top3 = set(np.argsort(-x)[:3].tolist())
  got = draws(SamplingParams(temperature=1.0, top_k=3, seed=0), logits_of(x), 60)
  assert set(got) == top3  # only the three largest, and (near-equal odds) each of them


def test_top_p_mask():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  lg = padded(np.log(probs).tolist(), fill=-1e4)
  got = draws(SamplingParams(temperature=1.0, top_p=0.75, seed=0), lg, 60)
  assert set(got) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
  got = draws(SamplingParams(temperature=1.0, top_p=0.9, seed=0), lg, 80)
  assert set(got) == {0, 1, 2}
  assert set(draws(SamplingParams(temperature=1.0, top_p=0.4, seed=0), lg, 10)) == {0}


def test_min_p_mask():
  probs = np.array([0.4, 0.3, 0.19, 0.11])
  lg = padded(np.log(probs).tolist(), fill=-1e4)
  got = draws(SamplingParams(temperature=1.0, min_p=0.5, seed=1), lg, 60)  # keeps p >= 0.2
  assert set(got) == {0, 1}
  got = draws(SamplingParams(temperature=1.0, min_p=0.25, seed=1), lg, 80)  # keeps p >= 0.1
  assert set(got) == {0, 1, 2, 3}


def test_draws_follow_the_distribution():
  probs = np.array([0.1, 0.2, 0.3, 0.4])
  got = np.bincount(draws(SamplingParams(temperature=1.0, seed=11), padded(np.log(probs).tolist(), fill=-1e4), 400), minlength=V)
  assert got[4:].sum() == 0
  expected = probs * 400
  chi2 = float((((got[:4] - expected) ** 2) / expected).sum())
  assert chi2 < 16.3, (got[:4], chi2)  # 3 degrees of freedom, p ~ 0.001


def test_temperature_sharpens():
  probs = np.array([0.3, 0.25, 0.25, 0.2])
  lg = padded(np.log(probs).tolist(), fill=-1e4)
  hot = draws(SamplingParams(temperature=2.0, seed=3), lg, 150)
  cold = draws(SamplingParams(temperature=0.05, seed=3), lg, 150)  # p(0) ~ 0.95
  assert cold.count(0) > 125 and hot.count(0) < 70  # hot: p(0) ~ 0.27


# --- penalties ---------------------------------------------------------------------------------
def test_penalties_match_llama_cpp_formulas():
  x = np.random.default_rng(4).standard_normal(V).astype(np.float32) * 4
  history = [3, 3, 3, 10, 250, 7, 7] + list(range(20, 40))
  for p in [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.4), SamplingParams(presence_penalty=0.7),
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.2, presence_penalty=0.3, penalty_last_n=6)]:
    s = Sampler(p, V)
    got = s.adjusted_logits(logits_of(x), history).numpy()
    want = apply_penalties_host(x, s.counts(history), p)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(got, x)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
  s = Sampler(SamplingParams(repetition_penalty=2.0), V)
  got = s.adjusted_logits(padded([4.0, -1.0, 3.0, -2.0]), [0, 1]).numpy()
  assert got[:4].tolist() == [2.0, -2.0, 3.0, -2.0]


def test_frequency_and_presence_penalties():
  s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), V)
  got = s.adjusted_logits(padded([4.0, 4.0, 4.0]), [0, 0, 0, 1]).numpy()
  assert got[:3].tolist() == [4.0 - 1.5 - 1.0, 4.0 - 0.5 - 1.0, 4.0]


def test_penalised_greedy():
  lg = padded([2.0, 1.9, 1.0])
  assert draws(SamplingParams(), lg, 1, [0]) == [0]
  assert draws(SamplingParams(repetition_penalty=1.2), lg, 1, [0]) == [1]  # 2.0 / 1.2 < 1.9
  neg = padded([-0.50, -0.55], fill=-9.0)
  assert draws(SamplingParams(repetition_penalty=1.2), neg, 1, [0]) == [1]  # -0.5 * 1.2 < -0.55
  assert draws(SamplingParams(frequency_penalty=0.06), lg, 1, [0, 0]) == [1]  # 2.0 - 0.12 < 1.9
  assert draws(SamplingParams(frequency_penalty=0.06), lg, 1, [0]) == [0]  # 2.0 - 0.06 > 1.9
  assert draws(SamplingParams(presence_penalty=0.2), lg, 1, [0]) == [1]


def test_penalty_window():
  lg = padded([2.0, 1.9, 1.0])
  p = SamplingParams(repetition_penalty=1.5, penalty_last_n=2)
  assert draws(p, lg, 1, [0, 5, 6]) == [0]  # token 0 is outside the last 2
  assert draws(p, lg, 1, [5, 0, 6]) == [1]
  assert draws(SamplingParams(repetition_penalty=1.5, penalty_last_n=0), lg, 1, [0]) == [0]  # 0: no penalty
  assert draws(SamplingParams(repetition_penalty=1.5, penalty_last_n=None), lg, 1, [0] + [5] * 100) == [1]  # whole history


def test_penalties_with_sampling_are_seeded():
  x = np.random.default_rng(5).standard_normal(V).astype(np.float32)
  p = SamplingParams(temperature=0.9, top_k=20, seed=8, repetition_penalty=1.5, presence_penalty=1.0)
  a, b = draws(p, logits_of(x), 12, [1, 2, 3]), draws(p, logits_of(x), 12, [1, 2, 3])
  assert a == b


# --- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_k", 1.5),
                                         ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 2.0), ("seed", -1),
                                         ("seed", "x"), ("repetition_penalty", 0.0), ("frequency_penalty", float("inf")),
                                         ("presence_penalty", None), ("penalty_last_n", -2), ("top_k", True)])
def test_invalid_options_are_named(field, value):
  with pytest.raises(errors.InvalidOption) as e: SamplingParams(**{field: value}).validate()
  assert e.value.field == field


def test_dict_round_trip_and_unknown_option():
  p = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, seed=3, repetition_penalty=1.1, frequency_penalty=0.1,
                     presence_penalty=0.2, penalty_last_n=64)
  assert SamplingParams.from_dict(p.to_dict()) == p
  assert SamplingParams.from_dict({}) == SamplingParams()
  with pytest.raises(errors.InvalidOption) as e: SamplingParams.from_dict({"temprature": 1.0})
  assert e.value.field == "temprature"
  with pytest.raises(errors.InvalidOption): Sampler(SamplingParams(), V).sample(logits_of(np.zeros(V + 1)), [])
