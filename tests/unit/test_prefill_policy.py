"""StageScheduler.prefill_size: how a stage sizes a newcomer's prefill chunks beside decoding streams. The scheduler's
own arithmetic, given the model's chunk bounds (all the policy needs of the model); that any size is exact is proven on
real models in test_model.py, test_model_families.py and test_model_smollm2.py."""
from __future__ import annotations

import numpy as np
import pytest

from pyruntime.options import PREFILL_SHARE
from pyruntime.stage.scheduler import StageScheduler, Stream

NEWCOMER = 99


def scheduler_with(decoding: int, chunk: int = 32, prompt: int = 500, min_chunk: int = 1) -> StageScheduler:
  """A stage's scheduler with `decoding` streams past their prompts and one stream with a `prompt`-token prompt still to
  prefill. By default its model is on tinygrad's path (chunks of 1..32); the rows path's are 16..256."""
  sched = StageScheduler()
  sched.max_chunk, sched.min_chunk = chunk, min_chunk
  for i in range(decoding): sched.streams[i] = Stream(slot=i, prompt_tokens=4, position=5)
  newcomer = Stream(slot=decoding, prompt_tokens=prompt, position=prompt)
  newcomer.pending.append((0, np.zeros(prompt, np.uint32)))
  sched.streams[NEWCOMER] = newcomer
  return sched


def test_alone_a_prompt_goes_in_whole_chunks():
  sched = scheduler_with(decoding=0)
  sched.step_s = 0.1
  sched.note_prefill(32, 3.2)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 32


def test_beside_decoding_streams_a_chunk_costs_about_one_step():
  sched = scheduler_with(decoding=3)
  sched.step_s = 0.12
  sched.note_prefill(32, 32 * 0.02)  # the newcomer's first chunk ran before the others decoded
  assert sched.prefill_size(sched.streams[NEWCOMER]) == int(PREFILL_SHARE * 0.12 / 0.02)
  sched.note_prefill(8, 0.24)  # a chunk that cost twice the step: the next is half as long
  assert sched.prefill_size(sched.streams[NEWCOMER]) == int(8 * PREFILL_SHARE * 0.12 / 0.24)
  sched.note_prefill(3, 5.0)  # one token at least
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("prompt,want", [(32, 32), (20, 32), (33, 12)])
def test_a_prompt_of_one_chunk_goes_whole(prompt, want):
  """A short prompt is one step's delay for the others, once; cut small it would wait many steps for its first token."""
  sched = scheduler_with(decoding=3, prompt=prompt)
  sched.step_s = 0.12
  sched.note_prefill(32, 32 * 0.02)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == want


def test_until_costs_are_known_one_token():
  sched = scheduler_with(decoding=2)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 1
  sched.step_s = 0.1
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 1
  sched.step_s = 0.0
  sched.note_prefill(4, 0.1)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("last,seconds,want", [(4, 1e-6, 8), (4, 0.0, 8), (20, 1e-6, 32), (4, 10.0, 1)])
def test_at_most_twice_the_last_between_one_and_the_models_chunk(last, seconds, want):
  """A chunk timed in a lull does not bring one that costs many steps: growth is at most twofold per chunk."""
  sched = scheduler_with(decoding=1)
  sched.step_s = 0.1
  sched.note_prefill(last, seconds)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == want


def test_recurrent_models_chunk_of_one_holds():
  sched = scheduler_with(decoding=0, chunk=1)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("fixed_s,token_s,step_s", [(0.04, 0.07, 0.125), (0.001, 0.0005, 0.01), (0.09, 0.001, 0.1)])
def test_sizes_settle_where_a_chunk_costs_about_one_step(fixed_s, token_s, step_s):
  """A chunk of n tokens costing fixed + n * per-token (on a CPU mostly per token; on a GPU mostly fixed): from one
  token the sizes settle on the largest chunk that costs no more than a step (or on 1 or 32), and stay there."""
  sched = scheduler_with(decoding=4)
  sched.step_s = step_s
  sizes = []
  for _ in range(16):
    n = sched.prefill_size(sched.streams[NEWCOMER])
    sizes.append(n)
    sched.note_prefill(n, fixed_s + n * token_s)
  best = max(1, min(32, int((PREFILL_SHARE * step_s - fixed_s) / token_s)))
  assert sizes[0] == 1 and abs(sizes[-1] - best) <= 1 and len(set(sizes[-4:])) <= 2, sizes


def test_rows_path_cuts_even_a_short_prompt_by_load_in_units_of_sixteen():
  """On the rows path a chunk rides in the decode step and is timed as what it added to it: beside decoding streams the
  head sizes every prompt by load whatever its length, to what fits in whole units of 16 rows (never fewer), and the
  stages after the head compute the chunks as they come."""
  sched = scheduler_with(decoding=3, chunk=256, prompt=100, min_chunk=16)
  sched.is_head = True
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 16
  sched.step_s = 0.1
  sched.note_prefill(16, 0.016)  # 16 rows added 16 ms to a 100 ms step
  assert sched.prefill_size(sched.streams[NEWCOMER]) == min(256, int(16 * PREFILL_SHARE * 0.1 / 0.016)) // 16 * 16
  sched.note_prefill(64, 0.2)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == int(64 * PREFILL_SHARE * 0.1 / 0.2) // 16 * 16
  sched.note_prefill(64, 5.0)
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 16
  sched.is_head = False
  assert sched.prefill_size(sched.streams[NEWCOMER]) == 256  # a later sched takes the head's chunks whole
  alone = scheduler_with(decoding=0, chunk=256, prompt=1000, min_chunk=16)
  assert alone.prefill_size(alone.streams[NEWCOMER]) == 256
