"""The driver: the launcher's token loop. One thread reads the tail's ring and closes every stream's loop (text, stop
strings, budget, next token), so a stream never waits on its consumer's thread being scheduled; it owns the slots and
the queue of streams waiting for one.

Head writes come from the driver thread and from submit/cancel, under `Driver.lock`, which also guards the slots and
the queue: per stream the head ring sees OPEN, data..., CLOSE in that order. No write can wait on the driver: the rings
hold every record that all streams can have in flight at once (protocol.ring_bytes).
"""
from __future__ import annotations

import collections
import itertools
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pyruntime import errors, protocol
from pyruntime.engine.events import Delta, Done, Logits, Timings, Usage
from pyruntime.engine.prefix_cache import BLOCK, PrefixIndex
from pyruntime.engine.speculation import MIN_ACCEPTED, POSITIONS, PROBE_EVERY, SOLO_STREAMS, Drafting, DraftLength, ngram_draft, prediction_draft
from pyruntime.protocol import FLAG_CACHE, FLAG_CLOSE, FLAG_END, FLAG_ERROR, FLAG_MORE, FLAG_OPEN, MAX_VERIFY_ROWS, object_id, split_object_id
from pyruntime.text.tools import ToolCallParser

if TYPE_CHECKING:
  from pyruntime.engine.request import Request
  from pyruntime.engine.stage_pool import StagePool
  from pyruntime.text.tokenizer import Tokenizer
  from pyruntime.text.tools import ToolCall
  from pyruntime.transport.ring import Reader, Writer

log = logging.getLogger("pyruntime.launcher")

HEAD_WRITE_SLICE_S = 0.05  # how long a head write waits before it looks at the stages' health again
DRIVER_WAKE_S = 0.5    # the driver's backstop: a token, a closed or dead tail ring and close() wake it at once
RATE_WINDOW_S = 5.0    # tokens/s in stats() is measured over this window


class StreamHandle:
  """One stream: its request, its text state and where its events go. Its methods but `cancel` run under the driver's
  lock, on the driver thread."""

  def __init__(self, driver: Driver, sid: int, req: Request, sink: Callable[[Any], None], leader: StreamHandle | None = None):
    from pyruntime.text.textstream import StopStream
    from pyruntime.text.tokenizer import IncrementalDecoder
    self.driver, self.id, self.req, self.sink = driver, sid, req, sink
    # another choice of the same request (OpenAI's n): this one waits in the queue until the leader's prompt is in the
    # prefix cache, then reads it from there instead of computing it again
    self.leader = leader if driver.reads_cache(req) else None
    self.ids, self.n_max, self.params, self.want_logits, self.end_ids = req.ids, req.n_max, req.params, req.want_logits, req.end_ids
    self.stopper, self.decoder = StopStream(req.stops), IncrementalDecoder(driver.tokenizer)
    self.parser = ToolCallParser(req.calls) if req.calls is not None else None  # reads tool calls out of the text
    self.calls: list[ToolCall] = []
    self.spec = Drafting(driver.draft_length() if req.speculate else None, req.predicted)
    self.sink_failed = False  # its callback raised once (logged)
    self.cached = 0     # prompt positions copied in from the prefix cache
    self.computed = 0   # positions every stage has computed: the tail answered them
    self.held = 0       # positions its slot holds once what was written to the head is computed (the kv_budget's count)
    self.arrival = sid  # its place in arrival order (its id changes when it is resumed): the youngest is preempted first
    self.preempted = 0  # times it was preempted (and resumed)
    # state: waiting -> open -> closing -> done; open -> preempted (its CLOSE out) -> waiting again once the CLOSE is back
    self.slot, self.state, self.ended = -1, "waiting", False
    self.out: list[int] = []
    self.text: list[str] = []
    self.k = req.logprobs  # >= 0: the tail answers with TokenScores of the top k
    self.scores: list[protocol.TokenScore] = []         # the generated tokens' (with logprobs)
    self.prompt_scores: list[protocol.TokenScore] = []  # the prompt's tokens after the first (with prompt_logprobs)
    self.t_submit = time.monotonic()
    self.t_admitted: float | None = None
    self.t_first: float | None = None
    self.t_last: float | None = None

  def follows(self) -> bool:
    """Waits for its leader's prompt (it still runs and has not answered it yet)."""
    ld = self.leader
    if ld is not None and (ld.state == "done" or ld.state == "closing" or ld.computed >= len(ld.ids)): self.leader = ld = None
    return ld is not None

  def cancel(self) -> None:
    """Stop this stream: a waiting one leaves the queue, a running one is closed in every stage. Idempotent."""
    self.driver.cancel(self)

  def emit(self, ev: Any) -> None:
    d = self.driver
    if d.outbox is not None and threading.get_ident() == d.outbox_owner: d.outbox.append((self, ev))
    else: self.deliver(ev)

  def deliver(self, ev: Any) -> None:
    # whatever a consumer's callback raises (KeyboardInterrupt, SystemExit too) must not end the driver thread, which
    # every other stream depends on
    try: self.sink(ev)
    except BaseException as e:  # noqa: BLE001
      if not self.sink_failed:  # once per stream: a callback that raises on every event would flood the log
        self.sink_failed = True
        log.warning("stream %d: its on_event callback raised %s: %s (dropped, and any later ones)", self.id, type(e).__name__, e)

  def push(self, token: int, end: bool, now: float | None = None, score: protocol.TokenScore | None = None) -> bool:
    """One sampled token (that arrived at `now`, monotonic; `score`: its TokenScore, with logprobs); True when the
    stream is finished (its Done went out)."""
    self.t_last = time.monotonic() if now is None else now
    if self.t_first is None: self.t_first = self.t_last
    if self.n_max == 0: return self.finish("length", None)  # a scored prompt alone (max_tokens 0): the prompt was the work
    if end: return self.finish("stop", None)
    self.out.append(token)
    if score is not None: self.scores.append(score)
    safe, stop_hit = self.stopper.push(self.decoder.push(token))
    d = self._delta(safe, [token], [score] if score is not None else [])
    if len(self.out) == 1: d.prompt_token_ids, d.prompt_logprobs = self.ids, self.prompt_scores if self.req.prompt_logprobs else None
    self.emit(d)  # "" while held back (a possible stop string, half a UTF-8 character or marker)
    if stop_hit is not None: return self.finish("stop", stop_hit)
    if len(self.out) >= self.n_max: return self.finish("length", None)
    return False

  def finish(self, reason: str, stop_hit: str | None) -> bool:
    if stop_hit is None:
      if rest := self.stopper.flush(self.decoder.flush()): self.emit(self._delta(rest, []))
      if self.stopper.matched is not None: reason, stop_hit = "stop", self.stopper.matched  # the last bytes completed a stop string
    if self.parser is not None and ((d := self._delta("", [], None, last=True)).text or d.tool_calls): self.emit(d)
    # calls and nothing after them: the answer was the calls, also where the budget cut only a closing marker
    if self.calls and (reason == "stop" or (reason == "length" and d.tool_calls and not d.text.strip())): reason = "tool_calls"
    self.emit(self.final(reason, stop_hit))
    return True

  def _delta(self, text: str, token_ids: list[int], scores: list[protocol.TokenScore] | None = None, last: bool = False) -> Delta:
    """The Delta of newly final text: with tools offered, the parser takes the calls out of it (`last`: and what it
    still holds, an unclosed span as text)."""
    calls: list[ToolCall] = []
    if self.parser is not None:
      text, calls = self.parser.feed(text)
      if last: text, calls = text + (fin := self.parser.finish())[0], calls + fin[1]
      self.calls += calls
    if text: self.text.append(text)
    return Delta(text, token_ids, calls, scores or [])

  def final(self, reason: str, stop_hit: str | None = None) -> Done:
    """The stream's one Done, its timings up to now: the stream has ended."""
    now, out = time.monotonic(), self.out
    t0, t_first, t_last = self.t_submit, self.t_first or now, self.t_last or now
    decode = (len(out) - 1) / (t_last - t_first) if len(out) > 1 and t_last > t_first else 0.0
    timings = Timings(round(self.driver.load_s, 4), round(t_first - t0, 4), round(decode, 3), round(now - t0, 4),
                      round((self.t_admitted or t0) - t0, 4), self.spec.rounds, self.spec.drafted, self.spec.accepted,
                      self.preempted)
    self.ended = True
    # rejected, as OpenAI counts it: the prediction's tokens that did not make it into the answer (not only the drafted
    # ones the model refused: a prediction it never followed is all rejected)
    kept = self.spec.prediction_kept
    usage = Usage(len(self.ids), len(out), self.cached, kept, max(0, len(self.spec.predicted) - kept))
    return Done(reason, usage, timings, self.ids, list(out), "".join(self.text), stop_hit,
                list(self.calls), list(self.scores) if self.k >= 0 else None,
                list(self.prompt_scores) if self.req.prompt_logprobs else None)

  def fail(self, e: BaseException) -> None:
    if not self.ended:
      self.ended = True
      self.emit(e)
    if self.state != "closing": self.state = "done"

  def closed(self) -> None: self.state = "done"



@dataclass
class Tally:
  """What the driver counts: tokens out, the tail's steps (a group of records chained by MORE is one step) and their
  rows, speculation's rounds, and its own time per token (between a token's arrival and the next write; on a loaded
  machine it includes being preempted by the stage just woken)."""
  tokens: int = 0
  steps: int = 0
  step_rows: int = 0
  last_batch: int = 0
  group: int = 0           # token records seen of the tail's current step
  token_times: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
  overhead: dict = field(default_factory=lambda: {"tokens": 0, "seconds": 0.0})
  spec: dict = field(default_factory=lambda: {"rounds": 0, "drafted": 0, "accepted": 0, "drafted_at": [0] * POSITIONS,
                                               "accepted_at": [0] * POSITIONS})
  preempted: int = 0       # streams preempted for the kv_budget (each resumed later)
  kv_peak: int = 0         # the most positions the open streams held at once (the kv_budget's count)
  recent_accepted: float = 2 * MIN_ACCEPTED  # tokens kept per round, a moving average over every stream's rounds
  probe_wait: int = PROBE_EVERY             # the wait before a probe, as the latest stream's rounds left it

  def step_record(self, flags: int) -> None:
    self.group += 1
    if not flags & FLAG_MORE:  # the last record of the tail's step
      self.steps, self.step_rows, self.last_batch, self.group = self.steps + 1, self.step_rows + self.group, self.group, 0

  def round(self, drafted: int, accepted: int) -> None:
    self.recent_accepted = 0.75 * self.recent_accepted + 0.25 * accepted
    for key, n in (("rounds", 1), ("drafted", drafted), ("accepted", accepted)): self.spec[key] += n
    for j in range(drafted):  # per draft position: how far into a draft the model still agrees
      self.spec["drafted_at"][j] += 1
      self.spec["accepted_at"][j] += j < accepted


class Driver:
  """The streams of a running pipeline: admitted into slots, their records written to the head ring, their tokens read
  from the tail's ring on the driver thread (`run`). Failures go to `on_failure` (the launcher ends the pipeline).
  About 400 lines: the token loop with its speculative verification and the kv_budget's preemption, whose state the
  lock guards together."""

  def __init__(self, head: Writer, tail: Reader, pool: StagePool, *, tokenizer: Tokenizer, max_streams: int, recipe: str,
               context_length: int, prefix: PrefixIndex | None, cache_decoded: bool, speculative: str, draft_tokens: int,
               load_s: float, on_failure: Callable[[errors.StageFailed], Any], drafter: Any = None, kv_budget: int = 0):
    self.head, self.tail, self.pool, self.on_failure = head, tail, pool, on_failure
    self.tokenizer, self.max_streams, self.recipe, self.context_length = tokenizer, max_streams, recipe, context_length
    self.prefix, self.cache_decoded, self.load_s = prefix, cache_decoded, load_s
    self.kv_budget = kv_budget  # positions all open streams' slots may hold together (0: no bound but the slots')
    # drafter: a draft model's (drafter.ModelDrafter), which drafts in place of n-grams
    self.speculative, self.draft_tokens, self.drafter = speculative, draft_tokens, drafter
    self.min_accepted = MIN_ACCEPTED  # what a verify round must keep to pay (the launcher sets it for recurrent stages)
    self.lock = threading.Lock()          # the head ring's producer side, the slots and the queue
    # held (before self.lock, never under it) while events go out to consumers, outside self.lock: a callback may
    # call submit() or cancel() (which take self.lock), and a cancelled stream's Done cannot overtake its last Delta
    self.delivering = threading.RLock()
    self.stream_ids = itertools.count(1)
    self.free_slots = list(range(max_streams))
    self.waiting: collections.deque[StreamHandle] = collections.deque()
    self.active: dict[int, StreamHandle] = {}
    self.next: list[tuple[StreamHandle, int, list[int]]] = []  # next tokens of the tail's current step, written when it is complete
    self.parked: list[tuple[StreamHandle, int, list[int]]] = []  # next tokens held back for the kv_budget (_within_budget)
    # the driver's events of the tail's current step, handed out (still under the lock, so in order with every other
    # event) once the step's next tokens are written: the stages start sooner, and a consumer woken by its event finds
    # the GIL free more often (the driver blocks on the ring right after), instead of waking twice
    self.outbox: list[tuple[StreamHandle, Any]] | None = None
    self.outbox_owner = -1                # the thread that set the outbox (and holds the lock)
    self.closed = False                   # set by the launcher's close(): no new streams, the loop ends
    self.tally = Tally()
    # A token comes every step (ms at least): spinning for it only takes a core from the stages. Parked, the ring
    # checks the tail stage's liveness (a kill and a /proc read, costly on cold caches) only every DRIVER_WAKE_S: a
    # stage that dies closes its rings or is seen by its neighbours, which close theirs, so the driver learns at once;
    # this check (with the pool's first_failure at each DRIVER_WAKE_S timeout) is only the backstop for a killed tail.
    tail.set_wait(spin=0.0, poll=DRIVER_WAKE_S)
    self.thread = threading.Thread(target=self.run, name="launcher-driver", daemon=True)

  def draft_length(self) -> DraftLength:
    """A new stream's draft length. With prompt lookup it drafts from its start (a draft costs nothing until one is
    found); with a draft model (whose drafts cost steps of their own) it starts where the drafter's recent rounds over
    every stream left off: drafting while they paid, else probing after the wait the last stream's probes grew to."""
    # where a round is dear (recurrent stages: min_accepted above MIN_ACCEPTED) a probe that fails costs several steps,
    # so probes that do not pay grow rarer, as a draft model's do
    if self.drafter is None: return DraftLength(self.draft_tokens, min_accepted=self.min_accepted, backoff=self.min_accepted > MIN_ACCEPTED)
    return DraftLength(self.draft_tokens, self.tally.recent_accepted >= self.min_accepted, self.tally.probe_wait, backoff=True,
                       min_accepted=self.min_accepted)

  # --- streams in --------------------------------------------------------------------------------
  def enqueue(self, st: StreamHandle) -> None:
    box: list[tuple[StreamHandle, Any]] = []
    with self.delivering:
      try:
        with self.lock:
          if self.closed: raise errors.LauncherClosed("the launcher is not running")
          self.waiting.append(st)
          self.outbox, self.outbox_owner = box, threading.get_ident()  # a stream failed on admission learns of it after the lock
          try: self._admit()
          finally: self.outbox = None
      finally:
        for s, ev in box: s.deliver(ev)

  def _admit(self) -> None:
    """Under self.lock: waiting streams into free slots. A stream whose records cannot be built fails alone, before
    anything of it reaches a stage, and its slot goes to the next; only a failed write (the pipeline's) raises."""
    while self.free_slots and (st := next((s for s in self.waiting if not s.follows()), None)) is not None:
      if self.kv_budget and self.held() + len(st.ids) + len(st.out) > self.kv_budget: break  # first come, first served
      self.waiting.remove(st)
      st.slot = self.free_slots.pop(0)  # the lowest free slot: a batch spans rows 0..highest slot in use
      try: records = self._open_records(st)
      except Exception as e:  # noqa: BLE001 - one request's bug must not take the slot, the queue or the driver with it
        log.exception("stream %d: failed before it reached the stages", st.id)
        self.free_slots.append(st.slot); self.free_slots.sort()
        st.slot = -1
        st.fail(errors.RequestFailed("admitting it", e))
        continue
      st.state = "open"
      self.active[st.id] = st
      self.tally.kv_peak = max(self.tally.kv_peak, self.held())
      if st.t_admitted is None: st.t_admitted = time.monotonic()
      # the grammar goes to the tail directly, before the OPEN: the tail waits for it when the OPEN says there is one
      if st.req.grammar is not None: self.pool.handles[-1].send(protocol.Command.SET_GRAMMAR, stream=st.id, grammar=st.req.grammar)
      for oid, payload, flags in records: self._write(oid, payload, flags)

  def held(self) -> int:
    """Under self.lock: the positions the open streams' slots hold, as the kv_budget counts them. A closing (or
    preempted) stream's CLOSE is in the head ring already: every stage frees its slot before it takes any record written
    after, so its positions count no more."""
    return sum(s.held for s in self.active.values() if s.state == "open")  # every step: no list built

  def reads_cache(self, req: Request) -> bool:
    """The request's prompt may come from the prefix cache. A scored prompt computes every row (a cached row's logits
    are not kept): it fills the cache but never reads it."""
    return self.prefix is not None and req.prefix_cache and not req.prompt_logprobs

  def _open_records(self, st: StreamHandle) -> list[tuple[int, bytes, int]]:
    """The stream's OPEN and prompt records, built whole before any is written (a failure here leaves no trace). A
    resumed stream's prompt is its prompt and its answer so far (`resumed`: the tail replays the answer's sampler draws
    and grammar steps); its scored rows were answered before it was preempted."""
    resumed = len(st.out)
    tokens = st.ids + st.out if resumed else st.ids
    reads = self.prefix is not None and st.req.prefix_cache if resumed else self.reads_cache(st.req)
    blocks = self.prefix.match(tokens, st.req.cache_salt) if reads else []
    cached = len(blocks) * BLOCK
    state = self.prefix.state_of(blocks[-1]) if blocks else None
    info = protocol.OpenInfo(st.slot, len(tokens), {"request": st.id, "recipe": self.recipe}, st.params.to_dict(), tokens,
                             sorted(st.end_ids), st.want_logits, cached, [[b, i * BLOCK] for i, b in enumerate(blocks)],
                             st.req.grammar is not None, st.spec.length is not None, st.k, st.req.prompt_logprobs and not resumed,
                             state, resumed)
    rest = tokens[cached:]
    records = [(object_id(st.id, 0), info.encode(4), FLAG_OPEN), (object_id(st.id, cached), struct.pack(f"<{len(rest)}I", *rest), 0)]
    if not resumed: st.cached = cached  # the request's usage counts its first admission's cached positions
    st.computed, st.held = cached, len(tokens)
    return records

  def cancel(self, st: StreamHandle) -> None:
    """A stream that has not ended gets its one final event here, a Done with finish reason "cancelled", delivered from
    the cancelling thread (no Delta of it follows: the driver passes over a stream that is not open)."""
    box: list[tuple[StreamHandle, Any]] = []
    with self.delivering:
      with self.lock:
        if st.state == "waiting":
          self.waiting.remove(st)
          st.state = "done"
          if self.waiting and not self.closed:  # choices that waited for it go their own way
            self.outbox, self.outbox_owner = box, threading.get_ident()
            try: self._admit()
            finally: self.outbox = None
        elif st.state == "open" and not self.closed:
          self._close_stream(st, settled=False)  # its next token may be in flight
        elif st.state == "preempted": st.state = "closing"  # its CLOSE is out: it is not resumed
        else: return
        done = None if st.ended else st.final("cancelled")
      if done is not None: st.deliver(done)
      for s, ev in box: s.deliver(ev)

  def _close_stream(self, st: StreamHandle, save: bool = True, settled: bool = True) -> None:
    """Under self.lock: what the stream computed goes to the prefix cache, then the CLOSE goes out; the slot is free
    when its echo comes back (nothing of it is in flight then). `settled`: no record of the stream is in flight."""
    st.state = "closing"
    try:
      if save: self._save_prefix(st, st.computed if self.cache_decoded else min(st.computed, len(st.ids)), settled)
    finally: self._write(object_id(st.id, 0), b"", FLAG_CLOSE)  # whatever saving raised, the slot comes back

  def _save_prefix(self, st: StreamHandle, n: int, settled: bool = True) -> None:
    """Under self.lock: index the stream's first n positions (computed in every stage) and tell the stages which blocks
    to fill with them, in ring order (pyruntime/engine/prefix_cache.py). With recurrent blocks, only a settled stream
    (every stage holds exactly its n positions, so each kept the state at the last full block's end) saves, with that
    state: a position in flight may have moved a stage's state past that boundary."""
    if self.prefix is None or not st.req.prefix_cache or n < BLOCK or (self.prefix.states and not settled): return
    tokens = (st.ids + st.out)[:n]  # the token at position len(ids) + k is out[k], which was fed back
    pairs = self.prefix.insert(tokens, st.req.cache_salt)
    # the state goes at the last boundary before the last position: a request repeating these tokens (a choice of `n`,
    # a retry) computes at least its last one, so it can start there
    at = (n - 1) // BLOCK * BLOCK
    state = self.prefix.attach_state(tokens[:at], st.req.cache_salt)
    if pairs or state is not None:
      save = {"save": [list(p) for p in pairs], **({"state": [state, at]} if state is not None else {})}
      self._write(object_id(st.id, 0), protocol.encode_json(save, 4), FLAG_CACHE)

  # --- the loop ----------------------------------------------------------------------------------
  def run(self) -> None:
    read = self.tail.read
    try:
      while not self.closed:
        # Parked in C between tokens: a failure elsewhere reaches the tail ring as RingClosed/PeerDead; a dead or
        # stalled stage is seen here at the latest DRIVER_WAKE_S on
        try: rec = read(DRIVER_WAKE_S)
        except errors.RingTimeout:
          if (f := self.pool.first_failure() or self._stalled()) is not None: raise f from None
          continue
        self._take_step(rec, time.monotonic())
    except errors.PyruntimeError as e:
      if not self.closed:
        f = self.pool.root_cause() or (e if isinstance(e, errors.StageFailed) else errors.StageFailed(len(self.pool.handles) - 1, e.code, str(e)))
        self.on_failure(f)  # the pipeline goes down, then every stream learns which stage failed
    except Exception as e:  # noqa: BLE001 - a bug outside any one stream: nothing can be served without this thread
      log.exception("the launcher's driver failed")
      if not self.closed: self.on_failure(errors.DriverFailed(e))
    finally:
      # a close() under way fails the streams itself, once the stages are gone
      if not self.closed: self.fail_all(errors.LauncherClosed("the launcher closed while the stream ran"))

  def _take_step(self, rec: Any, t_got: float) -> None:
    """The tail's step, from its first record: taken under the lock once (it publishes a MORE group at once), its
    events delivered after."""
    tokens, box = 0, []
    with self.delivering:
      try:
        with self.lock:
          self.outbox, self.outbox_owner = box, threading.get_ident()
          try:
            while True:
              tokens += self._take(rec, t_got)
              if not rec.flags & FLAG_MORE: break
              try: rec = self.tail.read(0)
              except errors.WouldBlock: break  # the rest of the group is not out yet: wait for it unlocked
          finally: self.outbox = None
      finally:
        for st, ev in box: st.deliver(ev)
    self.tail.release()
    if tokens:
      self.tally.overhead["tokens"] += tokens
      self.tally.overhead["seconds"] += time.monotonic() - t_got

  def _stalled(self) -> errors.StageStalled | None:
    """The stall rule is checked only while streams are in the pipeline (the driver waits on them)."""
    with self.lock:
      if not self.active: return None
    return self.pool.stalled()

  # --- one step's records ------------------------------------------------------------------------
  def _take(self, rec: Any, now: float) -> int:
    """Under self.lock: one record from the tail (that arrived at `now`); 1 for a token, else 0."""
    sid, pos = split_object_id(rec.object_id)
    st = self.active.get(sid)
    if st is None: raise errors.ResultIdentityMissing(f"the tail answered {rec.object_id:#x} (flags {rec.flags}), a stream not open")
    flags = rec.flags
    if flags & FLAG_CLOSE:
      del self.active[sid]
      self.free_slots.append(st.slot); self.free_slots.sort()
      if st.state == "preempted": self._requeue(st)
      else: st.closed()
      self._admit()
      if self.parked and not self.next: self._flush_next()  # the stream that held them back failed or was cancelled
    elif flags & (FLAG_OPEN | FLAG_CACHE): pass  # echoes: the tail bound the stream, or filled its blocks
    elif flags & FLAG_ERROR:
      info = protocol.decode_json(rec.payload)
      if st.state == "open":
        st.fail(errors.StreamFailed(info.get("stage"), str(info.get("reason")), str(info.get("message"))))
        self._close_stream(st, save=False)
    else:
      self.tally.step_record(flags)
      if st.state == "open":
        try: self._step(st, rec, pos, now)
        except errors.PyruntimeError: raise  # the pipeline's (a failed write): every stream's
        except Exception as e:  # noqa: BLE001 - a bug in one stream's text, tools or drafts ends that stream alone
          log.exception("stream %d: failed taking its token", st.id)
          if st.state == "open": self._close_stream(st, save=False)
          st.fail(errors.RequestFailed("taking its tokens", e))
      if not flags & FLAG_MORE: self._flush_next()
      return 1
    return 0

  def _step(self, st: StreamHandle, rec: Any, pos: int, now: float) -> None:
    """A token (or logits) for a running stream: text out, and either the next token in or the stream's end."""
    if st.want_logits:
      values = rec.array("<f4").copy()
      st.emit(Logits(pos, values))
      token = int(values.argmax())
      end = token in st.end_ids
    elif st.k >= 0:
      score = protocol.read_logprob_payload(rec.payload, st.k)
      if pos < len(st.ids) - 1: return st.prompt_scores.append(score)  # a scored prompt's row: the answer comes after
      if not self._commit(st, pos, score.token, bool(rec.flags & FLAG_END), now, score): self._queue_next(st, score.token)
      return None
    else:
      token, end = int.from_bytes(rec.payload[:4], "little"), bool(rec.flags & FLAG_END)
    if st.spec.verify is not None: return self._verified(st, pos, token, end, now)
    if not self._commit(st, pos, token, end, now): self._queue_next(st, token)

  def _commit(self, st: StreamHandle, pos: int, token: int, end: bool, now: float, score: protocol.TokenScore | None = None) -> bool:
    """The token after position `pos` is the stream's: text out; True when that finished it (Done went out)."""
    self.tally.tokens += 1
    self.tally.token_times.append(now)
    first = st.computed < len(st.ids)
    st.computed = pos + 1
    if first:
      self._save_prefix(st, len(st.ids))  # the prompt is in every stage: streams arriving meanwhile can share it
      if self.waiting: self._admit()      # the choices that waited for it (their OPENs follow its CACHE record)
    if st.push(token, end, now, score):
      self._close_stream(st)  # finished: free the slot
      return True
    return False

  def _queue_next(self, st: StreamHandle, token: int) -> None:
    """The stream's next input: its last token, and with speculation a draft after it (pyruntime/engine/speculation.py) when
    the pipeline is not busy with other streams and the budget and context have room."""
    q = len(st.ids) + len(st.out) - 1  # the last token's position
    drafts: list[int] = []
    sp = st.spec
    if sp.length is not None and len(self.active) <= SOLO_STREAMS:
      k = min(sp.length.next(), st.n_max - len(st.out) - 1, self.context_length - q - 2, MAX_VERIFY_ROWS - 1)
      drafts = prediction_draft(st.out, sp.predicted, k)
      sp.from_prediction = bool(drafts)
      if not drafts and k > 0:
        if self.drafter is not None: drafts = self.drafter.draft(st.ids + st.out, k)
        elif self.speculative == "ngram": drafts = ngram_draft(st.ids + st.out, k)
    if drafts: sp.verify = (q, drafts, {})
    self.next.append((st, object_id(st.id, q), [token, *drafts]))

  def _verified(self, st: StreamHandle, pos: int, token: int, end: bool, now: float) -> None:
    """One answer to a speculative record; once every row's is in: the tokens up to the first draft the model did not
    agree with are the stream's, that one included (plain decoding's tokens), and the next input follows them."""
    sp = st.spec
    q, drafts, got = sp.verify
    got[pos] = (token, end)
    if len(got) < len(drafts) + 1: return
    sp.verify, accepted = None, 0
    for i in range(len(drafts) + 1):
      token, end = got[q + i]
      if self._commit(st, q + i, token, end, now): break
      if i < len(drafts) and token == drafts[i]: accepted += 1
      else: break
    sp.kept(len(drafts), accepted)
    self.tally.probe_wait = sp.length.wait
    self.tally.round(len(drafts), accepted)
    if st.state == "open": self._queue_next(st, token)

  def _flush_next(self) -> None:
    """The tail's step is complete: its streams' next tokens go to the head as one group (MORE on all but the last),
    so the head computes them as one batch again instead of waking on the first and taking a batch of one."""
    # a stream cancelled meanwhile is CLOSEd
    nxt = [(st, oid, toks) for st, oid, toks in self.parked + self.next if st.state == "open"]
    self.next.clear(); self.parked.clear()
    for st, oid, toks in nxt: st.held = split_object_id(oid)[1] + len(toks)
    held = self.held()
    if self.kv_budget and held > self.kv_budget:
      nxt = self._within_budget(nxt, held - self.kv_budget)
      held = self.held()
    self.tally.kv_peak = max(self.tally.kv_peak, held)
    for i, (_, oid, toks) in enumerate(nxt): self._write(oid, struct.pack(f"<{len(toks)}I", *toks), FLAG_MORE if i < len(nxt) - 1 else 0)

  def _within_budget(self, nxt: list[tuple[StreamHandle, int, list[int]]], over: int) -> list[tuple[StreamHandle, int, list[int]]]:
    """Under self.lock, with the step's next inputs (`nxt`) past the kv_budget: first their drafts go (a round without
    them), then the youngest of these streams are preempted until the rest fit. Only a stream in `nxt` can go: none of
    its records is in flight, so it is closed at a position every stage holds. The oldest open stream is never
    preempted (the budget holds one whole context), so some stream always finishes. `over`: the positions past it."""
    for i, (st, oid, toks) in enumerate(nxt):
      if over > 0 and len(toks) > 1:
        over, st.held, st.spec.verify = over - (len(toks) - 1), st.held - (len(toks) - 1), None
        nxt[i] = (st, oid, toks[:1])
    oldest = min(s.arrival for s in self.active_open())
    for st in sorted((x[0] for x in nxt if x[0].arrival != oldest), key=lambda s: s.arrival, reverse=True):
      if over <= 0: break
      over -= st.held
      self._preempt(st)
    nxt = [x for x in nxt if x[0].state == "open"]
    # still over: the younger streams are computing their prompts (not settled, so not preempted yet). The rest wait,
    # their inputs held back, until a younger one's first token comes (then it is the one preempted): some record of
    # those is in flight, so a step (or its CLOSE) comes back and flushes the held inputs again
    if over > 0 and len(self.active_open()) > len(nxt):
      for x in sorted(nxt, key=lambda x: x[0].arrival, reverse=True):
        if over <= 0: break
        st, oid, toks = x
        st.held = split_object_id(oid)[1]
        over -= len(toks)
        self.parked.append(x)
      nxt = [x for x in nxt if x not in self.parked]
    return nxt

  def active_open(self) -> list[StreamHandle]:
    return [s for s in self.active.values() if s.state == "open"]

  def _preempt(self, st: StreamHandle) -> None:
    """Under self.lock: close a settled stream to free its positions; what it computed goes to the prefix cache
    (decoded positions too: every stage is on the rows path, whose decode rows have prompt rows' bits), and when its
    CLOSE is back it waits again, ahead of the streams that came after it (_requeue)."""
    log.info("stream %d: preempted at %d positions (kv_budget %d, %d held)", st.id, st.held, self.kv_budget, self.held())
    st.preempted += 1
    self.tally.preempted += 1
    self._close_stream(st)
    st.state = "preempted"

  def _requeue(self, st: StreamHandle) -> None:
    """Under self.lock: a preempted stream's CLOSE is back; it waits under a new id (the stages saw the old one close),
    in arrival order, to be opened again with its answer so far as prompt (_open_records)."""
    st.id, st.slot, st.state, st.held = next(self.stream_ids), -1, "waiting", 0
    at = next((i for i, s in enumerate(self.waiting) if s.arrival > st.arrival), len(self.waiting))
    self.waiting.insert(at, st)

  def fail_all(self, e: errors.PyruntimeError) -> None:
    with self.lock:
      streams = list(self.waiting) + list(self.active.values())
      self.waiting.clear(); self.active.clear()
    for st in streams: st.fail(e)

  # --- the launcher's view -----------------------------------------------------------------------
  def cpu_s(self) -> float:
    """CPU seconds the driver thread has used (reading, text, next tokens, its polls): the launcher's own cost."""
    if self.thread.ident is None: return 0.0
    try: return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))
    except (OSError, AttributeError): return float("nan")  # the thread has ended, or a platform without thread clocks

  def stats(self) -> dict:
    """Under self.lock: streams running (in the pipeline) and waiting (for a slot); tokens out; the tail's steps and
    their sizes; output tokens per second over the last RATE_WINDOW_S; speculation's counters."""
    return stream_stats(self.tally, len(self.active), len(self.waiting), self.max_streams, self.speculative, self.drafter,
                        self.kv_budget, self.held())

  def _write(self, oid: int, payload: Any, flags: int) -> None:
    """Into the head ring, under self.lock. A failed stage raises here; the driver thread (which learns of failures)
    ends every stream and the pipeline, so no other thread ever closes the launcher."""
    while True:
      try: return self.head.write(oid, payload, flags, timeout=HEAD_WRITE_SLICE_S)
      except errors.RingTimeout: pass
      except (errors.PeerDead, errors.RingClosed) as e:
        if self.closed: raise errors.LauncherClosed("the launcher is closed") from None
        raise self.pool.first_failure() or errors.StageFailed(0, e.code) from None
      if (f := self.pool.first_failure()) is not None: raise f
      if self.closed: raise errors.LauncherClosed("the launcher is closed")

  def wake(self, timeout: float) -> None:
    """Close our side of the head ring: the stages drain and close theirs in turn, down to the tail ring, whose reader
    (the driver, parked in C) then gets RingClosed at once instead of at its next DRIVER_WAKE_S."""
    if not self.lock.acquire(timeout=timeout): return  # _write gives the lock up once closed is set
    try: self.head.close()
    except errors.PyruntimeError: pass
    finally: self.lock.release()


def stream_stats(t: Tally, running: int, waiting: int, max_streams: int, speculative: str, drafter: Any = None,
                 kv_budget: int = 0, kv_held: int = 0) -> dict:
  """Driver.stats' figures from a tally (a fresh one: a launcher not started yet); `kv`: the positions the open streams
  hold (now and at most), their budget (0: none) and the streams preempted for it."""
  now = time.monotonic()
  recent = [x for x in t.token_times if now - x <= RATE_WINDOW_S]
  span = now - recent[0] if len(recent) > 1 else 0.0
  spec = {"mode": speculative, **t.spec, **({"draft_model": drafter.stats()} if drafter else {})}
  return {"running": running, "waiting": waiting, "max_streams": max_streams, "tokens": t.tokens, "steps": t.steps,
          "last_batch": t.last_batch, "mean_batch": t.step_rows / t.steps if t.steps else 0.0,
          "tokens_per_s": (len(recent) - 1) / span if span > 0 else 0.0,
          "speculation": spec if speculative != "off" or t.spec["rounds"] else None,
          "kv": {"budget": kv_budget, "held": kv_held, "peak": t.kv_peak, "preempted": t.preempted}}
