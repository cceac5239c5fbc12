"""The launcher: plans the pipeline, starts its stages and drives generation, in three parts.

    with Launcher(stages=2) as lm:
        for ev in lm.generate("What is the capital of France?", max_tokens=32):
            if isinstance(ev, Delta): print(ev.text, end="")

`launch_plan.plan_launch` decides everything before a stage exists (pure: the split, devices, roles); a
`stage_pool.StagePool` spawns, watches and stops the stage processes wherever a placement runs them (this host, or Ray
nodes); a `driver.Driver` owns the streams: slots, queue and the token loop. Data flows one way: launcher → head ring →
stage → ring → … → tail → ring → launcher. The launcher closes the loop itself (it must see every token anyway, to
decode text and apply stop strings), so the head never waits on a token the launcher would have to cancel.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import signal
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from pyruntime import errors
from pyruntime.devices import available_memory
from pyruntime.engine.driver import Driver, StreamHandle, Tally, stream_stats
from pyruntime.engine.events import Delta, Done, Logits, Timings, Usage
from pyruntime.engine.launch_plan import LAUNCH_FIELDS, LaunchOptions, LaunchPlan, plan_launch, preflight
from pyruntime.engine.prefix_cache import PREFIX_CACHE_TOKENS, PrefixCache
from pyruntime.engine.request import RequestBuilder
from pyruntime.engine.speculation import MIN_ACCEPTED_RECURRENT, SOLO_STREAMS
from pyruntime.engine.stage_pool import LocalPlacement, StageHandle, StagePool
from pyruntime.options import PREFILL_SHARE, STALL_CAPTURE_TIMEOUT_S, STALL_TIMEOUT_S
from pyruntime.params import MAX_CHOICES
from pyruntime.protocol import ABI_VERSION, Command, Event, ring_bytes

log = logging.getLogger("pyruntime.launcher")

__all__ = ["Delta", "Done", "Launcher", "Logits", "StreamHandle", "Timings", "Usage"]

if TYPE_CHECKING:  # the ring hands out arrays; the launcher itself needs no numpy (the ring is imported at start)
  from pyruntime.engine.drafter import ModelDrafter
  from pyruntime.engine.hosts import RayPlacement
  from pyruntime.transport.ring import Arena, RingSpec

STOP_GRACE_S = 5.0     # how long a stage gets to stop in order before it is killed
FAIL_GRACE_S = 0.5     # after a failure the survivors get SIGTERM and this long before SIGKILL


def _planned(name: str) -> property:
  """A field of the launch plan, read as the launcher's own attribute (embedders read lm.split, lm.tokenizer, ...)."""
  def get(self: Launcher) -> Any:
    if self.planned is None: raise AttributeError(f"{name}: the launcher has not planned yet (plan() or start())")
    return getattr(self.planned, name)
  return property(get, doc=f"LaunchPlan.{name}")


class Launcher:
  """One pipeline, as embedders use it: the constructor's keywords, start/close, generate/submit, and the views of its
  health and counters. Its length is that public API (kept compatible), each method a few lines: the work is in
  LaunchPlan (what to run), StagePool (the processes) and Driver (the streams)."""
  # the plan's fields, once planned
  path, header, model_name, split, devices, weights = (_planned(n) for n in ("path", "header", "model_name", "split", "devices", "weights"))
  micro_batches, context_length, num_blocks, dim = (_planned(n) for n in ("micro_batches", "context_length", "num_blocks", "dim"))
  tokenizer, vocab_size, template, recipe = (_planned(n) for n in ("tokenizer", "vocab_size", "template", "recipe"))

  def __init__(self, model: str | os.PathLike | None = None, *, stages: int = 2, split: Sequence[tuple[int, int]] | None = None,
               devices: str | Sequence[str] | None = None, boundary_dtype: str = "float32", max_streams: int = 8,
               decode: str = "batched", weights: str = "auto", warmup: bool = False, max_context: int | None = None,
               prefill_share: float = PREFILL_SHARE, on_event: Callable[[dict], None] | None = None,
               cache_dir: str | None = None, stage_env: dict[str, str] | None = None, load_timeout_s: float = 900.0,
               prefix_cache: int = PREFIX_CACHE_TOKENS, kv_budget: int = 0, graph_cache: bool = True, stall_timeout: float = STALL_TIMEOUT_S,
               stall_capture_timeout: float = STALL_CAPTURE_TIMEOUT_S, speculative: str = "off", draft_tokens: int = 7,
               placement: str = "local", ray_address: str | None = None, hosts: int | None = None, tensor_cores: str = "off"):
    if placement == "ray":
      from pyruntime.engine.hosts import require_ray
      require_ray()  # refused now, naming the extra, rather than at start
    # by name, every keyword that is a LaunchOptions field (tests/unit/test_launch_plan.py keeps the two lists and their
    # defaults equal): a keyword added to one and not the other, or two in another order, cannot pass silently
    given = {k: v for k, v in locals().items() if k in LAUNCH_FIELDS}
    self.options = LaunchOptions(**given | {"stall_timeout": float(stall_timeout), "stall_capture_timeout": float(stall_capture_timeout),
                                            "stage_env": dict(stage_env or {})})
    self.model_source, self.on_event = model, on_event
    self.planned: LaunchPlan | None = None
    self.pool: StagePool | None = None    # the stage processes, and where they run
    self.driver: Driver | None = None     # the streams, once started
    self.requests: RequestBuilder | None = None
    self.prefix = PrefixCache(None, "not started")
    self.drafter: ModelDrafter | None = None  # with speculative="model:PATH"
    self._draft_lm: Launcher | None = None      # its pipeline, closed with this one even while it starts
    self.events: list[dict] = []          # every event seen, in order: the plain way to look at them
    self.load_s = 0.0
    self._closed = False                  # no new streams, the driver stops
    self._shut = False                    # the stages are gone and the arena unlinked
    self._failure: errors.StageFailed | None = None  # what ended the pipeline, for every stream still running
    self._close_lock = threading.Lock()
    self._stats_lock = threading.Lock()   # one QueryStats round trip at a time (the server's /metrics, a benchmark)
    self._old_sigterm: Any = None

  # --- start -------------------------------------------------------------------------------------
  @property
  def started(self) -> bool:
    """start() has finished: the pipeline runs (or ran: see alive())."""
    return self.driver is not None

  @property
  def max_streams(self) -> int:
    """How many streams run through the pipeline together (a KV slot each); more wait in the driver's queue."""
    return self.options.max_streams

  @property
  def handles(self) -> list[StageHandle]: return [] if self.pool is None else self.pool.handles

  @property
  def placement(self) -> LocalPlacement | RayPlacement | None: return None if self.pool is None else self.pool.placement

  @property
  def arena(self) -> Arena | None:
    """The arena of this process's rings: every ring of the pipeline, or (over several hosts) the head and tail rings."""
    return None if self.pool is None else self.pool.placement.arena

  @property
  def overhead(self) -> dict:
    """The driver's wall time per token: {"tokens", "seconds"} between a token's arrival and its work done."""
    return {"tokens": 0, "seconds": 0.0} if self.driver is None else self.driver.tally.overhead

  def __enter__(self) -> Launcher:
    self.start()
    return self

  def __exit__(self, *exc: Any) -> None: self.close()

  def plan(self) -> LaunchPlan:
    """Everything decided in this process before a stage exists (launch_plan.plan_launch). It reads the GGUF header
    only, so the launcher process never imports tinygrad."""
    from pyruntime.modelfile.gguf import read_header
    from pyruntime.modelfile.source import resolve_model
    path = resolve_model(None if self.model_source is None else str(self.model_source), cache_dir=self.options.cache_dir,
                         on_progress=lambda done, total: self._event({"event": Event.DOWNLOAD_PROGRESS, "bytes": done, "total": total}))
    p = self.planned = plan_launch(path, read_header(path), self.options, available_memory())
    if p.kv_budget and not self.options.kv_budget:
      self._event({"event": "KVBudgetSet", "kv_budget": p.kv_budget, "context": p.context_length, "max_streams": self.options.max_streams,
                   "message": f"the running streams' keys and values are kept within {p.kv_budget} positions (past it the youngest "
                              f"is preempted and resumed later): {self.options.max_streams} streams at {p.context_length} would not "
                              "fit in the host memory available (give kv_budget to choose)"})
    if p.context_length < (most := int(p.header.get("context_length"))) and self.options.max_context is None:
      self._event({"event": "ContextReduced", "context": p.context_length, "file_context": most,
                   "message": f"the context is {p.context_length} tokens, not the file's {most}: every stream slot's keys and values "
                              f"at {most} would not fit in the host memory available (give max_context to choose)"})
    self.requests = RequestBuilder(p.tokenizer, p.header.kv, p.context_length, self.options.speculative)
    return p

  def start(self) -> Launcher:
    t0 = time.monotonic()
    self._install_sigterm()
    try:
      p = self.plan()
      preflight(p)
      draft_path = self._check_drafter(p) if self.options.draft_model else None
      o = self.options
      self.pool = StagePool(self._place(self._ring_specs(p)), self._event, self._check_open, o.stall_timeout, o.stall_capture_timeout)
      self._event({"event": "ArenaCreated", "name": self.arena.name, "rings": len(p.split) + 1})
      for i in range(len(p.split)):  # one at a time: a close() from another thread meanwhile sees each one it must end
        self._check_open()
        self.pool.spawn(i)
      self._check_open()
      from pyruntime.text.grammar import vocabulary
      vocabulary(p.tokenizer)  # the structured-output bridge, built while the stages load, never on a request's path
      self._load(p)
      self.prefix = PrefixCache.for_stages(self.options.prefix_cache, [h.info.get("prefix_cache") for h in self.handles], p.header.arch)
      # scoring a prompt and verifying drafts need every row's logits: the rows path (a hybrid's chunks of RECURRENT_ROWS;
      # its stages take a rejected draft's state back, StageModel.rewind)
      self.requests.scores_everywhere = all(h.info.get("batched") for h in self.handles)
      self.requests.rows_everywhere = self.requests.scores_everywhere
      if p.kv_budget and not self.requests.rows_everywhere:  # the plan refused what it could foresee
        raise errors.InvalidOption("kv_budget", "needs every stage on the rows path (a preempted stream is resumed from prompt rows)")
      recurrent = any(h.info.get("family") == "hybrid" for h in self.handles)
      if draft_path is not None:
        self._check_open()  # a close() meanwhile found no drafter to end: start none
        self.drafter = self._start_drafter(p, draft_path)
      for h in self.handles:
        upstream = self.handles[h.index - 1].info["boundary"] if h.index > 0 else None
        h.send(Command.INSTALL_RING, **self.pool.placement.ring_args(h), ingress_boundary=upstream)
      for h in self.handles: self._expect(h, Event.RING_INSTALLED, 30)
      self.load_s = time.monotonic() - t0
      placement = self.pool.placement
      self.driver = Driver(self.arena.writer(placement.head_ring), self.arena.reader(placement.tail_ring), self.pool, tokenizer=p.tokenizer,
                           max_streams=self.options.max_streams, recipe=p.recipe, context_length=p.context_length, prefix=self.prefix.index,
                           cache_decoded=self.prefix.decoded, speculative=self.options.speculative, draft_tokens=self.options.draft_tokens,
                           load_s=self.load_s, on_failure=self._fail, drafter=self.drafter, kv_budget=p.kv_budget)
      if recurrent: self.driver.min_accepted = MIN_ACCEPTED_RECURRENT
      for h in self.handles: h.progress_t = time.monotonic()
      self.driver.thread.start()
      self._event({"event": "LauncherReady", "load_s": round(self.load_s, 3), "split": [list(r) for r in p.split], "devices": p.devices})
    except BaseException:
      self.close()
      raise
    return self

  def _check_drafter(self, p: LaunchPlan) -> str:
    """The draft model's file, refused by name before anything is spawned when its vocabulary is not the target's."""
    from pyruntime.engine.drafter import check_vocab
    from pyruntime.modelfile.gguf import read_header
    from pyruntime.modelfile.source import resolve_model
    path = resolve_model(self.options.draft_model, cache_dir=self.options.cache_dir)
    check_vocab(p.header.kv, read_header(path).kv)
    return str(path)

  def _start_drafter(self, p: LaunchPlan, path: str) -> ModelDrafter:
    """The draft model as a one-stage pipeline of its own (pyruntime/engine/drafter.py): on the first stage's device, slots for
    the streams that speculate, a prefix cache so each round recomputes only what is new."""
    from pyruntime.engine.drafter import ModelDrafter
    o = self.options
    lm = Launcher(path, stages=1, devices=p.devices[0], max_streams=SOLO_STREAMS, max_context=p.context_length, warmup=o.warmup,
                  graph_cache=o.graph_cache, cache_dir=o.cache_dir, stage_env=o.stage_env, load_timeout_s=o.load_timeout_s)
    self._draft_lm = lm
    lm.start()
    self._event({"event": "DrafterReady", "model": lm.model_name, "load_s": round(lm.load_s, 3)})
    return ModelDrafter(lm, self._event)

  def _ring_specs(self, p: LaunchPlan) -> list[RingSpec]:
    """Ring i feeds stage i; ring n carries the tail's tokens back (sizes: protocol.ring_bytes). A residual row is
    hidden_states and what else the family's boundary carries (router logits, positions), in boundary-dtype units."""
    from pyruntime.modelfile.boundary import Boundary
    from pyruntime.transport.ring import RingSpec
    itemsize = 2 if self.options.boundary_dtype == "float16" else 4
    row = Boundary.residual(p.header.arch, 1, p.dim, self.options.boundary_dtype, int(p.header.get("expert_count", 0))).token_bytes
    rb = ring_bytes(p.context_length, row // itemsize, itemsize, p.vocab_size, self.options.max_streams)
    specs = [RingSpec(capacity=_pow2(rb["head_capacity"]), max_extent=rb["head"], alignment=4)]
    specs += [RingSpec(capacity=_pow2(rb["mid_capacity"]), max_extent=rb["mid"], alignment=itemsize) for _ in p.split[1:]]
    return specs + [RingSpec(capacity=_pow2(rb["tail_capacity"]), max_extent=rb["tail"], alignment=4)]

  def _load(self, p: LaunchPlan) -> None:
    """Every stage told its device and role and loading its weights, in parallel; back when all have warmed up."""
    for h in self.handles:
      h.send(Command.INITIALIZE_WORKER, device=p.devices[h.index], abi_version=ABI_VERSION)
      h.send(Command.CONFIGURE_ROLE, **p.role(h.index))
      h.send(Command.LOAD_WEIGHTS, model=self.pool.placement.model_path(h) or str(p.path), cache_dir=self.options.cache_dir)
    # one deadline for the whole load, not one per stage and event: a caller's bound (a test's, a supervisor's) holds
    # whatever the stage count
    deadline = time.monotonic() + self.options.load_timeout_s
    for h in self.handles:
      h.info = self._expect(h, Event.WEIGHTS_LOADED, deadline - time.monotonic(), self.options.load_timeout_s)
      h.info["warm_up"] = self._expect(h, Event.WARMED_UP, deadline - time.monotonic(), self.options.load_timeout_s)

  def _place(self, specs: list[RingSpec]) -> LocalPlacement | RayPlacement:
    """Every stage on this host (one arena), or over Ray nodes (docs/hosts.md: agents, bridges)."""
    if self.options.placement == "ray":
      from pyruntime.engine.host_agent import model_identity
      from pyruntime.engine.hosts import RayPlacement
      source = None if self.model_source is None else str(self.model_source)
      return RayPlacement(specs=specs, n_stages=len(self.split), hosts=self.options.hosts, address=self.options.ray_address, source=source,
                          cache_dir=self.options.cache_dir, local_model=model_identity(self.path), env=self.options.stage_env, devices=self.devices,
                          on_event=self._event, check_open=self._check_open)
    return LocalPlacement(specs, dict(os.environ, PYTHONUNBUFFERED="1", **self.options.stage_env), self._event)

  def _event(self, ev: dict) -> None:
    self.events.append(ev)
    if self.on_event is not None:
      try: self.on_event(ev)
      except Exception:  # noqa: BLE001 - a watcher's bug must not break generation
        log.warning("the launcher's on_event watcher raised on %s", ev.get("event"), exc_info=True)

  def _check_open(self) -> None:
    """start() goes on only while nobody closed the launcher (a server shutting down while it heals, say)."""
    if self._closed: raise errors.LauncherClosed("the launcher was closed while it started")

  def _expect(self, h: StageHandle, name: str, timeout: float, bound: float | None = None) -> dict:
    try: return self.pool.expect(h, name, timeout, bound)
    except errors.StageFailed as f: raise self._fail(f) from None

  def _fail(self, f: errors.StageFailed) -> errors.StageFailed:
    """A stage failed: end every stage, unlink every segment, and hand back the error to raise."""
    self._event({"event": "StageFailed", "stage": f.stage, "reason": f.reason, "message": f.detail})
    self._failure = self._failure or f
    self.close(grace_s=FAIL_GRACE_S)
    return f

  # --- health ------------------------------------------------------------------------------------
  def alive(self) -> list[bool]: return [h.alive for h in self.handles]

  def serving(self) -> bool:
    """Streams can be served now: started, not closed, and the driver thread (which every stream needs) running."""
    return self.driver is not None and not self._closed and self.driver.thread.is_alive()

  def ring_occupancy(self) -> list[float]:
    """Fill fraction of each ring, head ingress first and the tail's egress last."""
    if self.pool is None or self._closed: return []
    return self.pool.placement.ring_occupancy()

  def stage_view(self) -> list[dict]:
    """What each stage is and last said of itself, without a round trip (StagePool.view)."""
    if self.pool is None: return []
    return self.pool.view(self.planned.split if self.planned else [], self.planned.devices if self.planned else [])

  def profile_reports(self, wait_s: float = 0.0) -> list[dict]:
    """Each stage's latest ProfileReport (PYRUNTIME_PROFILE, pyruntime/stage/profiler.py): its hottest lines and CPU over wall.
    After close(), `wait_s` lets each stage's last output (its report at exit) be read first."""
    return [] if self.pool is None else self.pool.profile_reports(self.events, wait_s)

  def stage_stats(self, timeout: float = 10.0) -> list[dict]:
    """Each stage's counters (records, tokens, compute_s, wait_s, wall_s), asked over the control channel."""
    with self._stats_lock:
      for h in self.handles: h.send(Command.QUERY_STATS)
      return [self._expect(h, Event.STAGE_STATS, timeout) for h in self.handles]

  def expert_load(self) -> list[list[int] | None]:
    """Per stage, how often its last MoE block routed a token to each expert (None: the stage counts none, see
    model.StageModel.expert_load); [] for a model without experts, which costs no round trip."""
    if not int(self.header.get("expert_count", 0)): return []
    return [s.get("expert_load") for s in self.stage_stats()]

  def prefix_cache_stats(self) -> dict:
    """The prefix cache's counters (PrefixIndex.snapshot) and its host memory in all stages; {"enabled": False, "why": ...}
    when it is off."""
    if self.driver is None: return self.prefix.stats()
    with self.driver.lock: return self.prefix.stats()

  def scheduler_stats(self) -> dict:
    """Streams running (in the pipeline) and waiting (for a slot); tokens out; the tail's steps (a group of records
    chained by MORE is one step) and their sizes; output tokens per second over the last few seconds (Driver.stats)."""
    if self.driver is None:
      return {**stream_stats(Tally(), 0, 0, self.options.max_streams, self.options.speculative), "prefix_cache": self.prefix.stats()}
    with self.driver.lock: return {**self.driver.stats(), "prefix_cache": self.prefix.stats()}

  def driver_cpu_s(self) -> float:
    """CPU seconds the driver thread has used (reading, text, next tokens, its polls): the launcher's own cost."""
    return 0.0 if self.driver is None else self.driver.cpu_s()

  # --- generation --------------------------------------------------------------------------------
  def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False, tools: Any = None) -> list[int]:
    if self.requests is None: raise AttributeError("prompt_ids: the launcher has not planned yet (plan() or start())")
    return self.requests.prompt_ids(prompt, messages, raw, tools)

  def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *, raw: bool = False,
               max_tokens: int | None = 256, stop: str | Sequence[str] | None = None, logits: bool = False,
               ignore_eos: bool = False, **sampling: Any) -> Iterator[Delta | Logits | Done]:
    """Stream a completion: `Delta`s as text becomes final, then one `Done`. Thread-safe: every call is one stream,
    and up to `max_streams` of them run through the pipeline together (the rest wait, first come first served).

    Options (docs/serving.md): max_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty,
    frequency_penalty, presence_penalty, penalty_last_n, stop. Bad values raise `InvalidOption` naming the field
    before anything runs; `raw=True` skips the chat template; `ignore_eos=True` generates through end tokens
    (benchmarks: a fixed number of tokens). Closing the iterator early cancels the stream and frees its slot.
    """
    if sampling.get("n", 1) != 1:  # one iterator is one stream's events; several completions are several handles
      raise errors.InvalidOption("n", f"generate yields one completion, not {sampling['n']!r}: submit(..., n=..., on_event=...) runs several")
    events: queue.SimpleQueue = queue.SimpleQueue()
    st = self.submit(prompt, messages, raw=raw, max_tokens=max_tokens, stop=stop, logits=logits, ignore_eos=ignore_eos,
                     on_event=events.put, **sampling)
    it = self._iterate(st, events)
    # an iterator dropped before its first next() never runs its `finally`: its stream would run to the end
    weakref.finalize(it, st.cancel).atexit = False
    return it

  def submit(self, prompt: str | None = None, messages: list[dict] | None = None, *, raw: bool = False,
             max_tokens: int | None = 256, stop: str | Sequence[str] | None = None, logits: bool = False,
             ignore_eos: bool = False, cache_salt: str | None = None, prefix_cache: bool = True,
             response_format: dict | None = None, tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None, speculative: bool = True, prediction: str | None = None,
             logprobs: int | None = None, prompt_logprobs: bool = False, prompt_ids: list[int] | None = None, n: int = 1,
             on_event: Callable[..., None], **sampling: Any) -> StreamHandle | list[StreamHandle]:
    """Start one stream without a thread of its own: `on_event` is called from the launcher's driver thread with each
    `Delta` / `Logits`, then exactly one final `Done` or exception instance (a `PyruntimeError`). It must not block
    (an asyncio caller hands events over with `loop.call_soon_threadsafe`). Validation and tokenisation run here, in
    the caller's thread, and raise before anything is queued. With `tools` (OpenAI's function tools, `tool_choice`,
    `parallel_tool_calls`; docs/tools.md) calls are parsed out of the text: `Delta.tool_calls` and `Done.tool_calls`,
    finish reason "tool_calls". `logprobs=k` (0..20) gives every token its log-probability and the k most likely tokens'
    (`Delta.logprobs`, `Done.logprobs`); `prompt_logprobs=True` scores the prompt too (`Done.prompt_logprobs`; with
    max_tokens=0 nothing is generated); `prompt_ids` is the prompt as token ids (in place of prompt and messages).

    `n` > 1 (OpenAI's n): n streams of one request, a list of their handles; `on_event(i, ev)` names the choice. The
    prompt is tokenized once and, with the prefix cache, computed once: the other choices wait until the first one's
    prompt is in the cache and read it from there. Choice i samples with params.choice_seed(seed, i)."""
    if not callable(on_event): raise TypeError(f"submit(): on_event must be callable, got {on_event!r:.80}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
      raise errors.InvalidOption("n", f"must be an integer from 1 to {MAX_CHOICES}, got {n!r:.80}")
    if self.requests is None:  # not planned: a bad option is still named before that is said
      from pyruntime.params import check_request
      check_request(max_tokens, sampling, stop)
      raise errors.LauncherClosed("the launcher is not running")
    req = self.requests.build(prompt, messages, raw=raw, max_tokens=max_tokens, stop=stop, logits=logits, ignore_eos=ignore_eos,
                              cache_salt=cache_salt, prefix_cache=prefix_cache, response_format=response_format, tools=tools,
                              tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, speculative=speculative,
                              prediction=prediction, sampling=sampling, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              prompt_ids=prompt_ids)
    if self._closed or self.driver is None: raise errors.LauncherClosed("the launcher is not running")
    return self._enqueue(req, n, on_event)

  def _enqueue(self, req: Any, n: int, on_event: Callable[..., None]) -> StreamHandle | list[StreamHandle]:
    if n == 1:
      st = StreamHandle(self.driver, next(self.driver.stream_ids), req, on_event)
      self.driver.enqueue(st)
      return st
    from pyruntime.params import choice_seed
    handles: list[StreamHandle] = []
    for i in range(n):
      r = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=choice_seed(req.params.seed, i)))
      handles.append(StreamHandle(self.driver, next(self.driver.stream_ids), r, functools.partial(on_event, i), handles[0] if handles else None))
    queued = 0
    try:
      for st in handles: self.driver.enqueue(st); queued += 1
    except BaseException:
      for st in handles[:queued]: st.cancel()
      raise
    return handles

  def _iterate(self, st: StreamHandle, events: queue.SimpleQueue) -> Iterator[Delta | Logits | Done]:
    try:
      while True:
        ev = events.get()
        if isinstance(ev, BaseException): raise ev
        yield ev
        if isinstance(ev, Done): return
    finally:
      st.cancel()  # a consumer that walked away (or an error): free the slot; a no-op once the stream ended

  # --- stop --------------------------------------------------------------------------------------
  def close(self, grace_s: float = STOP_GRACE_S) -> None:
    """End every stage process and unlink every segment. Safe to call twice, from any state.

    In order: close our ring sides (the stages drain and stop their loops), ShutdownWorker, and
    after `grace_s` SIGKILL. After a failure the survivors get SIGTERM at once instead.
    """
    # closed by someone else (a server's supervisor, say) after a stage died, before the driver saw it: the streams
    # still learn which stage failed, not just that the launcher closed
    if self._failure is None and not self._closed and self.pool is not None: self._failure = self.pool.first_failure()
    self._closed = True
    d = self.driver
    if d is not None:
      d.closed = True  # the driver stops reading; if it is closing the launcher itself (a failure), that finishes first
      if d.thread is not threading.current_thread():
        d.wake(STOP_GRACE_S)
        d.thread.join(STOP_GRACE_S)  # the bound is for a driver stuck in a consumer's callback: closing goes on regardless
    with self._close_lock:
      if self._shut:  # after the shutdown: end what a start() in another thread made since (a stage, the arena, a drafter)
        if self.pool is not None: self.pool.kill()
        if self._draft_lm is not None: self._draft_lm.close(0.0)
        return
      self._shut = True
      self._shutdown(grace_s)

  def _shutdown(self, grace_s: float) -> None:
    if self.driver is not None:
      for side in (self.driver.head, self.driver.tail):
        try: side.close()
        except errors.PyruntimeError: pass
    if self.pool is not None: self.pool.stop(grace_s, failed=grace_s < STOP_GRACE_S)
    if self._draft_lm is not None: self._draft_lm.close(grace_s)
    # the streams learn last, so whoever sees their error finds every stage gone and every segment unlinked
    if self.driver is not None: self.driver.fail_all(self._failure or errors.LauncherClosed("the launcher closed while the stream ran"))
    if self.pool is not None: self.pool.placement.sweep()  # a lost host's segments: on its node, after the streams know
    self._event({"event": "LauncherClosed"})
    self._restore_sigterm()

  def _install_sigterm(self) -> None:
    # SIGTERM's default action would skip every finally: turn it into SystemExit so close() runs.
    if threading.current_thread() is not threading.main_thread(): return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
      def on_term(signum: int, frame: Any) -> None: raise SystemExit(128 + signum)
      self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

  def _restore_sigterm(self) -> None:
    if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self._old_sigterm)
      self._old_sigterm = None


def _pow2(n: int) -> int: return 1 << max(12, (n - 1).bit_length())
