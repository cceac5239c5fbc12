"""A model of the size people run through real stage processes: Llama 3.2 1B's shapes (1.07B parameters, Q4_0, 606 MB),
with the bundled model's tokenizer (bench/sized_model.py), in one stage and in two. A 135M model hides what a 1B's
shapes do (graph arenas of GBs, a prompt chunk staging 60 MB matrices); this checks the exactness contract at that size
on a few rows, which is what the suite can afford (70 s here with the caches warm, 79 s cold)."""
from __future__ import annotations

import pytest
from pyruntime.bench.sized_model import params, sized_model

from pyruntime.engine.launcher import Done, Launcher

N = 3  # tokens generated: a decode step beside each prompt row that scores it


@pytest.fixture(scope="module")
def path():
  return sized_model("1b")


def test_a_1b_model_answers_alike_in_one_and_two_stages_and_scores_its_own_tokens(path):
  """Greedy tokens and their log-probabilities (bits, as floats) equal in one stage and in two (the residual crosses the
  cut as float32); the prompt rows that score the generated tokens give the log-probabilities their decode steps gave
  (decode row = prompt row, on packed weights staged block by block for a prompt chunk of more than 16 rows)."""
  assert params("1b") > 1e9
  runs = {}
  for stages in (1, 2):
    with Launcher(path, stages=stages, max_context=256, max_streams=2) as lm:
      def ask(**kw) -> Done: return next(ev for ev in lm.generate(raw=True, ignore_eos=True, **kw) if isinstance(ev, Done))
      first = lm.tokenizer.encode("The history of the city begins with a small settlement on the river, where traders from the north")
      assert len(first) > 16
      gen = ask(prompt_ids=first, max_tokens=N, logprobs=2)
      scored = ask(prompt_ids=first + gen.token_ids, max_tokens=1, logprobs=2, prompt_logprobs=True)
      assert scored.prompt_logprobs[len(first) - 1:] == gen.logprobs[:N], f"{stages} stages: a prompt row differs from its decode row"
      runs[stages] = (gen.token_ids, gen.logprobs)
    assert not any(lm.alive())
  assert runs[1] == runs[2]
