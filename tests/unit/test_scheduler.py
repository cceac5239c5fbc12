"""StageScheduler: a stage's decisions, without a process or a model. When a step runs (the decode rows of every
decoding stream are here, or gathering them took its window), what it holds (a micro-batch of decode rows, one prompt
chunk, one pass or two) and how a prompt is cut (test_prefill_policy.py has the sizing policy's arithmetic)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pyruntime.stage.scheduler import GATHER_MAX_S, GATHER_MIN_S, GATHER_STEPS, StageScheduler, Stream

IDLE_S = 0.05  # what the data loop passes as its idle wait (dataloop.COMMAND_POLL_S)


class Clock:
  def __init__(self) -> None: self.t = 100.0
  def __call__(self) -> float: return self.t


def scheduler(**settings) -> tuple[StageScheduler, Clock]:
  clock = Clock()
  s = StageScheduler(clock=clock)
  s.max_chunk, s.min_chunk = 256, 16  # the rows path's chunk bounds
  for k, v in settings.items(): setattr(s, k, v)
  return s, clock


def decoding(s: StageScheduler, sid: int, row: bool, since: int = 0) -> Stream:
  """A stream past its 4-token prompt; `row`: its next decode row is here (taken at ring sequence `since`)."""
  st = Stream(slot=sid, prompt_tokens=4, position=5)
  if row:
    st.pending.append((5, np.zeros(1, np.uint32)))
    st.position, st.waiting_since = 6, since
  s.streams[sid] = st
  return st


def prompting(s: StageScheduler, sid: int, n: int = 100) -> Stream:
  """A stream whose whole `n`-token prompt waits."""
  st = Stream(slot=sid, prompt_tokens=n, position=n)
  st.pending.append((0, np.zeros(n, np.uint32)))
  s.streams[sid] = st
  return st


def test_no_work_no_step_and_no_gathering():
  s, _ = scheduler()
  decoding(s, 0, row=False)
  s.gathering = 1.0
  assert not s.has_work() and not s.ready() and s.gathering is None
  assert s.ingress_wait(IDLE_S) == IDLE_S


def test_every_decoding_streams_row_here_runs_at_once():
  s, _ = scheduler()
  decoding(s, 0, row=True); decoding(s, 1, row=True)
  assert s.ready() and s.gathering is None and s.ingress_wait(IDLE_S) == 0.0


def test_a_missing_row_is_waited_for_within_the_gather_window_only():
  s, clock = scheduler()
  s.step_s = 0.01  # the window: GATHER_STEPS of this stage's decode steps
  window = GATHER_STEPS * 0.01
  decoding(s, 0, row=True); decoding(s, 1, row=False)
  assert not s.ready() and s.gathering == clock.t
  assert s.ingress_wait(IDLE_S) == pytest.approx(window)  # the read waits no longer than the window has left
  clock.t += window / 2
  assert not s.ready() and s.ingress_wait(IDLE_S) == pytest.approx(window / 2)
  clock.t += window / 2
  assert s.ready()  # the window is spent: the row that is here runs alone
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [0] and plan.prefill is None and not plan.mixed and s.gathering is None


def test_only_the_head_gathers():
  """A stage after the head runs the decode rows it has at once: the head merges the groups (every row comes back to
  it), and a later stage that waited for a group a stage before it holds could wait for a stage that waits for it."""
  s, _ = scheduler(is_head=False)
  s.step_s = 0.01
  decoding(s, 0, row=True); decoding(s, 1, row=False)
  assert s.ready() and [sid for sid, _ in s.plan().decode] == [0]
  s, _ = scheduler(is_head=False)
  decoding(s, 1, row=False)
  assert not s.ready()  # nothing here: nothing to run


@pytest.mark.parametrize("step_s,want", [(0.0, GATHER_MIN_S), (0.01, GATHER_STEPS * 0.01), (10.0, GATHER_MAX_S)])
def test_the_gather_window_follows_the_step_between_its_bounds(step_s, want):
  s, _ = scheduler(step_s=step_s)
  assert s.gather_left() == pytest.approx(want)


def test_a_failed_stream_is_not_waited_for():
  s, _ = scheduler()
  decoding(s, 0, row=True)
  decoding(s, 1, row=False).failed = True
  assert s.decoding() == 1 and s.ready()


def test_a_decode_row_beside_a_prompt_gives_a_mixed_step():
  s, _ = scheduler()
  decoding(s, 0, row=True)
  prompting(s, 7)
  assert s.ready()
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [0] and plan.prefill[0] == 7 and plan.mixed


def test_on_tinygrads_path_the_step_is_two_passes():
  s, _ = scheduler(decode_mode="reference")
  decoding(s, 0, row=True)
  prompting(s, 7)
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [0] and plan.prefill[0] == 7 and not plan.mixed


def test_a_prompt_waits_for_the_decode_rows_on_the_rows_path_only():
  """On the rows path a chunk rides in the decode rows' pass, so it waits (within the window) for them; on tinygrad's
  path it runs at once; with no stream decoding it runs at once either way."""
  s, clock = scheduler()
  decoding(s, 0, row=False)
  prompting(s, 7)
  assert not s.ready()
  clock.t += 2 * GATHER_MIN_S  # past the window (step_s not measured yet: the least one)
  assert s.ready()
  plan = s.plan()
  assert plan.decode == [] and plan.prefill[0] == 7 and not plan.mixed
  ref, _ = scheduler(decode_mode="reference")
  decoding(ref, 0, row=False)
  prompting(ref, 7)
  assert ref.ready()
  alone, _ = scheduler()
  prompting(alone, 7)
  assert alone.ready()


def test_micro_batches_gather_and_take_their_share_oldest_first():
  s, _ = scheduler(micro_batches=2)
  for sid, since in ((0, 30), (1, 10), (2, 20)): decoding(s, sid, row=True, since=since)
  decoding(s, 3, row=False)
  assert s.ready()  # 3 of 4 rows here, the micro-batch's share is 2
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [1, 2]  # ceil(4 streams / 2), the longest waiting first
  one, _ = scheduler(micro_batches=2)
  decoding(one, 0, row=True); decoding(one, 1, row=False); decoding(one, 2, row=False)
  assert not one.ready()  # 1 row here, the share is 2


def test_the_first_prefilling_stream_is_the_steps_prompt():
  s, _ = scheduler()
  prompting(s, 5); prompting(s, 3)
  assert s.plan().prefill[0] == 5


def test_a_recurrent_models_waiting_prompts_each_give_a_row_to_the_decode_window():
  """prompt_rows_in_window (a recurrent model on the rows path, where a prompt row is a decode row): one step takes the
  decode rows and the next row of every waiting prompt, so eight prompts advance together instead of one after
  another; each step takes one row of a prompt, and what a stream has left waits for the next step."""
  s, _ = scheduler(prompt_rows_in_window=True, max_chunk=1, min_chunk=1)
  decoding(s, 0, row=True, since=5)
  a, b = prompting(s, 7, n=3), prompting(s, 8, n=2)
  a.waiting_since, b.waiting_since = 1, 2
  decoding(s, 1, row=False)
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [7, 8, 0] and plan.prefill is None and not plan.mixed
  assert [s.next_row(st)[0] for _, st in plan.decode] == [0, 0, 5]
  assert [(p, len(x)) for p, x in a.pending] == [(1, 2)] and [(p, len(x)) for p, x in b.pending] == [(1, 1)]
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [7, 8]
  for _, st in plan.decode: s.next_row(st)
  assert [p for p, _ in a.pending] == [2] and not b.pending
  # a lone prompt at the head goes as a chunk (max_chunk rows); at a later stage a record goes as it came
  lone, _ = scheduler(prompt_rows_in_window=True, max_chunk=16, min_chunk=1, step_s=0.01, last_prefill=(16, 1.0))
  st = prompting(lone, 7, n=40)
  plan = lone.plan()
  assert plan.decode == [] and plan.prefill[0] == 7 and [len(x) for _, x in [lone.next_chunk(st)]] == [16]
  prompting(lone, 8, n=5)
  assert [sid for sid, _ in lone.plan().decode] == [7, 8]  # two prompts: a row of each in one window
  later, _ = scheduler(prompt_rows_in_window=True, max_chunk=16, min_chunk=1, is_head=False, step_s=0.01, last_prefill=(1, 1.0))
  decoding(later, 0, row=True)
  chunk, row = Stream(slot=1, prompt_tokens=40, position=16), Stream(slot=2, prompt_tokens=40, position=1)
  chunk.pending.append((0, np.zeros((16, 4), np.float32))); row.pending.append((0, np.zeros((1, 4), np.float32)))
  later.streams.update({1: chunk, 2: row})
  plan = later.plan()
  assert sorted(sid for sid, _ in plan.decode) == [0, 2] and plan.prefill[0] == 1 and len(later.next_chunk(chunk)[1]) == 16
  off, _ = scheduler(prompt_rows_in_window=True, max_chunk=1, min_chunk=1, decode_mode="reference")
  prompting(off, 7); prompting(off, 8)
  assert off.plan().prefill[0] == 7  # tinygrad's own path: one prompt a step, as before


def test_a_chunk_is_cut_by_the_policy_and_the_rest_waits():
  s, _ = scheduler(step_s=0.1, last_prefill=(16, 0.1))  # 16 rows cost a step: 2 steps' share fits 32
  decoding(s, 0, row=True)
  st = prompting(s, 7, n=100)
  assert s.prefill_size(st) == 32
  pos, x = s.next_chunk(st)
  assert (pos, len(x)) == (0, 32) and [(p, len(r)) for p, r in st.pending] == [(32, 68)]
  s.streams.pop(0)  # no stream decodes: the rest goes in one chunk
  pos, x = s.next_chunk(st)
  assert (pos, len(x)) == (32, 68) and not st.pending


def test_drafted_rows_go_whole():
  s, _ = scheduler(step_s=0.1, last_prefill=(16, 10.0))  # the policy would allow one unit
  decoding(s, 0, row=True)
  st = decoding(s, 1, row=False)
  st.speculative = True
  st.pending.append((5, np.zeros(9, np.uint32)))
  assert s.prefill_size(st) == 16
  pos, x = s.next_chunk(st)
  assert (pos, len(x)) == (5, 9) and not st.pending


def test_a_draft_here_is_its_streams_row_and_is_not_waited_for():
  """A speculative stream's verify record is its next input: a step runs at once, alone or beside the other streams'
  decode rows (a mixed step), instead of waiting out the gather window for a decode row that never comes."""
  s, _ = scheduler(step_s=0.01)
  st = decoding(s, 0, row=False)
  st.speculative = True
  st.pending.append((5, np.zeros(8, np.uint32)))
  assert s.ready() and s.ingress_wait(IDLE_S) == 0.0
  plan = s.plan()
  assert not plan.decode and plan.prefill == (0, st)
  decoding(s, 1, row=True)
  assert s.ready()
  plan = s.plan()
  assert [sid for sid, _ in plan.decode] == [1] and plan.prefill == (0, st) and plan.mixed
  decoding(s, 2, row=False)  # a third stream's row is still on its way: that one is gathered for
  assert not s.ready()


def test_a_mixed_steps_chunk_is_timed_as_what_it_added():
  s, _ = scheduler(step_s=0.1)
  s.note_mixed(32, 0.15, window_ms=80.0)  # the full window decodes in 80 ms: the chunk added 70 ms
  assert s.last_prefill == (32, pytest.approx(0.07)) and s.step_s == pytest.approx(0.8 * 0.1 + 0.2 * 0.08)
  s.note_mixed(16, 0.05, window_ms=None)  # no window timed: the moving average stands in, the share at least 0.1 ms
  assert s.last_prefill == (16, 1e-4)
  s.step_s = 0.0
  s.note_decode(0.02)
  assert s.step_s == 0.02  # the first step sets the average


def test_the_scheduler_loads_no_tinygrad_and_no_numpy():
  code = "import sys, pyruntime.stage.scheduler\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'numpy')))"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
