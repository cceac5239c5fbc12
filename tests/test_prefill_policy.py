"""Stage.prefill_size: how a stage sizes a newcomer's prefill chunks beside decoding streams. The stage's own arithmetic
over a named test double for its model (the policy needs only the model's chunk); that any size is exact is proven on
real models in test_model.py, test_model_families.py and test_model_smollm2.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pyruntime.stage import PREFILL_SHARE, Stage, Stream


class ChannelDouble:
  """The stage's event channel, kept in a list."""
  def __init__(self) -> None: self.events: list[tuple[str, dict]] = []
  def emit(self, event: str, **fields) -> None: self.events.append((event, fields))


NEWCOMER = 99


def stage_with(decoding: int, chunk: int = 32, prompt: int = 500, min_chunk: int = 1) -> Stage:
  """A stage with `decoding` streams past their prompts and one stream with a `prompt`-token prompt still to prefill.
  By default its model is on tinygrad's path (chunks of 1..32); the rows path's are 16..256."""
  stage = Stage(ChannelDouble())
  stage.model = SimpleNamespace(max_chunk=chunk, min_chunk=min_chunk)  # a test double: the policy reads only its chunk bounds
  for i in range(decoding): stage.streams[i] = Stream(slot=i, prompt_tokens=4, position=5)
  newcomer = Stream(slot=decoding, prompt_tokens=prompt, position=prompt)
  newcomer.pending.append((0, np.zeros(prompt, np.uint32)))
  stage.streams[NEWCOMER] = newcomer
  return stage


def test_alone_a_prompt_goes_in_whole_chunks():
  stage = stage_with(decoding=0)
  stage.step_s = 0.1
  stage.note_prefill(32, 3.2)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 32


def test_beside_decoding_streams_a_chunk_costs_about_one_step():
  stage = stage_with(decoding=3)
  stage.step_s = 0.12
  stage.note_prefill(32, 32 * 0.02)  # the newcomer's first chunk ran before the others decoded
  assert stage.prefill_size(stage.streams[NEWCOMER]) == int(PREFILL_SHARE * 0.12 / 0.02)
  stage.note_prefill(8, 0.24)  # a chunk that cost twice the step: the next is half as long
  assert stage.prefill_size(stage.streams[NEWCOMER]) == int(8 * PREFILL_SHARE * 0.12 / 0.24)
  stage.note_prefill(3, 5.0)  # one token at least
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("prompt,want", [(32, 32), (20, 32), (33, 12)])
def test_a_prompt_of_one_chunk_goes_whole(prompt, want):
  """A short prompt is one step's delay for the others, once; cut small it would wait many steps for its first token."""
  stage = stage_with(decoding=3, prompt=prompt)
  stage.step_s = 0.12
  stage.note_prefill(32, 32 * 0.02)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == want


def test_until_costs_are_known_one_token():
  stage = stage_with(decoding=2)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 1
  stage.step_s = 0.1
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 1
  stage.step_s = 0.0
  stage.note_prefill(4, 0.1)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("last,seconds,want", [(4, 1e-6, 8), (4, 0.0, 8), (20, 1e-6, 32), (4, 10.0, 1)])
def test_at_most_twice_the_last_between_one_and_the_models_chunk(last, seconds, want):
  """A chunk timed in a lull does not bring one that costs many steps: growth is at most twofold per chunk."""
  stage = stage_with(decoding=1)
  stage.step_s = 0.1
  stage.note_prefill(last, seconds)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == want


def test_recurrent_models_chunk_of_one_holds():
  stage = stage_with(decoding=0, chunk=1)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 1


@pytest.mark.parametrize("fixed_s,token_s,step_s", [(0.04, 0.07, 0.125), (0.001, 0.0005, 0.01), (0.09, 0.001, 0.1)])
def test_sizes_settle_where_a_chunk_costs_about_one_step(fixed_s, token_s, step_s):
  """A chunk of n tokens costing fixed + n * per-token (on a CPU mostly per token; on a GPU mostly fixed): from one
  token the sizes settle on the largest chunk that costs no more than a step (or on 1 or 32), and stay there."""
  stage = stage_with(decoding=4)
  stage.step_s = step_s
  sizes = []
  for _ in range(16):
    n = stage.prefill_size(stage.streams[NEWCOMER])
    sizes.append(n)
    stage.note_prefill(n, fixed_s + n * token_s)
  best = max(1, min(32, int((PREFILL_SHARE * step_s - fixed_s) / token_s)))
  assert sizes[0] == 1 and abs(sizes[-1] - best) <= 1 and len(set(sizes[-4:])) <= 2, sizes


def test_rows_path_cuts_even_a_short_prompt_by_load_in_units_of_sixteen():
  """On the rows path a chunk rides in the decode step and is timed as what it added to it: beside decoding streams the
  head sizes every prompt by load whatever its length, to what fits in whole units of 16 rows (never fewer), and the
  stages after the head compute the chunks as they come."""
  stage = stage_with(decoding=3, chunk=256, prompt=100, min_chunk=16)
  stage.model.is_head = True
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 16
  stage.step_s = 0.1
  stage.note_prefill(16, 0.016)  # 16 rows added 16 ms to a 100 ms step
  assert stage.prefill_size(stage.streams[NEWCOMER]) == min(256, int(16 * PREFILL_SHARE * 0.1 / 0.016)) // 16 * 16
  stage.note_prefill(64, 0.2)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == int(64 * PREFILL_SHARE * 0.1 / 0.2) // 16 * 16
  stage.note_prefill(64, 5.0)
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 16
  stage.model.is_head = False
  assert stage.prefill_size(stage.streams[NEWCOMER]) == 256  # a later stage takes the head's chunks whole
  alone = stage_with(decoding=0, chunk=256, prompt=1000, min_chunk=16)
  assert alone.prefill_size(alone.streams[NEWCOMER]) == 256
