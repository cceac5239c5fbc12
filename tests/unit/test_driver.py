"""The driver (pyruntime/engine/driver.py) on real rings with no stage process: the test plays the pipeline, reading what the
driver writes to the head ring and answering on the tail's ring as a tail stage would. Slots, the queue, the order of a
stream's records, next tokens grouped as the tail's step was, cancelling."""
from __future__ import annotations

import pathlib
import queue
import struct

import pytest
from tinymodels import TINY_MODELS, write_tiny_gguf

from pyruntime import errors
from pyruntime.engine.driver import Driver, StreamHandle
from pyruntime.engine.events import Delta, Done
from pyruntime.engine.request import Request
from pyruntime.modelfile.gguf import read_header
from pyruntime.params import check_request
from pyruntime.protocol import FLAG_CLOSE, FLAG_END, FLAG_MORE, FLAG_OPEN, decode_json, object_id, split_object_id
from pyruntime.text.tokenizer import Tokenizer
from pyruntime.transport.ring import Arena, RingSpec


class PoolDoubleForUnitTests:
  """A test double for stage_pool.StagePool: no stage fails or stalls; what the tail would be sent is kept."""
  def __init__(self): self.handles, self.sent = [self], []
  def send(self, command: str, **args) -> None: self.sent.append((command, args))
  def first_failure(self): return None
  def stalled(self): return None
  def root_cause(self): return None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
  path = write_tiny_gguf(tmp_path_factory.mktemp("driver") / "m.gguf", **TINY_MODELS["llama_tied"])
  return Tokenizer.from_gguf_kv(read_header(pathlib.Path(path)).kv)


@pytest.fixture
def pipeline(tokenizer):
  """(driver, head reader, tail writer, failures): a running driver over a 2-ring arena, two slots."""
  arena = Arena.create([RingSpec(1 << 16, 4096), RingSpec(1 << 16, 4096)])
  failures: list = []
  d = Driver(arena.writer(0), arena.reader(1), PoolDoubleForUnitTests(), tokenizer=tokenizer, max_streams=2, recipe="r", context_length=64,
             prefix=None, cache_decoded=False, speculative="off", draft_tokens=4, load_s=0.0, on_failure=failures.append)
  d.thread.start()
  head, tail = arena.reader(0), arena.writer(1)
  yield d, head, tail, failures
  d.closed = True
  d.wake(1.0)
  tail.close()
  d.thread.join(5)
  arena.close()


def submit(d: Driver, ids: list[int], max_tokens: int = 8) -> tuple[StreamHandle, queue.SimpleQueue]:
  events: queue.SimpleQueue = queue.SimpleQueue()
  st = StreamHandle(d, next(d.stream_ids), Request(ids, max_tokens, check_request(max_tokens, {}), []), events.put)
  d.enqueue(st)
  return st, events


def take(head, n: int) -> list[tuple[int, int, int, bytes]]:
  """The next n records of the head ring: (stream, position, flags, payload)."""
  out = []
  for _ in range(n):
    rec = head.read(5.0)
    out.append((*split_object_id(rec.object_id), rec.flags, bytes(rec.payload)))
    head.release()
  return out


def answer(tail, sid: int, pos: int, token: int, flags: int = 0) -> None:
  tail.write(object_id(sid, pos), struct.pack("<I", token), flags)


def test_streams_take_the_lowest_free_slot_and_a_third_waits_for_one(pipeline):
  d, head, tail, _ = pipeline
  a, _ = submit(d, [5, 6, 7])
  b, _ = submit(d, [8])
  c, c_events = submit(d, [9, 10])
  recs = take(head, 4)
  assert [(r[0], r[1], r[2]) for r in recs] == [(a.id, 0, FLAG_OPEN), (a.id, 0, 0), (b.id, 0, FLAG_OPEN), (b.id, 0, 0)]
  assert decode_json(recs[0][3])["slot"] == 0 and decode_json(recs[2][3])["slot"] == 1
  assert struct.unpack("<3I", recs[1][3]) == (5, 6, 7) and c.state == "waiting"
  answer(tail, a.id, 2, 0, FLAG_END)  # a's first token is an end token: a finishes, its CLOSE goes out
  (sid, _, flags, _), = take(head, 1)
  assert (sid, flags) == (a.id, FLAG_CLOSE) and c.state == "waiting"  # the slot is free only once the CLOSE comes back
  tail.write(object_id(a.id, 0), b"", FLAG_CLOSE)
  opened = take(head, 2)
  assert (opened[0][0], opened[0][2]) == (c.id, FLAG_OPEN) and decode_json(opened[0][3])["slot"] == 0
  assert c_events.empty()


def test_next_tokens_go_out_as_one_group_like_the_tails_step(pipeline, tokenizer):
  d, head, tail, _ = pipeline
  a, a_events = submit(d, [5])
  b, _ = submit(d, [6])
  take(head, 4)
  t = tokenizer.encode("hello")[0]
  answer(tail, a.id, 0, t, FLAG_MORE)
  answer(tail, b.id, 0, t)
  nxt = take(head, 2)
  assert [(r[0], r[1], r[2]) for r in nxt] == [(a.id, 1, FLAG_MORE), (b.id, 1, 0)]  # the token fed back sits after the prompt
  assert struct.unpack("<I", nxt[0][3]) == (t,)
  ev = a_events.get(timeout=5)
  assert isinstance(ev, Delta) and ev.token_ids == [t]
  assert d.stats()["steps"] == 1 and d.stats()["last_batch"] == 2


def test_a_budget_ends_the_stream_with_length(pipeline, tokenizer):
  d, head, tail, _ = pipeline
  a, events = submit(d, [5, 6], max_tokens=2)
  take(head, 2)
  t = tokenizer.encode("a")[0]
  answer(tail, a.id, 1, t)
  take(head, 1)
  answer(tail, a.id, 2, t)
  (sid, _, flags, _), = take(head, 1)
  assert (sid, flags) == (a.id, FLAG_CLOSE)
  got = [events.get(timeout=5) for _ in range(3)]
  assert isinstance(got[-1], Done) and got[-1].finish_reason == "length" and got[-1].token_ids == [t, t]


def test_cancelling_a_waiting_stream_never_opens_it(pipeline):
  d, head, _, _ = pipeline
  submit(d, [1]); submit(d, [2])
  c, events = submit(d, [3])
  take(head, 4)
  c.cancel()
  done = events.get(timeout=5)
  assert isinstance(done, Done) and done.finish_reason == "cancelled" and c.state == "done" and not d.waiting
  with pytest.raises(errors.RingTimeout): head.read(0.2)


def test_an_answer_for_no_open_stream_fails_the_pipeline_by_name(pipeline):
  d, _, tail, failures = pipeline
  answer(tail, 77, 0, 1)
  d.thread.join(5)
  assert len(failures) == 1 and failures[0].reason == "ResultIdentityMissing"


@pytest.fixture
def budgeted(tokenizer):
  """(driver, head reader, tail writer): three slots, a context of 16 and a kv_budget of 16 positions."""
  arena = Arena.create([RingSpec(1 << 16, 4096), RingSpec(1 << 16, 4096)])
  d = Driver(arena.writer(0), arena.reader(1), PoolDoubleForUnitTests(), tokenizer=tokenizer, max_streams=3, recipe="r", context_length=16,
             prefix=None, cache_decoded=False, speculative="off", draft_tokens=4, load_s=0.0, on_failure=print, kv_budget=16)
  d.thread.start()
  head, tail = arena.reader(0), arena.writer(1)
  yield d, head, tail
  d.closed = True
  d.wake(1.0)
  tail.close()
  d.thread.join(5)
  arena.close()


def test_past_the_kv_budget_the_youngest_stream_is_preempted_and_resumed_with_its_answer(budgeted, tokenizer):
  """Admission counts prompts against the budget (first come, first served: a small prompt does not pass a waiting
  large one); growth past it closes the youngest settled stream, which reopens under a new id once room is back, its
  answer so far as prompt (`resumed`), and finishes as if it had not stopped."""
  d, head, tail = budgeted
  t = tokenizer.encode("a")[0]
  a, _ = submit(d, [1, 2, 3, 4, 5, 6], max_tokens=4)
  b, b_events = submit(d, [7, 8, 9, 10, 11, 12], max_tokens=6)
  c, _ = submit(d, [13, 14, 15, 16, 17])   # 6 + 6 + 5 > 16: waits, though a slot is free
  take(head, 4)
  assert c.state == "waiting" and d.stats()["kv"]["held"] == 12
  for pos in (5, 6):   # two steps: 7 + 7, then 8 + 8 positions fit
    answer(tail, a.id, pos, t, FLAG_MORE); answer(tail, b.id, pos, t)
    assert [(r[0], r[1]) for r in take(head, 2)] == [(a.id, pos + 1), (b.id, pos + 1)]
  answer(tail, a.id, 7, t, FLAG_MORE); answer(tail, b.id, 7, t)   # 9 + 9 > 16: b, the younger, goes
  recs = take(head, 2)
  assert [(r[0], r[1], r[2]) for r in recs] == [(b.id, 0, FLAG_CLOSE), (a.id, 8, 0)] and b.state == "preempted"
  old = b.id
  tail.write(object_id(old, 0), b"", FLAG_CLOSE)   # its CLOSE is back: b waits again, ahead of c; 9 + 9 does not fit
  with pytest.raises(errors.RingTimeout): head.read(0.3)
  assert list(d.waiting) == [b, c] and b.id != old
  answer(tail, a.id, 8, t)   # a's fourth token: done
  assert take(head, 1)[0][:3] == (a.id, 0, FLAG_CLOSE)
  tail.write(object_id(a.id, 0), b"", FLAG_CLOSE)
  recs = take(head, 4)   # b (9 positions) and then c (5) fit
  assert [(r[0], r[2]) for r in recs] == [(b.id, FLAG_OPEN), (b.id, 0), (c.id, FLAG_OPEN), (c.id, 0)]
  info = decode_json(recs[0][3])
  assert (info["prompt_tokens"], info["resumed"], info["history"]) == (9, 3, [7, 8, 9, 10, 11, 12, t, t, t])
  assert struct.unpack("<9I", recs[1][3]) == (7, 8, 9, 10, 11, 12, t, t, t)
  for pos in (8, 9, 10):
    answer(tail, b.id, pos, t)
    if pos < 10: assert take(head, 1)[0][:2] == (b.id, pos + 1)
  events = []
  while not events or not isinstance(events[-1], Done): events.append(b_events.get(timeout=5))
  done = events[-1]
  assert done.token_ids == [t] * 6 and done.usage.prompt_tokens == 6 and done.timings.preempted == 1
  assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 6   # each token once, across the preemption
  assert d.stats()["kv"]["preempted"] == 1 and d.stats()["kv"]["peak"] <= 16


def test_an_oldest_stream_waits_while_the_younger_one_over_the_budget_computes_its_prompt(budgeted, tokenizer):
  """Past the budget with only the oldest stream answered (the younger one's prompt still in the pipeline, so not
  settled: it cannot be closed at a position every stage holds), the oldest's next input is held back; when the
  younger one's first token comes, that one is preempted and the held input goes out."""
  d, head, tail = budgeted
  t = tokenizer.encode("a")[0]
  a, _ = submit(d, [1, 2, 3, 4, 5, 6], max_tokens=8)
  take(head, 2)
  answer(tail, a.id, 5, t)
  assert take(head, 1)[0][:2] == (a.id, 6)
  b, _ = submit(d, [7, 8, 9, 10, 11, 12, 13, 14, 15])   # 7 + 9 = 16: admitted
  assert [r[:3] for r in take(head, 2)] == [(b.id, 0, FLAG_OPEN), (b.id, 0, 0)]
  answer(tail, a.id, 6, t)   # a would hold 8 + 9 > 16; b is computing: a waits
  with pytest.raises(errors.RingTimeout): head.read(0.3)
  assert d.stats()["kv"]["held"] == 16
  answer(tail, b.id, 8, t)   # b's first token: b (the younger) goes, a's held input follows
  recs = take(head, 2)
  assert [r[:3] for r in recs] == [(b.id, 0, FLAG_CLOSE), (a.id, 7, 0)] and struct.unpack("<I", recs[1][3]) == (t,)
  assert b.state == "preempted" and d.stats()["kv"]["peak"] <= 16
