"""A stage's scheduling: when it runs a step and what the step holds.

`StageScheduler` decides over the stage's open streams (each a `Stream`, its rows taken from the ring and not yet
computed): whether to run a step now or wait, a bounded time, to gather more decode rows (`ready`, `ingress_wait`);
what a step holds (`plan`: the decode rows of one micro-batch, one prompt's chunk, both in one pass on the rows path);
and how big a prompt's next chunk is (`next_chunk`, `prefill_size`), from the costs the stage measured (`note_decode`,
`note_mixed`, `note_prefill`). A plain object, no tinygrad and no rings, so its decisions are tested without processes
(tests/unit/test_scheduler.py); the stage executes a plan on its model and writes the results (pyruntime/stage/dataloop.py).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pyruntime.options import PREFILL_SHARE

if TYPE_CHECKING:
  from pyruntime.stage.compute.sampling import Sampler

GATHER_STEPS, GATHER_MIN_S, GATHER_MAX_S = 3.0, 0.005, 1.0  # how long a stage waits for decode rows still on their way
# Where a prompt is cut never changes a number: every prefill chunk of 1..model.chunk tokens runs the same kernels
# (symbolic T), each row reduced in the same order (tests/integration/test_model.py proves it bit for bit), so chunks sized by load
# (StageScheduler.prefill_size, options.PREFILL_SHARE) keep every stream's tokens independent of the others.


@dataclass
class Stream:
  """An open stream at this stage: where its rows stand, the rows waiting to be computed and, at the tail, how its
  tokens are sampled."""
  slot: int
  prompt_tokens: int | None          # None: an OPEN without it; the first record (the whole prompt) then sets it
  position: int = 0                  # the next position expected on ingress
  pending: collections.deque = field(default_factory=collections.deque)  # (position, rows) taken from the ring, not yet computed
  failed: bool = False               # an ERROR went downstream; what still arrives is dropped until the CLOSE
  waiting_since: int = 0             # ring sequence of the oldest record waiting
  sampler: Sampler | None = None
  history: list[int] = field(default_factory=list)
  end_ids: frozenset[int] = frozenset()
  logits: bool = False
  constraint: Any = None             # the tail's grammar matcher of a structured answer (pyruntime/text/grammar.py)
  speculative: bool = False          # records past the prompt may hold drafted rows, and may go back (docs/speculation.md)
  history_base: int = 0              # the tail: history entries before the first generated token
  logprobs: int = -1                 # the tail: k >= 0 answers with TokenScores (protocol.OpenInfo.logprobs)
  score_rows: int = 0                # the tail: > 0 scores every prompt row, in chunks of at most this many rows

  def next_is_decode(self) -> bool: return self.next_is_input() and len(self.pending[0][1]) == 1

  def next_is_input(self) -> bool:
    """What waits first is a row past the prompt: a decode row, or a record of drafted rows to verify."""
    return bool(self.pending) and self.prompt_tokens is not None and self.pending[0][0] >= self.prompt_tokens

  def next_is_prompt_row(self) -> bool:
    """What waits first is part of the prompt (whose next row a recurrent model computes as a decode row)."""
    return bool(self.pending) and self.prompt_tokens is not None and self.pending[0][0] < self.prompt_tokens

  def is_verify(self, pos: int) -> bool:
    """A record of drafted rows past the prompt (computed as a chunk, every row answered at the tail)."""
    return self.speculative and self.prompt_tokens is not None and pos >= self.prompt_tokens

  def scores_prompt(self, pos: int) -> bool:
    """A chunk of a prompt whose every row is scored (prompt_logprobs): every row's logits are needed at the tail."""
    return self.score_rows > 0 and self.prompt_tokens is not None and pos < self.prompt_tokens


@dataclass
class Step:
  """What one step computes."""
  decode: list[tuple[int, Stream]]    # (stream id, stream) with a decode row waiting, oldest waiting first, one micro-batch's share;
                                      # with prompt_rows_in_window, also prompts whose next row this step computes
  prefill: tuple[int, Stream] | None  # the stream whose prompt's next chunk this step computes
  mixed: bool                         # the chunk rides in the decode rows' pass over the weights (the rows path)


class StageScheduler:
  def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
    self.streams: dict[int, Stream] = {}
    self.clock = clock
    # settings: ConfigureRole's, and the model's chunk bounds at LoadWeights (StageModel.max_chunk, min_chunk, is_head)
    self.decode_mode = "batched"
    self.micro_batches = 1
    self.prefill_share = PREFILL_SHARE
    self.max_chunk = self.min_chunk = 1
    self.is_head = True
    # a prompt row is a decode row (a recurrent model on the rows path, StageModel.prompt_rows_in_window): the step takes
    # the next row of every waiting prompt beside the decode rows, so many prompts advance together, each one row a step
    self.prompt_rows_in_window = False
    # measurements
    self.gathering: float | None = None  # since when decode rows are being gathered
    self.step_s = 0.0                    # a decode step's duration here (moving average)
    self.last_prefill: tuple[int, float] | None = None  # the last prefill chunk here: (tokens, seconds)

  def has_work(self) -> bool: return any(st.pending for st in self.streams.values())

  # Gathering: rows come back from the tail in groups; a stage that ran every group as it came would keep them apart for
  # ever (one stream's token, then another's, each a batch of one). So a stage waits, a bounded time, until every
  # stream that is decoding has its next row here (of its micro-batch's share), and runs them as one batch.
  def decoding(self) -> int:
    return sum(1 for st in self.streams.values() if not st.failed and st.prompt_tokens is not None and st.position >= st.prompt_tokens
               and not any(p < st.prompt_tokens for p, _ in st.pending))

  def ready(self) -> bool:
    """Run a step now: enough decode rows are here, or gathering them took long enough, or a prefill chunk waits and
    no stream decodes. On the rows path a chunk waits for the decode rows too (a bounded time): it rides in their step
    (a mixed step) instead of costing a pass over the weights of its own; on tinygrad's path it runs at once."""
    if not self.has_work(): self.gathering = None; return False
    # a decoding stream's next input is here when its decode row is, or its verify record (a draft rides in the step
    # as a chunk): waiting for the row of a stream whose draft is here waits for a row that never comes
    rows, wanted = sum(1 for st in self.streams.values() if st.next_is_input()), -(-self.decoding() // self.micro_batches)
    if rows >= wanted: return True
    # only the head gathers: every row comes back to it from the launcher, so that is where groups merge, and the stages
    # after it take its groups as they come. A later stage that waited too would wait for rows a stage before it holds
    # while that stage waits for the rows this one holds: two groups alternating between two stages, each waiting out
    # its window every step (measured: a 2-stage Gemma 3 270M pipeline, 8 streams, 19 tok/s in that state, 70 without)
    if rows and not self.is_head: return True
    if any(st.pending and not st.next_is_decode() for st in self.streams.values()) and (self.decode_mode != "batched" or not wanted):
      return True
    if self.gathering is None: self.gathering = self.clock()
    return self.gather_left() <= 0

  def gather_left(self) -> float:
    """A round trip of the pipeline brings the missing rows: wait up to a few of this stage's steps for them."""
    budget = min(GATHER_MAX_S, max(GATHER_MIN_S, GATHER_STEPS * self.step_s))
    return budget - (self.clock() - self.gathering) if self.gathering is not None else budget

  def ingress_wait(self, idle_s: float) -> float:
    """How long the next read of the ingress may wait for a record: not at all when a step is ready, `idle_s` when
    nothing is gathered, else no longer than the gathering has left."""
    if self.ready(): return 0.0
    return idle_s if not self.gathering else min(idle_s, self.gather_left())

  def plan(self) -> Step:
    """The next step: every stream with a decode row waiting (oldest first, one micro-batch's share), and one chunk of
    the first stream still prefilling. So a long prompt delays the running streams by at most one chunk per step. With
    prompt_rows_in_window, every waiting prompt's next row instead, beside the decode rows in one window."""
    self.gathering = None
    decode = sorted(((sid, st) for sid, st in self.streams.items() if st.next_is_decode()), key=lambda x: x[1].waiting_since)
    # micro-batches: with stages on devices of their own, a step takes at most 1/micro_batches of the streams, so the
    # groups alternate between stages and every stage computes at once (stages sharing one CPU gain nothing by that)
    cap = -(-len(self.streams) // self.micro_batches)
    if self.prompt_rows_in_window and self.decode_mode == "batched":
      # at the head a prompt goes as chunks only while it is the stage's only work (_row_in_window)
      alone = not self.decoding() and sum(1 for st in self.streams.values() if st.next_is_prompt_row()) == 1
      rows = sorted(((sid, st) for sid, st in self.streams.items() if st.next_is_decode() or self._row_in_window(st, alone)),
                    key=lambda x: x[1].waiting_since)[:cap]
      taken = {sid for sid, _ in rows}  # what is left goes as a chunk: a lone prompt's, a chunk from the stage before
      prefill = next(((sid, st) for sid, st in self.streams.items() if st.pending and sid not in taken and not st.next_is_decode()), None)
      return Step(rows, prefill, False)
    prefill = next(((sid, st) for sid, st in self.streams.items() if st.pending and not st.next_is_decode()), None)
    # on the rows path a prompt's chunk rides in the decode step's pass over the weights (the same bits either way)
    return Step(decode[:cap], prefill, bool(decode and prefill and self.decode_mode == "batched"))

  def _row_in_window(self, st: Stream, alone: bool) -> bool:
    """Whether `st`'s prompt gives its next row to the step's window (prompt_rows_in_window), or goes as a chunk
    (max_chunk rows of one stream, about twice a row's worth in the window per row, but a step of its own): at the head,
    a prompt goes as chunks only while it is the stage's only work (`alone`: no stream decodes, no other prompt waits: a chunk
    would hold their step back for many steps' time); a later stage computes what comes as it comes (a chunk the head
    sent as a chunk, a row as a row)."""
    if not st.next_is_prompt_row(): return False
    return len(st.pending[0][1]) == 1 if not self.is_head else not alone

  def next_chunk(self, st: Stream) -> tuple[int, Any]:
    """Take the next piece of `st`'s prompt to compute: (its first position, its rows), sized by prefill_size. Called
    when the step computes it: the decode rows of the same step, computed first, may have changed what it fits."""
    pos, x = st.pending[0]
    n = self.chunk_rows(st)
    if n == len(x): st.pending.popleft()
    else: st.pending[0] = (pos + n, x[n:])
    return pos, x[:n]

  def next_row(self, st: Stream) -> tuple[int, Any]:
    """Take `st`'s next row, a decode row or its prompt's next (prompt_rows_in_window): (its position, the row)."""
    pos, x = st.pending[0]
    if len(x) == 1: st.pending.popleft()
    else: st.pending[0] = (pos + 1, x[1:])
    return pos, x[:1]

  def chunk_rows(self, st: Stream) -> int:
    """Rows of `st`'s next chunk, were it taken now (next_chunk takes it)."""
    pos, x = st.pending[0]
    n = len(x) if st.is_verify(pos) else min(len(x), self.prefill_size(st))  # drafted rows go whole: each needs its answer
    return min(n, st.score_rows) if st.scores_prompt(pos) else n  # every row's logits: as many rows as the tail's graph keeps

  def prefill_size(self, st: Stream) -> int:
    """Tokens of `st`'s next prefill chunk: the model's largest chunk when no stream decodes here or prefill_share is 0;
    beside decoding streams, as many tokens as cost about `prefill_share` of their step (on the rows path: what the
    chunk adds to the step it rides in), judged by the last chunk (the smallest chunk until a step and a chunk were
    timed). A chunk that came in under that grows by at least one token: a chunk's fixed cost (on a GPU, most of it)
    makes a per-token figure from a small chunk too dear, and the sizes must still find the right one. On tinygrad's
    path a prompt that fits in one chunk goes whole (its 32 tokens cost about a step)."""
    chunk, unit = self.max_chunk, self.min_chunk
    if not self.prefill_share or not self.decoding() or self.prompt_rows_in_window: return chunk  # (_row_in_window decided)
    if unit == 1 and (st.prompt_tokens or 0) <= chunk: return chunk
    # on the rows path the head sizes a prompt's chunks and the stages after it compute them as they come (cut again,
    # a chunk would ride in several steps of theirs)
    if unit > 1 and not self.is_head: return chunk
    if not (self.step_s and self.last_prefill): return unit
    n, seconds = self.last_prefill
    target = self.prefill_share * self.step_s
    fit = int(n * target / seconds) if seconds > 0 else chunk
    if unit > 1:  # timed as what it added to its step (note_mixed), not in a lull: what fits, in whole units of rows
      return max(unit, min(chunk, fit) // unit * unit)
    # growing: at least one token more, at most twice as many (one quick chunk, timed in a lull, must not bring a
    # chunk that costs many steps); shrinking: to what fits at the last chunk's cost
    return max(1, min(chunk, max(n + 1, min(fit, 2 * n)) if seconds < target else fit))

  def note_prefill(self, n: int, seconds: float) -> None: self.last_prefill = (n, seconds)

  def note_decode(self, seconds: float) -> None:
    self.step_s = 0.8 * self.step_s + 0.2 * seconds if self.step_s else seconds

  def note_mixed(self, n: int, seconds: float, window_ms: float | None) -> None:
    """A mixed step of a chunk of `n` rows took `seconds`; `window_ms`: a decode step of the full window (every slot),
    timed at warm-up (None: not timed, the moving average stands in)."""
    # the chunk's share: what the step took beyond a decode step of the same window
    decode_s = (1e3 * self.step_s if window_ms is None else window_ms) / 1e3
    self.note_prefill(n, max(1e-4, seconds - decode_s))
    # while prompts keep coming every step is mixed: the decoding streams' step without the chunk is decode_s
    self.note_decode(decode_s)
