"""The launcher: spawns the stage processes, wires their rings and drives generation.

    with Launcher(stages=2) as lm:
        for ev in lm.generate("What is the capital of France?", max_tokens=32):
            if isinstance(ev, Delta): print(ev.text, end="")

Data flows one way: launcher → head ring → stage → ring → … → tail → ring → launcher. The
launcher closes the loop itself (it must see every token anyway, to decode text and apply
stop strings), so the head never waits on a token the launcher would have to cancel.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import math
import os
import queue
import signal
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from pyruntime import errors
from pyruntime.devices import available_memory
from pyruntime.events import Delta, Done, Logits, Timings, Usage
from pyruntime.options import check_launch
from pyruntime.prefix_cache import BLOCK, PREFIX_CACHE_TOKENS, PrefixIndex
from pyruntime.protocol import (
  ABI_VERSION,
  FLAG_CACHE,
  FLAG_CLOSE,
  FLAG_END,
  FLAG_ERROR,
  FLAG_MORE,
  FLAG_OPEN,
  MAX_VERIFY_ROWS,
  PREFILL_SHARE,
  STALL_CAPTURE_TIMEOUT_S,
  STALL_STEPS,
  STALL_TIMEOUT_S,
  Command,
  Event,
  OpenInfo,
  decode_json,
  encode_json,
  object_id,
  ring_bytes,
  split_object_id,
)
from pyruntime.speculation import POSITIONS, SOLO_STREAMS, DraftLength, ngram_draft, prediction_draft
from pyruntime.stage_pool import AFTERMATH, LocalPlacement, StageHandle, first_failure, kill_stages, profile_reports, stage_view, stalled, stop_stages
from pyruntime.tools import CallFormat, ToolCall, ToolCallParser, ToolRequest, check_tools

log = logging.getLogger("pyruntime.launcher")

if TYPE_CHECKING:  # the ring hands out arrays; the launcher itself needs no numpy (the ring is imported at start)

  from pyruntime.gguf import GGUFHeader
  from pyruntime.hosts import RayPlacement
  from pyruntime.ring import Arena, Reader, RingSpec, Writer
  from pyruntime.tokenizer import Tokenizer

POLL_S = 0.05          # how often a waiting launcher looks at its stages' health
DRIVER_WAKE_S = 0.5    # the driver's backstop: a token, a closed or dead tail ring and close() wake it at once
STOP_GRACE_S = 5.0     # how long a stage gets to stop in order before it is killed
RATE_WINDOW_S = 5.0    # tokens/s in scheduler_stats is measured over this window
SETTLE_S = 0.5         # how long a closed tail ring waits for the failure behind it to be reported
FAIL_GRACE_S = 0.5     # after a failure the survivors get SIGTERM and this long before SIGKILL


class StreamHandle:
  """One stream of a launcher: its request, its text state and where its events go. Its methods but `cancel` run
  under the launcher's lock, on the driver thread."""

  def __init__(self, launcher: Launcher, sid: int, ids: list[int], n_max: int, params: Any, stopper: Any, want_logits: bool,
               end_ids: frozenset[int], sink: Callable[[Any], None], cache_salt: str | None = None, prefix_cache: bool = True):
    from pyruntime.tokenizer import IncrementalDecoder
    self.launcher, self.id, self.ids, self.n_max, self.params = launcher, sid, ids, n_max, params
    self.stopper, self.want_logits, self.end_ids, self.sink = stopper, want_logits, end_ids, sink
    self.cache_salt, self.prefix_cache = cache_salt, prefix_cache
    self.sink_failed = False  # its callback raised once (logged)
    self.grammar: str | None = None  # a structured answer's grammar (response_format, tools), enforced at the tail
    self.parser: ToolCallParser | None = None  # reads tool calls out of the text, when the request offered tools
    self.calls: list[ToolCall] = []
    self.drafts: DraftLength | None = None  # a speculative stream's draft length (pyruntime/speculation.py)
    self.verify: tuple[int, list[int], dict[int, tuple[int, bool]]] | None = None  # in flight: (position, drafts, answers)
    self.rounds = self.drafted = self.accepted = 0
    self.predicted: list[int] = []      # OpenAI's `prediction`, tokenized: a drafter of its own
    self.from_prediction = False        # the draft in flight came from it
    self.prediction_kept = self.prediction_rejected = 0
    self.cached = 0     # prompt positions copied in from the prefix cache
    self.computed = 0   # positions every stage has computed: the tail answered them
    self.decoder = IncrementalDecoder(launcher.tokenizer)
    self.slot, self.state, self.ended = -1, "waiting", False   # state: waiting -> open -> closing -> done
    self.out: list[int] = []
    self.text: list[str] = []
    self.t_submit = time.monotonic()
    self.t_admitted: float | None = None
    self.t_first: float | None = None
    self.t_last: float | None = None

  def cancel(self) -> None:
    """Stop this stream: a waiting one leaves the queue, a running one is closed in every stage. Idempotent."""
    self.launcher._cancel(self)

  def emit(self, ev: Any) -> None:
    lm = self.launcher
    if lm._outbox is not None and threading.get_ident() == lm._driver_tid: lm._outbox.append((self, ev))
    else: self.deliver(ev)

  def deliver(self, ev: Any) -> None:
    # whatever a consumer's callback raises (KeyboardInterrupt, SystemExit too) must not end the driver thread, which
    # every other stream depends on
    try: self.sink(ev)
    except BaseException as e:  # noqa: BLE001
      if not self.sink_failed:  # once per stream: a callback that raises on every event would flood the log
        self.sink_failed = True
        log.warning("stream %d: its on_event callback raised %s: %s (dropped, and any later ones)", self.id, type(e).__name__, e)

  def push(self, token: int, end: bool, now: float | None = None) -> bool:
    """One sampled token (that arrived at `now`, monotonic); True when the stream is finished (its Done went out)."""
    self.t_last = time.monotonic() if now is None else now
    if self.t_first is None: self.t_first = self.t_last
    if end: return self.finish("stop", None)
    self.out.append(token)
    safe, stop_hit = self.stopper.push(self.decoder.push(token))
    self.emit(self._delta(safe, [token]))  # "" while held back (a possible stop string, half a UTF-8 character or marker)
    if stop_hit is not None: return self.finish("stop", stop_hit)
    if len(self.out) >= self.n_max: return self.finish("length", None)
    return False

  def finish(self, reason: str, stop_hit: str | None) -> bool:
    if stop_hit is None:
      if rest := self.stopper.flush(self.decoder.flush()): self.emit(self._delta(rest, []))
      if self.stopper.matched is not None: reason, stop_hit = "stop", self.stopper.matched  # the last bytes completed a stop string
    if self.parser is not None and ((d := self._delta("", [], last=True)).text or d.tool_calls): self.emit(d)
    if self.calls and reason == "stop": reason = "tool_calls"
    self.emit(self.final(reason, stop_hit))
    return True

  def _delta(self, text: str, token_ids: list[int], last: bool = False) -> Delta:
    """The Delta of newly final text: with tools offered, the parser takes the calls out of it (`last`: and what it
    still holds, an unclosed span as text)."""
    calls: list[ToolCall] = []
    if self.parser is not None:
      text, calls = self.parser.feed(text)
      if last: text, calls = text + (fin := self.parser.finish())[0], calls + fin[1]
      self.calls += calls
    if text: self.text.append(text)
    return Delta(text, token_ids, calls)

  def final(self, reason: str, stop_hit: str | None = None) -> Done:
    """The stream's one Done, its timings up to now: the stream has ended."""
    now, out = time.monotonic(), self.out
    t0, t_first, t_last = self.t_submit, self.t_first or now, self.t_last or now
    decode = (len(out) - 1) / (t_last - t_first) if len(out) > 1 and t_last > t_first else 0.0
    timings = Timings(round(self.launcher.load_s, 4), round(t_first - t0, 4), round(decode, 3), round(now - t0, 4),
                      round((self.t_admitted or t0) - t0, 4), self.rounds, self.drafted, self.accepted)
    self.ended = True
    usage = Usage(len(self.ids), len(out), self.cached, self.prediction_kept, self.prediction_rejected)
    return Done(reason, usage, timings, self.ids, list(out), "".join(self.text), stop_hit,
                list(self.calls))

  def fail(self, e: BaseException) -> None:
    if not self.ended:
      self.ended = True
      self.emit(e)
    if self.state != "closing": self.state = "done"

  def closed(self) -> None: self.state = "done"


def recipe_digest(model: str, split: Sequence[tuple[int, int]], dtype: str, template: str) -> str:
  """Names what produced a result: model, split, boundary dtype and chat template."""
  return hashlib.sha256(json.dumps([model, [list(r) for r in split], dtype, template]).encode()).hexdigest()[:16]


class Launcher:
  def __init__(self, model: str | os.PathLike | None = None, *, stages: int = 2, split: Sequence[tuple[int, int]] | None = None,
               devices: str | Sequence[str] | None = None, boundary_dtype: str = "float32", max_streams: int = 8,
               decode: str = "batched", weights: str = "auto", warmup: bool = False, max_context: int | None = None,
               prefill_share: float = PREFILL_SHARE, on_event: Callable[[dict], None] | None = None,
               cache_dir: str | None = None, stage_env: dict[str, str] | None = None, load_timeout_s: float = 900.0,
               prefix_cache: int = PREFIX_CACHE_TOKENS, graph_cache: bool = True, stall_timeout: float = STALL_TIMEOUT_S,
               stall_capture_timeout: float = STALL_CAPTURE_TIMEOUT_S, speculative: str = "off", draft_tokens: int = 8,
               placement: str = "local", ray_address: str | None = None, hosts: int | None = None):
    check_launch(boundary_dtype=boundary_dtype, max_streams=max_streams, decode=decode, weights=weights, prefill_share=prefill_share,
                 prefix_cache=prefix_cache, stall_timeout=stall_timeout, stall_capture_timeout=stall_capture_timeout,
                 speculative=speculative, draft_tokens=draft_tokens)
    self.speculative, self.draft_tokens = speculative, draft_tokens
    if placement not in ("local", "ray"): raise errors.InvalidOption("placement", f"must be local or ray, not {placement!r:.80}")
    if placement == "ray":
      from pyruntime.hosts import require_ray
      require_ray()  # refused now, naming the extra, rather than at start
    elif ray_address is not None or hosts is not None:
      raise errors.InvalidOption("placement", "ray_address and hosts need placement='ray'")
    self.placement_wanted, self.ray_address, self.hosts_wanted = placement, ray_address, hosts
    self.rows_everywhere = False  # every stage runs the rows path (start): what speculation needs
    self._tools_format: tuple[CallFormat, bool] | None = None
    self.spec: dict[str, Any] = {"rounds": 0, "drafted": 0, "accepted": 0, "drafted_at": [0] * POSITIONS, "accepted_at": [0] * POSITIONS}
    self.prefix_cache_tokens = prefix_cache
    self.stall_timeout, self.stall_capture_timeout = float(stall_timeout), float(stall_capture_timeout)
    if not isinstance(graph_cache, bool): raise errors.InvalidOption("graph_cache", f"must be true or false, got {graph_cache!r}")
    self.graph_cache = graph_cache  # stages load their captured graphs from disk, and keep new ones (pyruntime/graph_cache.py)
    self.prefix: PrefixIndex | None = None  # the prefix cache's index, once every stage said it keeps blocks (start)
    self.prefix_off = "not started"         # why there is none
    self.cache_decoded = False              # decoded positions may be cached too (every stage on the rows path)
    self.weights_wanted, self.prefill_share = weights, prefill_share
    self.model_source, self.stages_wanted, self.split_wanted = model, stages, split
    self.devices_wanted, self.boundary_dtype, self.max_streams, self.decode = devices, boundary_dtype, max_streams, decode
    self.warmup = warmup  # capture every batch shape's kernels at start (a server's choice) rather than on first use
    self.max_context_wanted, self.on_event, self.cache_dir = max_context, on_event, cache_dir
    self.stage_env, self.load_timeout_s = dict(stage_env or {}), load_timeout_s
    self.events: list[dict] = []          # every event seen, in order: the plain way to look at them
    self.handles: list[StageHandle] = []
    self.placement: LocalPlacement | RayPlacement | None = None  # where the stages run and the rings that join them
    self.head: Writer | None = None       # writer of the head ring
    self.tail: Reader | None = None       # reader of the tail's egress ring
    self._lock = threading.Lock()         # the head ring's producer side, the slots and the queue (see _admit)
    # held (before self._lock, never under it) while events go out to consumers, outside self._lock: a callback may
    # call submit() or cancel() (which take self._lock), and a cancelled stream's Done cannot overtake its last Delta
    self._delivering = threading.RLock()
    self._stream_ids = itertools.count(1)
    self._free_slots = list(range(max_streams))
    self._waiting: collections.deque[StreamHandle] = collections.deque()
    self._active: dict[int, StreamHandle] = {}
    self._driver: threading.Thread | None = None
    self.tokens_out = self.steps = self.step_rows = self.last_batch = 0
    self._group = 0                       # token records seen of the tail's current step
    self._next: list[tuple[StreamHandle, int, int]] = []  # next tokens of the tail's current step, written when it is complete
    # the driver's events of the tail's current step, handed out (still under the lock, so in order with every other
    # event) once the step's next tokens are written: the stages start sooner, and a consumer woken by its event finds
    # the GIL free more often (the driver blocks on the ring right after), instead of waking twice
    self._outbox: list[tuple[StreamHandle, Any]] | None = None
    self._driver_tid = -1
    self._token_times: collections.deque[float] = collections.deque(maxlen=4096)
    self._closed = False                  # no new streams, the driver stops
    self._shut = False                    # the stages are gone and the arena unlinked
    self._failure: errors.StageFailed | None = None  # what ended the pipeline, for every stream still running
    self._close_lock = threading.Lock()
    self._stats_lock = threading.Lock()   # one QueryStats round trip at a time (the server's /metrics, a benchmark)
    self._old_sigterm: Any = None
    # launcher time per token, between a token's arrival and the next write (on a loaded machine it includes being
    # preempted by the stage we just woke); the driver thread's whole CPU is `driver_cpu_s()`
    self.overhead = {"tokens": 0, "seconds": 0.0}

  # --- start -------------------------------------------------------------------------------------
  @property
  def started(self) -> bool:
    """start() has finished: the pipeline runs (or ran: see alive())."""
    return self.head is not None

  def __enter__(self) -> "Launcher":
    self.start()
    return self

  def __exit__(self, *exc: Any) -> None: self.close()

  def plan(self) -> None:
    """Everything decided in this process before a stage exists: the model file, the split, the devices, the sizes.
    It reads the GGUF header only (pyruntime.plan), so the launcher process never imports tinygrad."""
    from pyruntime.devices import parse_devices
    from pyruntime.gguf import read_header
    from pyruntime.plan import plan_split
    from pyruntime.source import resolve_model
    from pyruntime.tokenizer import Tokenizer
    self.path = resolve_model(None if self.model_source is None else str(self.model_source), cache_dir=self.cache_dir,
                              on_progress=lambda done, total: self._event({"event": Event.DOWNLOAD_PROGRESS, "bytes": done, "total": total}))
    self.header: GGUFHeader = read_header(self.path)
    self.model_name = self.header.kv.get("general.name") or self.path.stem
    self.num_blocks = self.header.num_blocks
    n = len(self.split_wanted) if self.split_wanted else self.stages_wanted
    if not isinstance(n, int) or isinstance(n, bool) or n < 1: raise errors.InvalidOption("stages", f"must be an integer >= 1, got {n!r}")
    self.devices = parse_devices(self.devices_wanted, n)
    # stages on devices of their own compute at once when the streams are cut into one micro-batch per stage; stages
    # that share the CPU would only take cores from each other
    self.micro_batches = n if len(set(self.devices)) == len(self.devices) and not any(d.upper().startswith("CPU") for d in self.devices) else 1
    fits = 4 * sum(math.prod(t.dims) for t in self.header.tensors.values()) <= available_memory() // 2  # float32 copy
    self.weights = [self._weights_for(d, fits) for d in self.devices]
    # balanced by what a decode step takes on each stage: the bytes it reads of its weights, in the form it holds them
    self.split = plan_split(self.header, n, self.split_wanted, by="time-float32" if all(w == "float32" for w in self.weights) else "time")
    self.context_length = int(min(self.max_context_wanted or 1 << 62, self.header.get("context_length")))
    self.tokenizer: Tokenizer = Tokenizer.from_gguf_kv(self.header.kv)
    self.dim = int(self.header.get("embedding_length"))
    self.vocab_size = self.tokenizer.vocab_size

  def _weights_for(self, device: str, float32_fits: bool) -> str:
    """How a stage on `device` keeps its weights (protocol.WEIGHT_MODES). "auto": tinygrad's own "quantized" for
    reference decoding (its exact tokens) and on accelerators; on a CPU, "float32" (several times faster there) when a
    float32 copy of the whole model takes at most half of the memory available now, every stage sharing it."""
    from pyruntime.plan import DENSE_ARCHS
    if self.weights_wanted != "auto": return self.weights_wanted
    if self.decode == "reference" or not device.upper().startswith("CPU") or self.header.arch not in DENSE_ARCHS:
      return "quantized"  # the other families decode with tinygrad's own kernels, one stream at a time (see stage.py)
    return "float32" if float32_fits else "quantized"

  def start(self) -> "Launcher":
    from pyruntime.boundary import Boundary
    from pyruntime.ring import RingSpec
    t0 = time.monotonic()
    self._install_sigterm()
    try:
      self.plan()
      itemsize = 2 if self.boundary_dtype == "float16" else 4
      # ring i feeds stage i; ring n carries the tail's tokens back (sizes: protocol.ring_bytes)
      # a residual row is hidden_states and what else the family's boundary carries (router logits, positions), in units
      # of the boundary dtype
      row = Boundary.residual(self.header.arch, 1, self.dim, self.boundary_dtype, int(self.header.get("expert_count", 0))).token_bytes
      rb = ring_bytes(self.context_length, row // itemsize, itemsize, self.vocab_size, self.max_streams)
      specs = [RingSpec(capacity=_pow2(rb["head_capacity"]), max_extent=rb["head"], alignment=4)]
      specs += [RingSpec(capacity=_pow2(rb["mid_capacity"]), max_extent=rb["mid"], alignment=itemsize) for _ in self.split[1:]]
      specs.append(RingSpec(capacity=_pow2(rb["tail_capacity"]), max_extent=rb["tail"], alignment=4))
      self.placement = self._place(specs)
      self._event({"event": "ArenaCreated", "name": self.arena.name, "rings": len(specs)})
      for i in range(len(self.split)):  # one at a time: a close() from another thread meanwhile sees each one it must end
        self._check_open()
        self.handles.append(self._spawn(i))
      self._check_open()
      for h, (start, end), dev, w in zip(self.handles, self.split, self.devices, self.weights, strict=True):
        h.send(Command.INITIALIZE_WORKER, device=dev, abi_version=ABI_VERSION)
        h.send(Command.CONFIGURE_ROLE, stage=h.index, start=start, end=end, slots=self.max_streams, boundary_dtype=self.boundary_dtype,
               max_context=self.context_length, decode=self.decode, warmup=self.warmup, weights=w, graph_cache=self.graph_cache,
               micro_batches=self.micro_batches, prefill_share=self.prefill_share, prefix_blocks=self.prefix_cache_tokens // BLOCK,
               block_size=BLOCK)
        h.send(Command.LOAD_WEIGHTS, model=self.placement.model_path(h) or str(self.path), cache_dir=self.cache_dir)
      for h in self.handles:  # the stages load in parallel; we just collect
        h.info = self._expect(h, Event.WEIGHTS_LOADED, self.load_timeout_s)
        h.info["warm_up"] = self._expect(h, Event.WARMED_UP, self.load_timeout_s)
      self._plan_prefix_cache()
      self.rows_everywhere = all(h.info.get("batched") for h in self.handles)
      for h in self.handles:
        upstream = self.handles[h.index - 1].info["boundary"] if h.index > 0 else None
        h.send(Command.INSTALL_RING, **self.placement.ring_args(h), ingress_boundary=upstream)
      for h in self.handles: self._expect(h, Event.RING_INSTALLED, 30)
      self.head, self.tail = self.arena.writer(self.placement.head_ring), self.arena.reader(self.placement.tail_ring)
      # A token comes every step (ms at least): spinning for it only takes a core from the stages. Parked, the ring
      # checks the tail stage's liveness (a kill and a /proc read, costly on cold caches) only every DRIVER_WAKE_S, not
      # every POLL_S: a stage that dies closes its rings or is seen by its neighbours, which close theirs, so the driver
      # learns at once; this check (with _first_failure at DRIVER_WAKE_S) is only the backstop for a killed tail.
      self.tail.set_wait(spin=0.0, poll=DRIVER_WAKE_S)
      self.template = self.header.kv.get("tokenizer.chat_template") or ""
      self.recipe = recipe_digest(self.model_name, self.split, self.boundary_dtype, self.template)
      self.load_s = time.monotonic() - t0
      for h in self.handles: h.progress_t = time.monotonic()
      self._driver = threading.Thread(target=self._drive, name="launcher-driver", daemon=True)
      self._driver.start()
      self._event({"event": "LauncherReady", "load_s": round(self.load_s, 3), "split": [list(r) for r in self.split],
                   "devices": self.devices})
    except BaseException:
      self.close()
      raise
    return self

  def _plan_prefix_cache(self) -> None:
    """The prefix cache is on when it was asked for and every stage keeps blocks (a model with recurrent blocks has
    none: its state is not a function of positions alone)."""
    caches = [h.info.get("prefix_cache") for h in self.handles]
    if not self.prefix_cache_tokens // BLOCK: self.prefix_off = "off (prefix_cache=0)"
    elif not all(caches): self.prefix_off = f"off: {self.header.arch} has recurrent blocks, whose state cannot be cut at a position"
    else:
      self.prefix, self.prefix_off = PrefixIndex(self.prefix_cache_tokens // BLOCK, BLOCK), ""
      # a decoded position is cached only if a decode row computes a prompt row's bits: every stage on the rows path
      self.cache_decoded = all(c["decoded_positions"] for c in caches)
      self.prefix_bytes_per_token = sum(c["bytes_per_token"] for c in caches)

  def prefix_cache_stats(self) -> dict:
    """The prefix cache's counters (PrefixIndex.snapshot) and its host memory in all stages; {"enabled": False, "why": ...}
    when it is off."""
    with self._lock: return self._prefix_stats()

  def _prefix_stats(self) -> dict:
    if self.prefix is None: return {"enabled": False, "why": self.prefix_off}
    snap = self.prefix.snapshot()
    return {"enabled": True, **snap, "bytes_held": snap["held_blocks"] * BLOCK * self.prefix_bytes_per_token,
            "bytes_budget": snap["blocks"] * BLOCK * self.prefix_bytes_per_token, "caches_decoded_positions": self.cache_decoded}

  def _place(self, specs: list[RingSpec]) -> LocalPlacement | RayPlacement:
    """Every stage on this host (one arena), or over Ray nodes (docs/hosts.md: agents, bridges)."""
    if self.placement_wanted == "ray":
      from pyruntime.hosts import RayPlacement, model_identity
      source = None if self.model_source is None else str(self.model_source)
      return RayPlacement(specs=specs, n_stages=len(self.split), hosts=self.hosts_wanted, address=self.ray_address, source=source,
                          cache_dir=self.cache_dir, local_model=model_identity(self.path), env=self.stage_env, devices=self.devices,
                          on_event=self._event, check_open=self._check_open)
    return LocalPlacement(specs, dict(os.environ, PYTHONUNBUFFERED="1", **self.stage_env), self._event)

  @property
  def arena(self) -> Arena | None:
    """The arena of this process's rings: every ring of the pipeline, or (over several hosts) the head and tail rings."""
    return None if self.placement is None else self.placement.arena

  def _spawn(self, index: int) -> StageHandle:
    h = self.placement.spawn(index)
    self._event({"event": "StageSpawned", "stage": index, "pid": h.proc.pid})
    return h

  def _event(self, ev: dict) -> None:
    self.events.append(ev)
    if self.on_event is not None:
      try: self.on_event(ev)
      except Exception:  # noqa: BLE001 - a watcher's bug must not break generation
        log.warning("the launcher's on_event watcher raised on %s", ev.get("event"), exc_info=True)

  def _check_open(self) -> None:
    """start() goes on only while nobody closed the launcher (a server shutting down while it heals, say)."""
    if self._closed: raise errors.LauncherClosed("the launcher was closed while it started")

  def _expect(self, h: StageHandle, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
      self._check_open()
      try: ev = h.events.get(timeout=min(POLL_S * 4, max(0.0, deadline - time.monotonic())))
      except queue.Empty: ev = {}
      if ev is None or (ev and ev.get("event") == Event.WORKER_FATAL):
        raise self._fail(h.failure() or errors.StageFailed(h.index, "WorkerExited"))
      if ev and ev.get("event") == name: return ev
      if (f := self._first_failure()) is not None: raise self._fail(f)
      if time.monotonic() > deadline: raise self._fail(errors.StageFailed(h.index, "Timeout", f"no {name} within {timeout:.0f} s"))

  def stall_bound(self, h: StageHandle) -> float:
    """How long stage h may have work and make no progress: `stall_timeout`, or STALL_STEPS of its slowest step if that
    is longer; `stall_capture_timeout` while it captures a graph (it says so before, and beats again after)."""
    b = h.beat or {}
    if b.get("capturing"): return self.stall_capture_timeout
    return max(self.stall_timeout, STALL_STEPS * float(b.get("slowest_s") or 0.0))

  def _stalled(self) -> errors.StageStalled | None:
    """The stall rule (docs/control-channel.md, "Stalls"), checked while streams are in the pipeline (the driver waits on
    them): a stage is stalled when its last progress (a step finished or a record taken, counted by its data loop's
    own thread and reported in Heartbeats; or a Heartbeat saying it had nothing to do) is older than its bound."""
    with self._lock:
      if not self._active: return None
    return stalled(self.handles, self.stall_bound)

  def _first_failure(self) -> errors.StageFailed | None: return first_failure(self.handles)

  def _root_cause(self) -> errors.StageFailed | None:
    """The tail ring closed under the driver: the failure that closed it, given up to SETTLE_S to be reported (a
    stage's fatal event, or a remote host's, can come after the close that it caused has run down the rings)."""
    deadline = time.monotonic() + SETTLE_S
    while (f := self._first_failure()) is None or f.reason in AFTERMATH:
      if time.monotonic() > deadline: return f
      time.sleep(POLL_S / 5)
    return f

  def _fail(self, f: errors.StageFailed) -> errors.StageFailed:
    """A stage failed: end every stage, unlink every segment, and hand back the error to raise."""
    self._event({"event": "StageFailed", "stage": f.stage, "reason": f.reason, "message": f.detail})
    self._failure = self._failure or f
    self.close(grace_s=FAIL_GRACE_S)
    return f

  # --- health ------------------------------------------------------------------------------------
  def alive(self) -> list[bool]: return [h.alive for h in self.handles]

  def ring_occupancy(self) -> list[float]:
    """Fill fraction of each ring, head ingress first and the tail's egress last."""
    if self.placement is None or self._closed: return []
    return self.placement.ring_occupancy()

  def stage_view(self) -> list[dict]:
    """What each stage is and last said of itself, without a round trip (stage_pool.stage_view)."""
    return stage_view(self.handles, getattr(self, "split", None) or [], getattr(self, "devices", None) or [])  # set by start()

  def profile_reports(self, wait_s: float = 0.0) -> list[dict]:
    """Each stage's latest ProfileReport (PYRUNTIME_PROFILE, pyruntime/profiler.py): its hottest lines and CPU over wall.
    After close(), `wait_s` lets each stage's last output (its report at exit) be read first."""
    return profile_reports(self.handles, self.events, wait_s)

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

  # --- generation --------------------------------------------------------------------------------
  def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False,
                 tools: ToolRequest | None = None) -> list[int]:
    from pyruntime.chat import build_prompt_ids
    return build_prompt_ids(self.tokenizer, self.header.kv, prompt=prompt, messages=messages, raw=raw, context_length=self.context_length,
                            tools=tools)

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
             on_event: Callable[[Any], None], **sampling: Any) -> StreamHandle:
    """Start one stream without a thread of its own: `on_event` is called from the launcher's driver thread with each
    `Delta` / `Logits`, then exactly one final `Done` or exception instance (a `PyruntimeError`). It must not block
    (an asyncio caller hands events over with `loop.call_soon_threadsafe`). Validation and tokenisation run here, in
    the caller's thread, and raise before anything is queued. With `tools` (OpenAI's function tools, `tool_choice`,
    `parallel_tool_calls`; docs/tools.md) calls are parsed out of the text: `Delta.tool_calls` and `Done.tool_calls`,
    finish reason "tool_calls"."""
    from pyruntime.params import check_request
    from pyruntime.textstream import StopStream, budget
    if not callable(on_event): raise TypeError(f"submit(): on_event must be callable, got {on_event!r:.80}")
    params = check_request(max_tokens, sampling, stop)
    if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > 1024):
      raise errors.InvalidOption("cache_salt", f"must be a string of at most 1024 characters, got {cache_salt!r:.80}")
    if not isinstance(prefix_cache, bool): raise errors.InvalidOption("prefix_cache", f"must be true or false, got {prefix_cache!r:.80}")
    offered = check_tools(tools, tool_choice, parallel_tool_calls)
    calls = offered is not None and offered.calls_allowed
    grammar = self._tool_grammar(offered, response_format, logits) if calls else self._grammar(response_format, logits)
    if self._closed or self.head is None: raise errors.LauncherClosed("the launcher is not running")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stopper = StopStream(stops)
    ids = self.prompt_ids(prompt, messages, raw, tools=offered)
    n_max = budget(max_tokens if max_tokens is not None else self.context_length, self.context_length, len(ids))
    st = StreamHandle(self, next(self._stream_ids), ids, n_max, params, stopper, logits, frozenset() if ignore_eos else self.tokenizer.end_ids,
                      on_event, cache_salt, prefix_cache)
    st.grammar = grammar
    if calls: st.parser = ToolCallParser(self._tool_format()[0])
    if not isinstance(speculative, bool): raise errors.InvalidOption("speculative", f"must be true or false, got {speculative!r:.80}")
    if prediction is not None:
      if not isinstance(prediction, str): raise errors.InvalidOption("prediction", f"must be the predicted text, got {prediction!r:.80}")
      st.predicted = self.tokenizer.encode(prediction, parse_special=False)[:self.context_length]
    # drafts (n-grams, or the caller's prediction) are verified exactly for greedy, free streams on the rows path
    # (docs/speculation.md); others decode plainly
    wanted = self.speculative == "ngram" or bool(st.predicted)
    if speculative and wanted and self.rows_everywhere and params.greedy and grammar is None and not logits:
      st.drafts = DraftLength(self.draft_tokens)
    with self._lock:
      if self._closed: raise errors.LauncherClosed("the launcher is not running")
      self._waiting.append(st)
      self._admit()
    return st

  def _grammar(self, response_format: dict | None, logits: bool) -> str | None:
    """A structured answer's grammar (pyruntime/grammar.py), checked against the vocabulary here, in the caller's
    thread: a schema that cannot be enforced is refused by name before anything runs, never answered unconstrained."""
    if response_format is None: return None
    from pyruntime.grammar import check, grammar_for
    if (grammar := grammar_for(response_format)) is None: return None
    if logits: raise errors.InvalidOption("response_format", "a structured answer samples its tokens: not with logits=True")
    check(grammar, self.tokenizer)
    return grammar

  def _tool_format(self) -> tuple[CallFormat, bool]:
    """The model's tool-call family (the same for every request: found once)."""
    if self._tools_format is None:
      from pyruntime.chat import require_tool_format
      self._tools_format = require_tool_format(self.header.kv)
    return self._tools_format

  def _tool_grammar(self, offered: ToolRequest, response_format: dict | None, logits: bool) -> str | None:
    """The grammar a call is decoded under (pyruntime/tools.py), checked here like a response_format's: None where the
    family's calls are parsed but not constrained (tool_choice 'auto' only)."""
    from pyruntime.grammar import MAX_GRAMMAR_BYTES, check, grammar_for
    if grammar_for(response_format) is not None:
      raise errors.InvalidOption("response_format", "a structured answer cannot be combined with tools (unless tool_choice is 'none')")
    if logits: raise errors.InvalidOption("tools", "tool calls are sampled under a grammar: not with logits=True")
    fmt = self._tool_format()[0]
    if not fmt.constrained and offered.choice == "auto": return None
    grammar = fmt.grammar(offered, self.tokenizer)
    if len(grammar) > MAX_GRAMMAR_BYTES: raise errors.InvalidOption("tools", f"the tools' grammar is over {MAX_GRAMMAR_BYTES} bytes")
    check(grammar, self.tokenizer, "tools")
    return grammar

  def _iterate(self, st: StreamHandle, events: queue.SimpleQueue) -> Iterator[Delta | Logits | Done]:
    try:
      while True:
        ev = events.get()
        if isinstance(ev, BaseException): raise ev
        yield ev
        if isinstance(ev, Done): return
    finally:
      st.cancel()  # a consumer that walked away (or an error): free the slot; a no-op once the stream ended

  # The driver: one thread reads the tail's ring and closes every stream's loop (text, stop strings, budget, next
  # token), so a stream never waits on its consumer's thread being scheduled. Head writes come from the driver and
  # from submit/cancel, under self._lock, which also guards the slots and the queue: per stream the head ring sees
  # OPEN, data..., CLOSE in that order. No write can wait on the driver: the rings hold every record that all
  # streams can have in flight at once (protocol.ring_bytes).
  def _admit(self) -> None:
    while self._waiting and self._free_slots:
      st = self._waiting.popleft()
      st.slot = self._free_slots.pop(0)  # the lowest free slot: a batch spans rows 0..highest slot in use
      st.state = "open"
      self._active[st.id] = st
      blocks = self.prefix.match(st.ids, st.cache_salt) if self.prefix is not None and st.prefix_cache else []
      st.cached = st.computed = len(blocks) * BLOCK
      info = OpenInfo(st.slot, len(st.ids), {"request": st.id, "recipe": self.recipe}, st.params.to_dict(), st.ids,
                      sorted(st.end_ids), st.want_logits, st.cached, [[b, i * BLOCK] for i, b in enumerate(blocks)], st.grammar is not None,
                      st.drafts is not None)
      st.t_admitted = time.monotonic()
      # the grammar goes to the tail directly, before the OPEN: the tail waits for it when the OPEN says there is one
      if st.grammar is not None: self.handles[-1].send(Command.SET_GRAMMAR, stream=st.id, grammar=st.grammar)
      self._write(object_id(st.id, 0), info.encode(4), FLAG_OPEN)
      rest = st.ids[st.cached:]
      self._write(object_id(st.id, st.cached), struct.pack(f"<{len(rest)}I", *rest), 0)

  def _cancel(self, st: StreamHandle) -> None:
    """A stream that has not ended gets its one final event here, a Done with finish reason "cancelled", delivered from
    the cancelling thread (no Delta of it follows: the driver passes over a stream that is not open)."""
    with self._delivering:
      with self._lock:
        if st.state == "waiting":
          self._waiting.remove(st)
          st.state = "done"
        elif st.state == "open" and not self._closed:
          self._close_stream(st)
        else: return
        done = None if st.ended else st.final("cancelled")
      if done is not None: st.deliver(done)

  def _close_stream(self, st: StreamHandle, save: bool = True) -> None:
    """Under self._lock: what the stream computed goes to the prefix cache, then the CLOSE goes out; the slot is free
    when its echo comes back (nothing of it is in flight then)."""
    st.state = "closing"
    if save: self._save_prefix(st, st.computed if self.cache_decoded else min(st.computed, len(st.ids)))
    self._write(object_id(st.id, 0), b"", FLAG_CLOSE)

  def _save_prefix(self, st: StreamHandle, n: int) -> None:
    """Under self._lock: index the stream's first n positions (computed in every stage) and tell the stages which blocks
    to fill with them, in ring order (pyruntime/prefix_cache.py)."""
    if self.prefix is None or not st.prefix_cache or n < BLOCK: return
    tokens = (st.ids + st.out)[:n]  # the token at position len(ids) + k is out[k], which was fed back
    if pairs := self.prefix.insert(tokens, st.cache_salt):
      self._write(object_id(st.id, 0), encode_json({"save": [list(p) for p in pairs]}, 4), FLAG_CACHE)

  def _drive(self) -> None:
    read, release = self.tail.read, self.tail.release
    self._driver_tid = threading.get_ident()
    try:
      while not self._closed:
        # Parked in C between tokens (the ring checks the tail stage's liveness at each DRIVER_WAKE_S poll, set in
        # start(), without waking Python): a failure elsewhere reaches the tail ring as RingClosed/PeerDead; a dead or
        # stalled stage is seen here at the latest DRIVER_WAKE_S on
        try: rec = read(DRIVER_WAKE_S)
        except errors.RingTimeout:
          if (f := self._first_failure() or self._stalled()) is not None: raise f from None
          continue
        t_got = time.monotonic()
        tokens = 0
        with self._delivering:
          box = []
          try:
            with self._lock:  # once for the tail's whole step: it publishes a MORE group at once
              self._outbox = box
              try:
                while True:
                  tokens += self._take(rec, t_got)
                  if not rec.flags & FLAG_MORE: break
                  try: rec = read(0)
                  except errors.WouldBlock: break  # the rest of the group is not out yet: wait for it unlocked
              finally: self._outbox = None
          finally:
            for st, ev in box: st.deliver(ev)
        release()
        if tokens:
          self.overhead["tokens"] += tokens
          self.overhead["seconds"] += time.monotonic() - t_got
    except errors.PyruntimeError as e:
      if not self._closed:
        f = self._root_cause() or (e if isinstance(e, errors.StageFailed) else errors.StageFailed(len(self.handles) - 1, e.code, str(e)))
        self._fail(f)  # the pipeline goes down, then every stream learns which stage failed
    finally:
      if self._closed and not self._shut: pass  # a user's close() is under way: it fails the streams once the stages are gone
      else: self._fail_all(self._failure or errors.LauncherClosed("the launcher closed while the stream ran"))

  def _take(self, rec: Any, now: float) -> int:
    """Under self._lock: one record from the tail (that arrived at `now`); 1 for a token, else 0."""
    sid, pos = split_object_id(rec.object_id)
    st = self._active.get(sid)
    if st is None: raise errors.ResultIdentityMissing(f"the tail answered {rec.object_id:#x} (flags {rec.flags}), a stream not open")
    flags = rec.flags
    if flags & FLAG_CLOSE:
      del self._active[sid]
      self._free_slots.append(st.slot); self._free_slots.sort()
      self._admit()
      st.closed()
    elif flags & (FLAG_OPEN | FLAG_CACHE): pass  # echoes: the tail bound the stream, or filled its blocks
    elif flags & FLAG_ERROR:
      info = decode_json(rec.payload)
      if st.state == "open":
        st.fail(errors.StreamFailed(info.get("stage"), str(info.get("reason")), str(info.get("message"))))
        self._close_stream(st, save=False)
    else:
      self._count_step(flags)
      if st.state == "open": self._step(st, rec, pos, now)
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
    else:
      token, end = int.from_bytes(rec.payload[:4], "little"), bool(rec.flags & FLAG_END)
    if st.verify is not None: return self._verified(st, pos, token, end, now)
    if not self._commit(st, pos, token, end, now): self._queue_next(st, token)

  def _commit(self, st: StreamHandle, pos: int, token: int, end: bool, now: float) -> bool:
    """The token after position `pos` is the stream's: text out; True when that finished it (Done went out)."""
    self.tokens_out += 1
    self._token_times.append(now)
    first = st.computed < len(st.ids)
    st.computed = pos + 1
    if first: self._save_prefix(st, len(st.ids))  # the prompt is in every stage: streams arriving meanwhile can share it
    if st.push(token, end, now):
      self._close_stream(st)  # finished: free the slot
      return True
    return False

  def _queue_next(self, st: StreamHandle, token: int) -> None:
    """The stream's next input: its last token, and with speculation a draft after it (pyruntime/speculation.py) when
    the pipeline is not busy with other streams and the budget and context have room."""
    q = len(st.ids) + len(st.out) - 1  # the last token's position
    drafts: list[int] = []
    if st.drafts is not None and len(self._active) <= SOLO_STREAMS:
      k = min(st.drafts.next(), st.n_max - len(st.out) - 1, self.context_length - q - 2, MAX_VERIFY_ROWS - 1)
      drafts = prediction_draft(st.out, st.predicted, k)
      st.from_prediction = bool(drafts)
      if not drafts and self.speculative == "ngram" and k > 0: drafts = ngram_draft(st.ids + st.out, k)
    if drafts: st.verify = (q, drafts, {})
    self._next.append((st, object_id(st.id, q), [token, *drafts]))

  def _verified(self, st: StreamHandle, pos: int, token: int, end: bool, now: float) -> None:
    """One answer to a speculative record; once every row's is in: the tokens up to the first draft the model did not
    agree with are the stream's, that one included (plain decoding's tokens), and the next input follows them."""
    q, drafts, got = st.verify
    got[pos] = (token, end)
    if len(got) < len(drafts) + 1: return
    st.verify, accepted = None, 0
    for i in range(len(drafts) + 1):
      token, end = got[q + i]
      if self._commit(st, q + i, token, end, now): break
      if i < len(drafts) and token == drafts[i]: accepted += 1
      else: break
    st.drafts.update(len(drafts), accepted)
    st.rounds, st.drafted, st.accepted = st.rounds + 1, st.drafted + len(drafts), st.accepted + accepted
    if st.from_prediction: st.prediction_kept, st.prediction_rejected = st.prediction_kept + accepted, st.prediction_rejected + len(drafts) - accepted
    for key, n in (("rounds", 1), ("drafted", len(drafts)), ("accepted", accepted)): self.spec[key] += n
    for j in range(len(drafts)):  # per draft position: how far into a draft the model still agrees
      self.spec["drafted_at"][j] += 1
      self.spec["accepted_at"][j] += j < accepted
    if st.state == "open": self._queue_next(st, token)

  def _flush_next(self) -> None:
    """The tail's step is complete: its streams' next tokens go to the head as one group (MORE on all but the last),
    so the head computes them as one batch again instead of waking on the first and taking a batch of one."""
    nxt = [(st, oid, toks) for st, oid, toks in self._next if st.state == "open"]  # a stream cancelled meanwhile is CLOSEd
    self._next.clear()
    for i, (_, oid, toks) in enumerate(nxt): self._write(oid, struct.pack(f"<{len(toks)}I", *toks), FLAG_MORE if i < len(nxt) - 1 else 0)

  def _count_step(self, flags: int) -> None:
    self._group += 1
    if not flags & FLAG_MORE:  # the last record of the tail's step
      self.steps, self.step_rows, self.last_batch, self._group = self.steps + 1, self.step_rows + self._group, self._group, 0

  def _fail_all(self, e: errors.PyruntimeError) -> None:
    with self._lock:
      streams = list(self._waiting) + list(self._active.values())
      self._waiting.clear(); self._active.clear()
    for st in streams: st.fail(e)

  def driver_cpu_s(self) -> float:
    """CPU seconds the driver thread has used (reading, text, next tokens, its polls): the launcher's own cost."""
    if self._driver is None or self._driver.ident is None: return 0.0
    try: return time.clock_gettime(time.pthread_getcpuclockid(self._driver.ident))
    except (OSError, AttributeError): return float("nan")  # the thread has ended, or a platform without thread clocks

  def scheduler_stats(self) -> dict:
    """Streams running (in the pipeline) and waiting (for a slot); tokens out; the tail's steps (a group of records
    chained by MORE is one step) and their sizes; output tokens per second over the last RATE_WINDOW_S."""
    with self._lock:
      now = time.monotonic()
      recent = [t for t in self._token_times if now - t <= RATE_WINDOW_S]
      span = now - recent[0] if len(recent) > 1 else 0.0
      return {"running": len(self._active), "waiting": len(self._waiting), "max_streams": self.max_streams, "tokens": self.tokens_out,
              "steps": self.steps, "last_batch": self.last_batch, "mean_batch": self.step_rows / self.steps if self.steps else 0.0,
              "tokens_per_s": (len(recent) - 1) / span if span > 0 else 0.0, "prefix_cache": self._prefix_stats(),
              "speculation": {"mode": self.speculative, **self.spec} if self.speculative != "off" or self.spec["rounds"] else None}

  def _write(self, oid: int, payload: Any, flags: int) -> None:
    """Into the head ring, under self._lock. A failed stage raises here; the driver (which learns of failures)
    ends every stream and the pipeline, so no thread but the driver ever closes the launcher."""
    while True:
      try: return self.head.write(oid, payload, flags, timeout=POLL_S)
      except errors.RingTimeout: pass
      except (errors.PeerDead, errors.RingClosed) as e:
        if self._closed: raise errors.LauncherClosed("the launcher is closed") from None
        raise self._first_failure() or errors.StageFailed(0, e.code) from None
      if (f := self._first_failure()) is not None: raise f
      if self._closed: raise errors.LauncherClosed("the launcher is closed")

  # --- stop --------------------------------------------------------------------------------------
  def close(self, grace_s: float = STOP_GRACE_S) -> None:
    """End every stage process and unlink every segment. Safe to call twice, from any state.

    In order: close our ring sides (the stages drain and stop their loops), ShutdownWorker, and
    after `grace_s` SIGKILL. After a failure the survivors get SIGTERM at once instead.
    """
    # closed by someone else (a server's supervisor, say) after a stage died, before the driver saw it: the streams
    # still learn which stage failed, not just that the launcher closed
    if self._failure is None and not self._closed: self._failure = self._first_failure()
    self._closed = True  # the driver stops reading; if it is closing the launcher itself (a failure), that finishes first
    if self._driver is not None and self._driver is not threading.current_thread():
      self._wake_driver()
      # the bound is for a driver stuck in a consumer's callback: closing goes on regardless
      self._driver.join(STOP_GRACE_S)
    with self._close_lock:
      if self._shut:
        self._reap()
        return
      self._shut = True
      self._shutdown(grace_s)

  def _reap(self) -> None:
    """After the shutdown: end what a start() in another thread made since (a stage spawned, the arena), at once."""
    kill_stages(self.handles)
    if self.placement is not None: self.placement.close(0.0)

  def _wake_driver(self) -> None:
    """Close our side of the head ring: the stages drain and close theirs in turn, down to the tail ring, whose reader
    (the driver, parked in C) then gets RingClosed at once instead of at its next DRIVER_WAKE_S."""
    if self.head is None or not self._lock.acquire(timeout=STOP_GRACE_S): return  # _write gives the lock up on _closed
    try: self.head.close()
    except errors.PyruntimeError: pass
    finally: self._lock.release()

  def _shutdown(self, grace_s: float) -> None:
    for side in (self.head, self.tail):
      if side is not None:
        try: side.close()
        except errors.PyruntimeError: pass
    stop_stages(self.handles, grace_s, failed=grace_s < STOP_GRACE_S)
    if self.placement is not None: self.placement.close(grace_s)
    # the streams learn last, so whoever sees their error finds every stage gone and every segment unlinked
    self._fail_all(self._failure or errors.LauncherClosed("the launcher closed while the stream ran"))
    if self.placement is not None: self.placement.sweep()  # a lost host's segments: on its node, after the streams know
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
