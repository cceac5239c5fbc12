"""Speculative decoding (pyruntime/engine/speculation.py, docs/speculation.md): the drafter and the draft length alone; then
through real stage processes on tiny models, every request's tokens with speculation on are plain decoding's — greedy,
with penalties, stop strings, ignore_eos and a cut budget, alone and beside other streams, over two and three stages
and several dense families — while drafts are in fact verified and accepted; streams that cannot be verified exactly
(seeded, constrained) decode plainly; the prefix cache holds no rejected draft; bad options are refused by name."""
from __future__ import annotations

import pytest
from conftest import run_together
from tinymodels import TINY_FAMILIES, TINY_GEMMA, TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.launcher import Done, Launcher
from pyruntime.engine.speculation import PROBE_EVERY, PROBE_MAX, DraftLength, ngram_draft

REPEATING = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown"


def test_ngram_drafts_follow_the_longest_repeated_suffix():
  seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
  assert ngram_draft(seq, 3) == [4, 5, 9]          # "1 2 3" occurred before: what followed it
  assert ngram_draft(seq, 10) == [4, 5, 9, 9, 1, 2, 3]
  assert ngram_draft([5, 6, 7, 8], 4) == []         # nothing repeats
  assert ngram_draft(seq, 0) == []
  # the latest occurrence with a whole draft after it wins over an older one
  assert ngram_draft([7, 8, 1, 7, 8, 2, 0, 0, 7, 8], 2) == [2, 0]
  assert ngram_draft([3, 3, 3, 3, 3], 3) == [3]     # an occurrence near the end: as many as follow it


def test_the_draft_length_follows_acceptance():
  d = DraftLength(8)
  assert d.next() == 8                              # a long draft costs what a short one does (one padded unit)
  d.update(8, 5); assert d.next() == 8
  for _ in range(3): d.update(8, 0)                 # drafts that do not pay: none
  assert d.next() == 0
  assert [d.next() for _ in range(PROBE_EVERY)][-1] == 8  # ... until a probe
  d.update(8, 0); assert d.next() == 0
  assert [d.next() for _ in range(PROBE_EVERY)][-1] == 8  # prompt lookup probes every PROBE_EVERY tokens, however often it failed
  d = DraftLength(8, backoff=True)  # a draft model's drafts cost steps of their own: its waits grow
  for _ in range(3): d.update(8, 0)
  waits = []
  for _ in range(6):  # each probe that does not pay doubles the wait for the next, up to PROBE_MAX
    n = 1
    while d.next() == 0: n += 1
    waits.append(n)
    d.update(8, 0)
  assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, PROBE_MAX, PROBE_MAX]
  while d.next() == 0: pass
  d.update(8, 8); assert d.next() == 8 and d.wait == PROBE_EVERY  # a probe that pays: drafting again, short waits
  cold = DraftLength(8, paying=False, backoff=True)  # a draft model whose recent rounds did not pay: a new stream probes first
  assert [cold.next() for _ in range(PROBE_EVERY)] == [0] * (PROBE_EVERY - 1) + [8]


@pytest.mark.parametrize("bad", [{"speculative": "model:"}, {"speculative": "draft"}, {"speculative": True}, {"draft_tokens": 0},
                                 {"draft_tokens": 16}, {"draft_tokens": 2.5}])
def test_bad_speculation_options_are_refused_by_name(bad):
  with pytest.raises(errors.InvalidOption) as e: Launcher(None, **bad)
  assert e.value.field == next(iter(bad))


# --- through stage processes ----------------------------------------------------------------------------------------
def ask(lm: Launcher, prompt: str, **kw) -> Done:
  kw.setdefault("max_tokens", 48)
  return next(ev for ev in lm.generate(prompt, raw=True, **kw) if isinstance(ev, Done))


CASES = [{}, {"repetition_penalty": 1.2, "presence_penalty": 0.3}, {"stop": ["lazy"]}, {"ignore_eos": True, "max_tokens": 70},
         {"max_tokens": 7}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return str(write_tiny_gguf(tmp_path_factory.mktemp("spec") / "tiny.gguf", **TINY_MODELS["llama_tied"]))


@pytest.fixture(scope="module")
def spec(tiny):
  with Launcher(tiny, split=[(0, 2), (2, 5)], max_context=256, speculative="ngram") as lm: yield lm


class Plain:
  """Plain decoding on the same launcher: requests that opt out of speculation (their OPEN says so, and every stage
  and the launcher then treat them as they treat any stream without it)."""

  def __init__(self, lm: Launcher): self.lm = lm
  def __getattr__(self, name: str): return getattr(self.lm, name)

  def generate(self, *args, **kw):
    return self.lm.generate(*args, **{**kw, "speculative": False})


@pytest.fixture(scope="module")
def plain(spec):
  return Plain(spec)


@pytest.mark.integration
def test_speculative_tokens_are_plain_decodings(plain, spec):
  drafted = 0
  for prompt, cases in ((REPEATING, CASES), ("Hello world! Hello there, how are you? Hello world! Hello", CASES[:2])):
    for kw in cases:
      want, got = ask(plain, prompt, **kw), ask(spec, prompt, **kw)
      assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), (prompt, kw)
      assert want.timings.draft_rounds == 0
      drafted += got.timings.accepted_tokens
  assert drafted > 8  # the drafts were verified, and the model agreed with many of them


@pytest.mark.integration
def test_a_request_may_opt_out_and_streams_that_cannot_be_verified_exactly_decode_plainly(plain, spec):
  assert ask(spec, REPEATING, speculative=False).timings.draft_rounds == 0
  seeded = ask(spec, REPEATING, temperature=0.8, seed=3)
  assert seeded.timings.draft_rounds == 0 and seeded.token_ids == ask(plain, REPEATING, temperature=0.8, seed=3).token_ids
  constrained = ask(spec, REPEATING, response_format={"type": "json_object"})
  assert constrained.timings.draft_rounds == 0
  with pytest.raises(errors.InvalidOption) as e: spec.submit("x", raw=True, speculative="yes", on_event=print)
  assert e.value.field == "speculative"


@pytest.mark.integration
def test_speculating_beside_other_streams_changes_no_token(plain, spec):
  prompts = [REPEATING, "Hello world! Hello world! Hello", "The dog sleeps in the sun, and the dog sleeps", "In the beginning"]
  want = [ask(plain, p, max_tokens=32).token_ids for p in prompts]
  got = run_together(lambda i: ask(spec, prompts[i], max_tokens=32).token_ids, len(prompts))
  assert [got[i] for i in range(len(prompts))] == want


@pytest.mark.integration
def test_the_prefix_cache_keeps_no_rejected_draft(plain, spec):
  """A speculated answer is saved to the prefix cache (decoded positions included); a request that continues it reads
  those blocks and must see plain decoding's keys and values: its tokens equal a plain launcher's."""
  first = ask(spec, REPEATING, max_tokens=60)
  follow = REPEATING + spec.tokenizer.decode(first.token_ids)
  again = ask(spec, follow, max_tokens=20, speculative=False)
  assert again.usage.cached_tokens > 0
  assert again.token_ids == ask(plain, follow, max_tokens=20, prefix_cache=False).token_ids  # recomputed from scratch


@pytest.mark.integration
@pytest.mark.parametrize("family,split", [("qwen2", [(0, 1), (1, 3), (3, 4)]), ("qwen3", [(0, 3), (3, 5)]), ("glm4moe", [(0, 2), (2, 4)]),
                                         ("deepseek2", [(0, 3), (3, 4)]), ("gemma3", [(0, 5), (5, 7)]),
                                         ("qwen35", [(0, 1), (1, 3), (3, 4)]), ("qwen35moe", [(0, 3), (3, 4)])])
def test_families_and_splits_speculate_exactly(tmp_path, family, split):
  """Dense families, a MoE one (glm4moe: a leading dense block, routed experts with expert bias, a gated shared expert)
  and an MLA one (deepseek2: the latent cache rewound with the draft), Gemma 3 (sliding windows) and the hybrids (a
  rejected draft's recurrent state taken back: StageModel.rewind) speculate on the rows path, split, and give plain
  decoding's tokens."""
  path = write_tiny_gguf(tmp_path / f"{family}.gguf", **{**TINY_MODELS, **TINY_FAMILIES, "gemma3": TINY_GEMMA}[family])
  with Launcher(path, split=split, max_context=256, speculative="ngram") as lm:
    rounds = rejected = 0
    for kw in CASES[:2]:  # greedy and penalised; stops and budgets do not depend on the family (all CASES above)
      want = ask(lm, REPEATING, speculative=False, **kw)
      # prompt lookup, and a prediction right for a while, then wrong (a random model's answer may never repeat the prompt)
      predicted = lm.tokenizer.decode(want.token_ids[:24]) + " and then something else entirely, about the weather"
      for got in (ask(lm, REPEATING, **kw), ask(lm, REPEATING, prediction=predicted, **kw)):
        assert got.token_ids == want.token_ids, kw
        rounds += got.timings.draft_rounds
        rejected += got.timings.drafted_tokens - got.timings.accepted_tokens
    assert rounds > 0 and rejected > 0  # drafts were verified, and some were not the model's: rows went back
    if family.startswith("qwen35"): _hybrid_speculates_beside_others_and_caches_no_rejected_state(lm, want, predicted)


def _hybrid_speculates_beside_others_and_caches_no_rejected_state(lm: Launcher, want: Done, predicted: str) -> None:
  """A hybrid's verify records beside another stream's rows (each prompt's rows in the step's window), and its answer's
  prefix cached with state snapshots: a draft's rejected rows reach neither the other stream nor a cached state."""
  other = "The dog sleeps in the sun, and the dog sleeps"
  alone = ask(lm, other, speculative=False, max_tokens=32, prefix_cache=False).token_ids
  got = run_together(lambda i: ask(lm, REPEATING if i == 0 else other, max_tokens=48 if i == 0 else 32, prefix_cache=False,
                                   **({"prediction": predicted, "repetition_penalty": 1.2} if i == 0 else {})).token_ids, 2)
  assert got[0] == want.token_ids and got[1] == alone
  first = ask(lm, REPEATING, max_tokens=60, prediction=predicted)
  assert first.timings.drafted_tokens > first.timings.accepted_tokens
  follow = lm.tokenizer.encode(REPEATING) + first.token_ids  # ids: a random model's text need not tokenize back to them
  again = next(ev for ev in lm.generate(prompt_ids=follow, max_tokens=20, speculative=False) if isinstance(ev, Done))
  assert again.usage.cached_tokens >= len(follow) - 16 - 1  # decoded positions, up to the snapshot at the last boundary
  assert again.token_ids == next(ev for ev in lm.generate(prompt_ids=follow, max_tokens=20, prefix_cache=False) if isinstance(ev, Done)).token_ids


def test_a_prediction_drafts_from_the_callers_text():
  from pyruntime.engine.speculation import prediction_draft
  pred = [10, 11, 12, 13, 14, 15]
  assert prediction_draft([], pred, 3) == [10, 11, 12]            # nothing written yet: its start
  assert prediction_draft([10, 11], pred, 3) == [12, 13, 14]      # on track
  assert prediction_draft([7, 8, 12, 13], pred, 2) == [14, 15]    # back on it after a detour
  assert prediction_draft([99], pred, 3) == [] and prediction_draft([1], [], 3) == []


@pytest.mark.integration
def test_a_prediction_speeds_nothing_up_wrongly_and_is_counted(plain, spec):
  """OpenAI's `prediction`: the caller's expected text drafts; the answer is plain decoding's whatever it predicts, and
  usage counts its accepted and rejected tokens; per draft position the launcher counts drafts and acceptances."""
  want = ask(plain, REPEATING, max_tokens=40)
  right = ask(spec, REPEATING, max_tokens=40, prediction=spec.tokenizer.decode(want.token_ids))
  wrong = ask(spec, REPEATING, max_tokens=40, prediction="Completely unrelated words about the weather in Paris.")
  assert right.token_ids == want.token_ids == wrong.token_ids
  # the text re-tokenized need not be the model's tokens (a random model writes odd bytes): most of it still drafts right
  assert right.usage.accepted_prediction_tokens > max(10, 3 * wrong.usage.accepted_prediction_tokens)
  # rejected: the prediction's tokens the answer did not take, drafted or not (OpenAI's count)
  n_wrong = len(spec.tokenizer.encode("Completely unrelated words about the weather in Paris.", parse_special=False))
  assert wrong.usage.rejected_prediction_tokens == n_wrong - wrong.usage.accepted_prediction_tokens > 0
  n_right = len(spec.tokenizer.encode(spec.tokenizer.decode(want.token_ids), parse_special=False))
  assert right.usage.rejected_prediction_tokens == n_right - right.usage.accepted_prediction_tokens
  stats = spec.scheduler_stats()["speculation"]
  assert stats["drafted_at"][0] >= stats["accepted_at"][0] > 0 and stats["drafted_at"][0] >= stats["drafted_at"][-1]
  with pytest.raises(errors.InvalidOption) as e: spec.submit("x", raw=True, prediction=3, on_event=print)
  assert e.value.field == "prediction"
