"""A kv_budget smaller than the streams' positions (docs/streams.md, "A budget for keys and values: preemption"), through
real stage processes on tiny models: streams preempted for it and resumed give, token for token (and log-probability
for log-probability), what each gives alone on a launcher without a budget: greedy, seeded, with logprobs, with a JSON
grammar, with the prefix cache giving back their positions and without it, on a dense model and on a hybrid (whose
recurrent state comes back from a snapshot); speculating streams give plain decoding's tokens. The budget holds at
every step; the launch plan's rules are unit-tested
in tests/unit/test_launch_plan.py."""
from __future__ import annotations

import threading
import time

import pytest
from tinymodels import TINY_FAMILIES, TINY_MODELS, write_tiny_gguf

from pyruntime.engine.launcher import Done, Launcher

BUDGET = CONTEXT = 256
# all five fit at admission; then each grows by 100 positions: every one but the oldest is preempted, the youngest first
REQUESTS = [dict(prompt=f"{w} quick brown fox jumps over the lazy dog.", max_tokens=100, ignore_eos=True)
            for w in ("The", "A", "One", "Hello world! The", "Some")]
REQUESTS[1].update(temperature=0.9, seed=7)
REQUESTS[2].update(logprobs=2)
REQUESTS[3].update(response_format={"type": "json_object"}, temperature=0.7, seed=3, ignore_eos=False)


def together(lm: Launcher, requests: list[dict]) -> list[Done]:
  """The requests submitted in order (so in arrival order: the last ones are the youngest, preempted first)."""
  out: list = [None] * len(requests)
  ended = threading.Semaphore(0)
  def sink(i: int):
    def on_event(ev: object) -> None:
      if isinstance(ev, (Done, Exception)): out[i] = ev; ended.release()
    return on_event
  for i, r in enumerate(requests): lm.submit(**r, on_event=sink(i))
  for _ in requests: assert ended.acquire(timeout=300)
  return out


@pytest.mark.parametrize("family,prefix_cache", [("llama", 8192), ("llama", 0), ("qwen35", 8192)])
def test_preempted_streams_answer_as_they_do_alone(tmp_path, family, prefix_cache):
  kw = TINY_MODELS["llama_tied"] if family == "llama" else TINY_FAMILIES[family]
  path = write_tiny_gguf(tmp_path / f"{family}.gguf", **kw, context=512)
  with Launcher(path, stages=2, max_context=CONTEXT, prefix_cache=prefix_cache) as lm:
    alone = [together(lm, [r])[0] for r in REQUESTS]
  # the launcher alone's slots (8, all five fit): its graphs, captured above, are loaded, not captured again
  with Launcher(path, stages=2, max_context=CONTEXT, kv_budget=BUDGET, prefix_cache=prefix_cache) as lm:
    got = together(lm, REQUESTS)
    deadline = time.monotonic() + 30
    while lm.scheduler_stats()["kv"]["held"] and time.monotonic() < deadline: time.sleep(0.05)  # the last CLOSE echoes
    kv = lm.scheduler_stats()["kv"]
  # the five streams would hold 5 x ~150 positions: some were preempted, and every one still answers as it does alone
  assert all(d.timings.preempted for d in got[1:]) and kv["preempted"] == sum(d.timings.preempted for d in got)
  assert kv["peak"] <= BUDGET and kv["held"] == 0
  for a, b in zip(alone, got, strict=True):
    assert (b.token_ids, b.finish_reason, b.usage.prompt_tokens) == (a.token_ids, a.finish_reason, a.usage.prompt_tokens)
    assert b.text == a.text
  assert [(s.token, s.logprob, [t[0] for t in s.top]) for s in got[2].logprobs] == \
         [(s.token, s.logprob, [t[0] for t in s.top]) for s in alone[2].logprobs]
  assert got[3].text.lstrip().startswith("{")  # JSON (cut by max_tokens): the grammar held


def test_speculating_streams_preempted_answer_as_they_do_alone(tmp_path):
  """Two streams drafting with n-grams (repetitive prompts) outgrow the budget: a step past it drops its drafts before
  it preempts, and both streams still answer plain decoding's tokens."""
  path = write_tiny_gguf(tmp_path / "llama.gguf", **TINY_MODELS["llama_tied"], context=512)
  requests = [dict(prompt=p * 4, max_tokens=150, ignore_eos=True) for p in ("the dog the dog the dog the dog ", "hello world hello world ")]
  with Launcher(path, stages=2, max_context=CONTEXT, prefix_cache=0) as lm:
    plain = [together(lm, [r])[0] for r in requests]
  with Launcher(path, stages=2, max_context=CONTEXT, kv_budget=BUDGET, speculative="ngram") as lm:
    got = together(lm, requests)
    kv = lm.scheduler_stats()["kv"]
  assert [d.token_ids for d in got] == [d.token_ids for d in plain]
  assert kv["preempted"] >= 1 and kv["peak"] <= BUDGET and all(d.timings.draft_rounds for d in got)
