"""A stage's data loop: its ring sides, the records it takes from the ingress, the steps it computes and the results it
writes to the egress (docs/streams.md, "Batching in a stage").

A loop turn takes what waits on the ingress ring (all of it, up to a bound: records of many streams), then runs one step
the scheduler plans (pyruntime/stage/scheduler.py): every stream with a decode token waiting, as one batch, then one prefill
chunk of the oldest stream still prefilling. So a long prompt delays the running streams by at most one chunk per step,
and streams join and leave the batch at every step. The control commands that set it up are the stage's
(pyruntime/stage/worker.py).
"""
from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from pyruntime import errors
from pyruntime.modelfile.boundary import MLA_POS
from pyruntime.protocol import (
  FLAG_CACHE,
  FLAG_CLOSE,
  FLAG_END,
  FLAG_ERROR,
  FLAG_MORE,
  FLAG_OPEN,
  MAX_VERIFY_ROWS,
  Event,
  decode_json,
  error_payload,
  logprob_payload,
  object_id,
  split_object_id,
)
from pyruntime.stage.compute.logprobs import score
from pyruntime.stage.scheduler import StageScheduler, Stream

if TYPE_CHECKING:
  from pyruntime.stage.compute.kv_blocks import KVBlocks
  from pyruntime.stage.compute.model import StageModel
  from pyruntime.transport.ring import Arena, Reader, Writer

COMMAND_POLL_S = 0.05  # while records flow, how often the data loop looks for a control command
GROUP_WAIT_S = 5.0     # how long to wait for the rest of a step's group (MORE): the upstream writes a group in one go
HEARTBEAT_S = 0.5      # the data loop reports its progress at most this often (Heartbeat; the launcher's stall rule)
MAX_TAKE = 256         # records taken from the ring per loop turn, so a flooding upstream cannot starve the compute


class Egress:
  """What a stage writes on its egress ring for what it computed: the residual of a chunk or a decode row, or at the tail
  the token sampled from its logits (or the logits); and a failed stream's ERROR."""
  def __init__(self, writer: Writer, model: StageModel, index: int | None, stats: dict) -> None:
    self.writer, self.model, self.index, self.stats = writer, model, index, stats

  def emit(self, sid: int, st: Stream, pos: int, n: int, out: Any, flags: int, publish: bool = True) -> None:
    """Write one result: the residual of positions [pos, pos+n), or on the tail the token (or logits) after pos+n-1.
    publish=False leaves it invisible until a later record is published (every write and publishing commit does)."""
    if not self.model.is_tail:
      span = self.writer.reserve(self.model.row_bytes * n)
      self.model.egress_into(out, span, pos, st.slot)
      return self.writer.commit(object_id(sid, pos), flags, publish)
    oid = object_id(sid, pos + n - 1)
    if st.logits: return self.put(oid, out.numpy().astype("<f4", copy=False).reshape(-1), flags, publish)
    if (lp := st.logprobs) >= 0: logits = out.numpy()  # before the sampler's next use of the device's buffers
    try: mask = None if st.constraint is None else st.constraint.mask()
    except errors.StreamFailed as e: return self.fail_stream(sid, st, e)
    token = st.sampler.sample(out, st.history, mask)
    st.history.append(token)
    end = token in st.end_ids
    if st.constraint is not None:
      # once the answer is whole the mask allows only end tokens: the one sampled then ends the stream (ignore_eos too)
      if st.constraint.done: end = True
      else:
        try: st.constraint.take(token)
        except errors.StreamFailed as e: return self.fail_stream(sid, st, e)  # a mask lets no such token through: a bug
    payload = token.to_bytes(4, "little") if lp < 0 else logprob_payload(score(logits, token, lp), lp)
    self.put(oid, payload, flags | (FLAG_END if end else 0), publish)

  def emit_scores(self, sid: int, st: Stream, pos: int, rows: list[Any], flags: int = 0, publish: bool = True) -> None:
    """A scored prompt's chunk at the tail (prompt_logprobs): for each row before the prompt's last, the TokenScore of
    the prompt's next token; the last prompt row's answer is the first sampled token, as ever. One MORE group (its last
    record with `flags` and `publish`: a step's other records may follow in the group)."""
    last = len(rows) - 1
    for i, logits in enumerate(rows):
      p, f, pub = pos + i, FLAG_MORE if i < last else flags, publish if i == last else False
      if p == st.prompt_tokens - 1: return self.emit(sid, st, p, 1, logits, f, pub)
      s = score(logits.numpy(), st.history[p + 1], st.logprobs)
      self.put(object_id(sid, p), logprob_payload(s, st.logprobs), f, pub)

  def emit_rows(self, sid: int, st: Stream, pos: int, rows: list[Any]) -> None:
    """The tail's answers to a speculative record: a token for every row, in order, each sampled with the history of
    the rows before it (which is right exactly when those rows' drafts were, the only case the launcher keeps); one
    MORE group, published at once."""
    last = len(rows) - 1
    for i, logits in enumerate(rows):
      token = st.sampler.sample(logits, st.history)
      st.history.append(token)
      flags = (FLAG_MORE if i < last else 0) | (FLAG_END if token in st.end_ids else 0)
      self.put(object_id(sid, pos + i), token.to_bytes(4, "little"), flags, publish=i == last)

  def put(self, oid: int, payload: Any, flags: int, publish: bool) -> None:
    if publish: return self.writer.write(oid, payload, flags)
    mv = memoryview(payload).cast("B")
    self.writer.reserve(len(mv))[:] = mv
    self.writer.commit(oid, flags, publish=False)

  def fail_stream(self, stream_id: int, st: Stream, e: errors.PyruntimeError) -> None:
    """This stream alone ends: the error goes down the pipeline to the launcher; the others run on."""
    st.failed = True
    st.pending.clear()
    self.stats["stream_errors"] += 1
    self.writer.write(object_id(stream_id, 0), error_payload(self.index, e.code, str(e), self.writer.spec.alignment), FLAG_ERROR)


class DataLoop:
  """Everything a stage does with records, from LoadWeights on: the ring sides InstallRing attaches, the records taken
  into its streams, the steps its scheduler plans, computed on its model, and their Heartbeats. `emit_event` is the
  control channel's (events), `stats` the stage's counters (QueryStats)."""
  def __init__(self, emit_event: Callable[..., None], index: int | None, model: StageModel, blocks: KVBlocks | None,
               sched: StageScheduler, stats: dict, constraint: Callable[[int], Any]) -> None:
    self.emit_event, self.index, self.model, self.blocks, self.sched, self.stats = emit_event, index, model, blocks, sched, stats
    self.constraint = constraint  # a structured stream's grammar matcher, at its OPEN (the stage waits for its SetGrammar)
    self.grammars: dict[int, str] = {}  # structured streams' grammars by stream id, from SetGrammar until CLOSE
    self.arena: Arena | None = None
    self.reader: Reader | None = None
    self.writer: Writer | None = None
    self.out: Egress | None = None       # what the steps write, on `writer`
    self.looping = False                 # the data loop runs (InstallRing in mode "loop")
    self.beat_t = 0.0                    # the last Heartbeat
    self.steps_run = 0                   # steps finished, records taken: the progress a Heartbeat reports
    self.records_taken = 0
    self.slowest_step_s = 0.0
    self.doing: str | tuple[int, int | None] = "waiting for records"
    self.step_t0: float | None = None    # when the step now running began (None between steps): the watch's view
    self.capturing = False               # the step now running captures a graph (on_capture)
    threading.Thread(target=self.watch, name="step-watch", daemon=True).start()

  # --- the ring sides ---------------------------------------------------------------------------
  def install(self, name: str, ingress: int, egress: int) -> None:
    from pyruntime.transport.ring import Arena
    self.arena = Arena.attach(name)
    try:
      for i in (ingress, egress):
        if i >= self.arena.ring_count: raise errors.InvalidCommand(f"InstallRing: arena {name} has rings 0..{self.arena.ring_count - 1}, not {i}")
      self.reader = self.arena.reader(ingress)
      self.writer = self.arena.writer(egress)
      self.out = Egress(self.writer, self.model, self.index, self.stats)
    except BaseException:
      self.close_rings()
      raise

  def close_rings(self) -> None:
    for side in (self.writer, self.reader):
      if side is not None:
        try: side.close()
        except errors.PyruntimeError: pass
    if self.arena is not None: self.arena.close()
    self.reader = self.writer = self.arena = self.out = None

  def poll(self) -> None:
    """One loop turn: take what the ingress holds (waiting as long as the scheduler allows), then run a step if one is ready."""
    self.take_ingress(self.sched.ingress_wait(COMMAND_POLL_S))
    if self.looping and self.sched.ready(): self.run_step()

  # --- ingress ----------------------------------------------------------------------------------
  def take_ingress(self, timeout: float) -> None:
    """Read what the ring holds now (waiting up to `timeout` for the first record, and for the rest of a MORE group)."""
    t0 = time.monotonic()
    for n in range(MAX_TAKE):
      try: rec = self.reader.read(timeout=timeout)
      except (errors.RingTimeout, errors.WouldBlock): break
      except errors.RingClosed:  # upstream finished in order: pass the close on and stop looping
        self.looping = False
        self.writer.close()
        self.emit_event(Event.DATA_LOOP_STOPPED, stage=self.index)
        break
      if n == 0: self.stats["wait_s"] += time.monotonic() - t0
      more = rec.flags & FLAG_MORE
      self.take(rec)
      self.reader.release()
      timeout = GROUP_WAIT_S if more else 0.0

  def take(self, rec: Any) -> None:
    """One ingress record: OPEN, CLOSE and ERROR are acted on and forwarded at once; data waits for the next step."""
    self.records_taken += 1
    stream_id, pos = split_object_id(rec.object_id)
    if rec.flags & (FLAG_OPEN | FLAG_CLOSE | FLAG_ERROR | FLAG_CACHE):
      if rec.flags & FLAG_OPEN: self.open_stream(stream_id, decode_json(rec.payload))
      elif rec.flags & FLAG_CLOSE: self.close_stream(stream_id)
      elif rec.flags & FLAG_CACHE: self.save_blocks(stream_id, decode_json(rec.payload))
      elif (st := self.sched.streams.get(stream_id)) is not None: st.failed = True; st.pending.clear()
      return self.writer.write(rec.object_id, rec.payload, rec.flags & ~FLAG_MORE)
    if (st := self.sched.streams.get(stream_id)) is None:
      raise errors.StreamNotOpen(f"record {rec.sequence} names stream {stream_id}, which is not open")
    if st.failed: return
    try:
      parts = self.model.boundary.ingress.ingress_arrays(rec.payload)
      x = next(iter(parts.values()))
      if MLA_POS in parts and not np.array_equal(parts[MLA_POS].reshape(-1), np.arange(pos, pos + len(x))):
        raise errors.BoundarySchemaMismatch(f"stream {stream_id}: mla_position_state says positions {parts[MLA_POS].reshape(-1)[:4].tolist()}..., "
                                            f"the record stands at {pos}")
      if pos != st.position:
        # a speculative stream goes back to after its last accepted token: the rejected rows' keys and values are
        # overwritten before any row reads them (attention reads positions up to its own only)
        if not (st.is_verify(pos) and pos < st.position and not st.pending):
          raise errors.StreamPositionInvalid(f"stream {stream_id} stands at position {st.position}, record says {pos}")
        st.position = pos
      # a recurrent state goes back too (StageModel.rewind: the state before the verify record, its kept rows again)
      if st.is_verify(pos) and not st.pending: self.model.rewind(st.slot, pos)
      if st.prompt_tokens is None: st.prompt_tokens = len(x)
      if pos >= st.prompt_tokens and len(x) != 1 and not (st.is_verify(pos) and len(x) <= MAX_VERIFY_ROWS):
        raise errors.ActivationExtentInvalid(f"stream {stream_id}: a decode record carries one token, this one {len(x)}")
      if st.sampler is not None and pos >= st.prompt_tokens:  # the tail forgets drafted tokens the launcher did not keep
        del st.history[st.history_base + pos - st.prompt_tokens + 1:]
      if pos < st.prompt_tokens < pos + len(x):
        raise errors.ActivationExtentInvalid(f"stream {stream_id}: a record at {pos} of {len(x)} tokens runs past the prompt's "
                                             f"{st.prompt_tokens}")
      if pos + len(x) > self.model.context_length: raise errors.ContextLengthExceeded(pos + len(x), self.model.context_length)
      self.model.check_rows(x)
    except errors.PyruntimeError as e:
      return self.out.fail_stream(stream_id, st, e)
    if not st.pending: st.waiting_since = rec.sequence  # decode rows are taken oldest first
    st.pending.append((pos, x.copy()))  # the ring space is released right after: keep our own copy
    st.position += len(x)

  def open_stream(self, stream_id: int, info: dict) -> None:
    slot = info.get("slot")
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.model.slots:
      raise errors.SlotInvalid(f"stream {stream_id} asks for KV slot {slot!r}; this stage has {self.model.slots}")
    if any(s.slot == slot for s in self.sched.streams.values()):
      raise errors.SlotInvalid(f"stream {stream_id} asks for KV slot {slot}, which another open stream holds")
    if stream_id in self.sched.streams: raise errors.SlotInvalid(f"stream {stream_id} is opened twice")
    prompt_tokens = info.get("prompt_tokens")
    if prompt_tokens is not None and (not isinstance(prompt_tokens, int) or prompt_tokens < 1):
      raise errors.ActivationExtentInvalid(f"stream {stream_id} opened with prompt_tokens={prompt_tokens!r}")
    self.model.reset_slot(slot)
    st = Stream(slot, prompt_tokens, speculative=bool(info.get("speculative")) and self.model.rows is not None)
    if (cached := info.get("cached", 0)) or info.get("load"):
      if self.blocks is None: raise errors.PrefixBlocksInvalid(f"stream {stream_id} asks for cached blocks; this stage keeps none")
      st.position = self.blocks.load(slot, info.get("load"))
      if st.position != cached or (prompt_tokens is not None and cached >= prompt_tokens):
        raise errors.PrefixBlocksInvalid(f"stream {stream_id}: {cached!r} cached positions, its blocks hold {st.position}")
      if self.blocks.recurrent:  # the recurrent blocks' state after those positions, as kept with them
        if info.get("state") is None: raise errors.PrefixBlocksInvalid(f"stream {stream_id}: cached positions without their recurrent state")
        self.blocks.load_state(slot, info["state"], cached)
      self.model.set_position(slot, cached)
    if self.model.is_tail:
      from pyruntime.params import SamplingParams
      from pyruntime.stage.compute.sampling import Sampler
      if not info.get("identity"): raise errors.ResultIdentityMissing(f"stream {stream_id} opened without a request identity")
      st.sampler = Sampler(SamplingParams.from_dict(info.get("sampling", {})), self.model.vocab_size, self.model.device)
      st.history, st.end_ids, st.logits = list(info.get("history", [])), frozenset(info.get("end_ids", [])), bool(info.get("logits"))
      st.history_base = len(st.history)
      st.logprobs = int(info.get("logprobs", -1))
      if info.get("prompt_logprobs"):
        if not self.model.score_rows: raise errors.InvalidOption("prompt_logprobs", "scoring a prompt needs the rows path at the tail")
        st.score_rows = self.model.score_rows
      if info.get("grammar"): st.constraint = self.constraint(stream_id)
      if (resumed := info.get("resumed", 0)) and not (isinstance(resumed, int) and 0 < resumed < len(st.history)):
        raise errors.ActivationExtentInvalid(f"stream {stream_id}: resumed={resumed!r} with a history of {len(st.history)}")
      if resumed:  # preempted and opened again: as if it had never stopped (the same draws next, the grammar where it was)
        st.sampler.skip(resumed)
        if st.constraint is not None: st.constraint.take(*st.history[-resumed:])
    self.sched.streams[stream_id] = st

  def save_blocks(self, stream_id: int, info: dict) -> None:
    """A CACHE record: fill the named blocks from the stream's slot. Positions the launcher has answers for are computed
    here, even if the stream failed since (its slot is kept until the CLOSE)."""
    if self.blocks is None: raise errors.PrefixBlocksInvalid(f"stream {stream_id}: a CACHE record, but this stage keeps no blocks")
    if (st := self.sched.streams.get(stream_id)) is None: raise errors.StreamNotOpen(f"a CACHE record names stream {stream_id}, which is not open")
    self.blocks.save(st.slot, info.get("save"), self.model.position(st.slot))
    if self.blocks.recurrent and info.get("state") is not None: self.blocks.save_state(st.slot, info["state"])

  def close_stream(self, stream_id: int) -> None:
    self.grammars.pop(stream_id, None)
    if (st := self.sched.streams.pop(stream_id, None)) is not None:
      self.model.reset_slot(st.slot)
      if st.constraint is not None: st.constraint.close()

  # --- progress ---------------------------------------------------------------------------------
  def beat(self, force: bool = False, capturing: bool = False) -> None:
    """A Heartbeat: what this loop has done (steps finished, records taken), whether work waits here, and what it does
    now. Sent from the thread that does the work, so a stopped or deadlocked loop goes quiet (docs/control-channel.md,
    "Stalls")."""
    now = time.monotonic()
    if not force and (now - self.beat_t < HEARTBEAT_S or not self.looping): return
    self.beat_t = now
    self.send_beat(now, busy=self.sched.has_work(), capturing=capturing)

  def send_beat(self, now: float, busy: bool, capturing: bool = False, step_s: float | None = None) -> None:
    # tokens and busy_s (rows computed, seconds computing and emitting, since the start) give the operator's view a
    # stage's busy fraction and rows per step between two beats (pyruntime/serving/metrics.py); cpu_s against clock_s
    # tells the launcher whether a stage that finishes nothing is computing or hung
    doing = self.doing if isinstance(self.doing, str) else _step_text(*self.doing)
    self.emit_event(Event.HEARTBEAT, stage=self.index, steps=self.steps_run, records=self.records_taken, busy=busy, doing=doing,
                    slowest_s=round(self.slowest_step_s, 4), capturing=capturing, tokens=self.stats["tokens"],
                    busy_s=round(self.stats["compute_s"] + self.stats["emit_s"], 4), cpu_s=round(cpu_seconds(), 4),
                    clock_s=round(now, 4), step_s=None if step_s is None else round(step_s, 3))

  def watch(self) -> None:
    """The step-watch thread: while one step runs longer than HEARTBEAT_S (a first launch that compiles, a long prompt
    chunk on a big model), it says so every HEARTBEAT_S, with what the step is and the process's CPU time. It reports
    no progress (the counters are the loop's own, unchanged until the step ends): it lets the launcher tell a stage
    that computes from one that is hung (docs/control-channel.md, "Stalls"). It reads only plain attributes."""
    while True:
      time.sleep(HEARTBEAT_S)
      t0, now = self.step_t0, time.monotonic()
      if t0 is not None and self.looping and now - t0 >= HEARTBEAT_S and now - self.beat_t >= HEARTBEAT_S:
        self.send_beat(now, busy=True, capturing=self.capturing, step_s=now - t0)

  def on_capture(self, graph: str) -> None:
    """A graph is captured now (not prepared at load: a decode window first used, say): the launcher allows a capture's
    time, not a step's, until the next Heartbeat."""
    self.doing, self.capturing = f"capturing the {graph} graph", True
    self.beat(force=True, capturing=True)

  # --- steps ------------------------------------------------------------------------------------
  def run_step(self) -> None:
    t0 = self.step_t0 = time.monotonic()
    try: self.step()
    finally: self.step_t0, self.capturing = None, False
    dt = time.monotonic() - t0
    self.steps_run += 1
    self.slowest_step_s = max(self.slowest_step_s, dt)
    self.doing = "waiting for records"

  def step(self) -> None:
    plan = self.sched.plan()
    self.doing = (len(plan.decode), plan.prefill[0] if plan.prefill else None)  # formatted only when a Heartbeat goes out
    self.beat()
    if plan.mixed and self.model.mixes(self.sched.chunk_rows(plan.prefill[1])): return self.mixed_step(plan.decode, *plan.prefill)
    if plan.decode: self.decode_step(plan.decode)
    if plan.prefill: self.prefill_chunk(*plan.prefill)

  def decode_step(self, rows: list[tuple[int, Stream]]) -> None:
    t0 = time.monotonic()
    items = [(sid, st, *self.sched.next_row(st)) for sid, st in rows]
    if self.sched.decode_mode == "reference":
      # each result aliases the stage's output buffers (and its router logits): emit it before the next forward
      t1 = t0  # t1 - t0: the forwards' time
      for i, (sid, st, pos, x) in enumerate(items):
        tf = time.monotonic()
        out = self.model.forward(st.slot, x, pos, prefill=False)
        t1 += time.monotonic() - tf
        self.out.emit(sid, st, pos, 1, out, FLAG_MORE if i < len(items) - 1 else 0)
      t2 = time.monotonic()
    else:
      batch = self.model.forward_batch([st.slot for _, st, _, _ in items], np.concatenate([x for *_, x in items]),
                                       [pos for _, _, pos, _ in items])
      outs = self.model.batch_rows(batch, [st.slot for _, st, _, _ in items])
      t1 = time.monotonic()
      # a prompt's row (prompt_rows_in_window) goes on as a decode row does, except at the tail: there only its prompt's
      # last row is answered (a token), or with prompt_logprobs every row (a score)
      sent = [(sid, st, pos, out) for (sid, st, pos, _), out in zip(items, outs, strict=True)
              if not self.model.is_tail or pos >= st.prompt_tokens - 1 or st.scores_prompt(pos)]
      # the step's records become visible together (one publishing store, one wake-up of the reader): the next stage
      # and the launcher take a MORE group as a whole anyway, so publishing each row would only wake them per row
      last = len(sent) - 1
      for i, (sid, st, pos, out) in enumerate(sent):
        flags, publish = FLAG_MORE if i < last else 0, i == last
        if self.model.is_tail and st.scores_prompt(pos): self.out.emit_scores(sid, st, pos, [out], flags, publish)
        else: self.out.emit(sid, st, pos, 1, out, flags, publish)
      t2 = time.monotonic()
    n, k = len(items), sum(1 for _, st, pos, _ in items if pos < st.prompt_tokens)
    self.sched.note_decode(t2 - t0)
    s = self.stats
    s.update(records=s["records"] + n, tokens=s["tokens"] + n, decode_steps=s["decode_steps"] + 1, decode_rows=s["decode_rows"] + n - k,
             max_batch=max(s["max_batch"], n - k), prefill_chunks=s["prefill_chunks"] + k, mixed_steps=s["mixed_steps"] + (0 < k < n),
             compute_s=s["compute_s"] + t1 - t0, emit_s=s["emit_s"] + t2 - t1)

  def mixed_step(self, rows: list[tuple[int, Stream]], psid: int, pst: Stream) -> None:
    """One decode step with a prompt chunk in the same pass (StageModel.forward_mixed): the decode rows go out as
    decode_step sends them, then the chunk's record as prefill_chunk sends it. The chunk's share of the step's time
    sizes the next chunk."""
    t0 = time.monotonic()
    items = [(sid, st, *st.pending.popleft()) for sid, st in rows]
    pos, x = self.sched.next_chunk(pst)
    slots = [st.slot for _, st, _, _ in items]
    verify, scores = self.model.is_tail and pst.is_verify(pos), self.model.is_tail and pst.scores_prompt(pos)
    dec, pre = self.model.forward_mixed(slots, np.concatenate([r for *_, r in items]), [p for _, _, p, _ in items], pst.slot, x, pos,
                                        every_row=verify or scores)
    outs = self.model.mixed_rows(dec, slots)
    self.model.synchronize()
    t1 = time.monotonic()
    last = len(items) - 1
    for i, ((sid, st, p, _), out) in enumerate(zip(items, outs, strict=True)):
      self.out.emit(sid, st, p, 1, out, FLAG_MORE if i < last else 0, publish=i == last)
    n = len(x)
    if verify: self.out.emit_rows(psid, pst, pos, pre)
    elif scores: self.out.emit_scores(psid, pst, pos, pre)
    elif not self.model.is_tail or pos + n == pst.prompt_tokens: self.out.emit(psid, pst, pos, n, pre, 0)
    t2 = time.monotonic()
    self.sched.note_mixed(n, t1 - t0, self.model.shape_ms.get(self.model.slots))
    k, s = len(items), self.stats
    s.update(records=s["records"] + k + 1, tokens=s["tokens"] + k + n, decode_steps=s["decode_steps"] + 1, decode_rows=s["decode_rows"] + k,
             max_batch=max(s["max_batch"], k), prefill_chunks=s["prefill_chunks"] + 1, mixed_steps=s["mixed_steps"] + 1,
             compute_s=s["compute_s"] + t1 - t0, emit_s=s["emit_s"] + t2 - t1, prefill_s=s["prefill_s"] + max(0.0, t1 - t0 - self.sched.step_s))

  def prefill_chunk(self, sid: int, st: Stream) -> None:
    t0 = time.monotonic()
    pos, x = self.sched.next_chunk(st)
    n = len(x)
    if st.is_verify(pos) and self.model.recurrent: self.model.keep_for_rewind(st.slot, x, pos)
    verify, scores = self.model.is_tail and st.is_verify(pos), self.model.is_tail and st.scores_prompt(pos)
    if verify or scores: out = self.model.prefill_rows(st.slot, x, pos, every_row=True)
    else: out = self.model.forward(st.slot, x, pos, prefill=True)
    self.model.synchronize()  # its kernels are queued, not done: the chunk's cost sizes the next one
    t1 = time.monotonic()
    if verify: self.out.emit_rows(sid, st, pos, out)
    elif scores: self.out.emit_scores(sid, st, pos, out)
    elif not self.model.is_tail or pos + n == st.prompt_tokens: self.out.emit(sid, st, pos, n, out, 0)
    t2 = time.monotonic()
    self.sched.note_prefill(n, t1 - t0)
    self.stats.update(records=self.stats["records"] + 1, tokens=self.stats["tokens"] + n, prefill_chunks=self.stats["prefill_chunks"] + 1,
                      compute_s=self.stats["compute_s"] + t1 - t0, emit_s=self.stats["emit_s"] + t2 - t1,
                      prefill_s=self.stats["prefill_s"] + t2 - t0)

def cpu_seconds() -> float:
  """CPU time of this process (every thread) and of the children it reaped (a compiler it ran), in seconds."""
  t = os.times()
  return t.user + t.system + t.children_user + t.children_system


def _step_text(rows: int, chunk_of: int | None) -> str:
  """What a step does, in words, for a Heartbeat."""
  parts = [f"a step of {rows} decode rows"] if rows else []
  if chunk_of is not None: parts.append(f"a prompt chunk of stream {chunk_of}")
  return " and ".join(parts)
