"""One pipeline stage process: `python -m pyruntime.stage`.

Control is JSON lines: commands on stdin, events on stdout, logs on stderr (docs/control-channel.md). The
control channel sets the stage up, tears it down and reports errors and telemetry; once the
rings are installed the stage runs its own data loop and no control message moves per token.
Any error ends the stage with one `WorkerFatal` event naming the reason and a non-zero exit,
after closing its ring sides so its neighbours stop waiting at once.
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from pyruntime import errors
from pyruntime.boundary import MLA_POS
from pyruntime.gc_policy import collect_due, collect_on_this_thread
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
  WEIGHT_MODES,
  Command,
  Event,
  decode_json,
  error_payload,
  object_id,
  split_object_id,
)

if TYPE_CHECKING:  # what the stage holds, imported when it gets it (the control channel answers before tinygrad loads)
  from pyruntime.gguf import GGUFHeader
  from pyruntime.kv_blocks import KVBlocks
  from pyruntime.model import StageModel
  from pyruntime.ring import Arena, Reader, Record, Writer
  from pyruntime.sampling import Sampler
  from pyruntime.tokenizer import Tokenizer

COMMAND_POLL_S = 0.05  # while records flow, how often the data loop looks for a control command
GROUP_WAIT_S = 5.0     # how long to wait for the rest of a step's group (MORE): the upstream writes a group in one go
GATHER_STEPS, GATHER_MIN_S, GATHER_MAX_S = 3.0, 0.005, 1.0  # how long a stage waits for decode rows still on their way
# Where a prompt is cut never changes a number: every prefill chunk of 1..model.chunk tokens runs the same kernels
# (symbolic T), each row reduced in the same order (tests/test_model.py proves it bit for bit), so chunks sized by load
# (Stage.prefill_size, protocol.PREFILL_SHARE) keep every stream's tokens independent of the others.
GRAMMAR_WAIT_S = 10.0  # the tail waits this long for a structured stream's SetGrammar (sent before its OPEN)
HEARTBEAT_S = 0.5      # the data loop reports its progress at most this often (Heartbeat; the launcher's stall rule)
MAX_TAKE = 256         # records taken from the ring per loop turn, so a flooding upstream cannot starve the compute
MAX_COMMAND_BYTES = 64 << 20  # one control line; a longer one is refused (InvalidCommand) rather than buffered without end


class Fatal(Exception):
  def __init__(self, reason: str, message: str = "", **extra: Any):
    super().__init__(f"{reason}: {message}" if message else reason)
    self.reason, self.message, self.extra = reason, message, extra


def fatal_from(e: BaseException) -> Fatal:
  if isinstance(e, Fatal): return e
  if isinstance(e, errors.PyruntimeError):
    extra = {"expected": e.expected, "actual": e.actual} if isinstance(e, errors.SequenceViolation) else {}
    return Fatal(e.code, str(e), **extra)
  return Fatal("UnhandledWorkerException", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


# --- control-channel arguments ----------------------------------------------------------------------
# Every argument a command reads is checked here, at the process boundary, so a malformed one ends the stage with
# its named reason (InvalidCommand unless the command says otherwise) instead of a TypeError deep inside.
_MISSING: Any = object()


def show(v: Any, n: int = 80) -> str:
  """A short repr for messages; never raises (an int past Python's digit limit has no repr)."""
  try: s = repr(v)
  except Exception: s = f"<{type(v).__name__}>"  # noqa: BLE001
  return s if len(s) <= n else s[:n] + "..."


def arg(cmd: dict, name: str, kind: type | tuple[type, ...], default: Any = _MISSING, *,
        reason: type[errors.PyruntimeError] = errors.InvalidCommand) -> Any:
  """cmd[name], which must be of `kind` (bool is not an int); `default` when absent (or null, if the default is None)."""
  v = cmd.get(name, default)
  if v is _MISSING: raise reason(f"{cmd.get('command')} needs {name!r}")
  if v is None and default is None: return None
  kinds = kind if isinstance(kind, tuple) else (kind,)
  if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
    what = " or ".join({"str": "a string", "int": "an integer", "float": "a number", "list": "a list", "dict": "an object",
                        "bool": "true or false"}.get(k.__name__, k.__name__) for k in kinds)
    raise reason(f"{cmd.get('command')}: {name!r} must be {what}, not {show(v)}")
  return v


def arg_int(cmd: dict, name: str, default: Any = _MISSING, *, lo: int = 0, hi: int = 1 << 31,
            reason: type[errors.PyruntimeError] = errors.InvalidCommand) -> Any:
  v = arg(cmd, name, int, default, reason=reason)
  if v is not None and not lo <= v <= hi: raise reason(f"{cmd.get('command')}: {name!r} must be in [{lo}, {hi}], not {show(v)}")
  return v


def arg_seconds(cmd: dict, name: str, default: float) -> float:
  v = arg(cmd, name, (int, float), default)
  if not 0 <= v <= 3600:  # NaN and infinities fail it too
    raise errors.InvalidCommand(f"{cmd.get('command')}: {name!r} must be seconds in [0, 3600], not {show(v)}")
  return float(v)


def token_ids(cmd: dict, vocab_size: int) -> list[int]:
  """cmd['token_ids']: a list of ids inside the vocabulary (TokenIdInvalid naming the first that is not)."""
  ids = arg(cmd, "token_ids", list, reason=errors.TokenIdInvalid)
  for i, t in enumerate(ids):
    if type(t) is not int or not 0 <= t < vocab_size:
      raise errors.TokenIdInvalid(f"token_ids[{i}] = {show(t)} is not a token id of this vocabulary (0..{vocab_size - 1})")
  return ids


class Channel:
  """Events out on the original stdout; everything else anyone prints goes to stderr."""
  def __init__(self) -> None:
    self._out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (tinygrad's DEBUG output, warnings) must not corrupt the event stream
    sys.stdout = sys.stderr
    self._lock = threading.Lock()

  def emit(self, event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, **fields}, default=str)
    with self._lock:
      try: self._out.write(line + "\n")
      except (BrokenPipeError, ValueError): pass  # the launcher is gone; the exit path still runs


@dataclass
class Stream:
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
  constraint: Any = None             # the tail's grammar matcher of a structured answer (pyruntime/grammar.py)
  speculative: bool = False          # records past the prompt may hold drafted rows, and may go back (docs/speculation.md)
  history_base: int = 0              # the tail: history entries before the first generated token

  def next_is_decode(self) -> bool:
    return bool(self.pending) and self.prompt_tokens is not None and self.pending[0][0] >= self.prompt_tokens and len(self.pending[0][1]) == 1

  def is_verify(self, pos: int) -> bool:
    """A record of drafted rows past the prompt (computed as a chunk, every row answered at the tail)."""
    return self.speculative and self.prompt_tokens is not None and pos >= self.prompt_tokens


class Stage:
  def __init__(self, channel: Channel) -> None:
    self.ch = channel
    self.device: str | None = None
    self.role: dict | None = None
    self.model: StageModel | None = None
    self.blocks: KVBlocks | None = None  # the prefix cache's blocks (ConfigureRole prefix_blocks; none with recurrent blocks)
    self.header: GGUFHeader | None = None
    self.tokenizer: Tokenizer | None = None
    self.arena: Arena | None = None
    self.reader: Reader | None = None
    self.writer: Writer | None = None
    self.streams: dict[int, Stream] = {}
    self.loaded: Record | None = None  # the record RingReadable loaded, in step mode
    self.looping = False             # the data loop runs (InstallRing in mode "loop")
    self.decode_mode = "batched"
    self.micro_batches = 1
    self.gathering: float | None = None  # since when decode rows are being gathered
    self.step_s = 0.0                    # a decode step's duration here (moving average)
    self.last_prefill: tuple[int, float] | None = None  # the last prefill chunk here: (tokens, seconds)
    self.prefill_share = PREFILL_SHARE
    self.profile_report: Callable[[], None] | None = None
    self.beat_t = 0.0                    # the last Heartbeat
    self.steps_run = 0                   # steps finished, records taken: the progress a Heartbeat reports
    self.records_taken = 0
    self.slowest_step_s = 0.0
    self.doing: str | tuple[int, int | None] = "waiting for records"
    self.stats = {"records": 0, "tokens": 0, "compute_s": 0.0, "emit_s": 0.0, "prefill_s": 0.0, "wait_s": 0.0, "decode_steps": 0, "mixed_steps": 0,
                  "decode_rows": 0, "max_batch": 0, "prefill_chunks": 0, "stream_errors": 0, "gc_collections": 0, "gc_s": 0.0, "gc_max_s": 0.0,
                  "started": time.monotonic()}
    C = Command
    self.commands: dict[str, Callable[[dict], None]] = {
      C.INITIALIZE_WORKER: self.initialize, C.CONFIGURE_ROLE: self.configure, C.LOAD_WEIGHTS: self.load_weights,
      C.INSTALL_RING: self.install_ring, C.UNINSTALL_RING: self.uninstall_ring, C.RING_READABLE: self.ring_readable,
      C.EXECUTE_STEP: self.execute_step, C.RELEASE_DEVICE_OBJECT: self.release_object, C.ENCODE_PROMPT: self.encode_prompt,
      C.DECODE_TOKENS: self.decode_tokens, C.INFER_PROMPT: self.infer_prompt, C.QUERY_STATS: self.query_stats,
      C.SET_GRAMMAR: self.set_grammar,
    }
    self.grammars: dict[int, str] = {}             # structured streams' grammars by stream id, from SetGrammar until CLOSE
    self.command_queue: queue.Queue = queue.Queue()  # serve()'s: await_grammar reads ahead in it
    self.deferred: collections.deque = collections.deque()  # what await_grammar read ahead, run first

  @property
  def index(self) -> int | None: return self.role["stage"] if self.role else None

  # --- setup commands ---------------------------------------------------------------------------
  def initialize(self, cmd: dict) -> None:
    if (abi := cmd.get("abi_version", ABI_VERSION)) != ABI_VERSION or type(abi) is not int:
      raise errors.UnsupportedHelperAbi(f"launcher speaks ABI {show(abi)}, this worker speaks {ABI_VERSION}")
    cpus = arg(cmd, "cpus", list, None)
    device = arg(cmd, "device", str, None)
    if device is not None and (not device or "\0" in device): raise errors.InvalidCommand(f"InitializeWorker: no device named {show(device)}")
    if cpus:
      if not all(type(c) is int and 0 <= c < 1 << 16 for c in cpus):
        raise errors.InvalidCommand(f"InitializeWorker: 'cpus' must list CPU numbers, not {show(cpus)}")
      try: os.sched_setaffinity(0, cpus)  # before tinygrad sizes its CPU thread pool
      except OSError as e: raise errors.InvalidCommand(f"InitializeWorker: cannot run on CPUs {show(cpus)}: {e}") from e
    if device: os.environ["DEV"] = device
    self.device = device
    self.ch.emit(Event.WORKER_READY, pid=os.getpid(), device=device, abi_version=ABI_VERSION)

  def configure(self, cmd: dict) -> None:
    role = {"stage": arg_int(cmd, "stage", hi=1 << 16), "start": arg_int(cmd, "start", hi=1 << 20), "end": arg_int(cmd, "end", hi=1 << 20),
            "slots": arg_int(cmd, "slots", 4, lo=1, hi=1024), "boundary_dtype": arg(cmd, "boundary_dtype", str, "float32"),
            "max_context": arg_int(cmd, "max_context", None, lo=1, hi=1 << 24), "decode": arg(cmd, "decode", str, "batched"),
            "warmup": arg(cmd, "warmup", bool, False), "micro_batches": arg_int(cmd, "micro_batches", 1, lo=1, hi=1024),
            "weights": arg(cmd, "weights", str, "quantized"), "prefill_share": arg(cmd, "prefill_share", (int, float), PREFILL_SHARE),
            "prefix_blocks": arg_int(cmd, "prefix_blocks", 0, hi=1 << 24), "block_size": arg_int(cmd, "block_size", 16, lo=1, hi=1 << 12),
            "graph_cache": arg(cmd, "graph_cache", bool, True)}
    from pyruntime.options import CHOICES, NUMBERS
    CHOICES["boundary_dtype"].check(role["boundary_dtype"], errors.InvalidCommand)
    CHOICES["decode"].check(role["decode"], errors.InvalidCommand)
    if role["weights"] not in WEIGHT_MODES: raise errors.InvalidCommand(f"weights must be one of {WEIGHT_MODES}, not {show(role['weights'])}")
    self.decode_mode = role["decode"]
    self.micro_batches = role["micro_batches"]
    try: NUMBERS["prefill_share"].check(role["prefill_share"])
    except errors.InvalidOption as e: raise errors.InvalidCommand(str(e)) from None
    self.prefill_share = float(role["prefill_share"])
    if role["start"] < 0 or role["end"] <= role["start"]:
      raise errors.LayerRangeInvalid(f"layer range [{role['start']}, {role['end']}) is empty or negative")
    self.role = role
    self.ch.emit(Event.ROLE_CONFIGURED, **role)

  def load_weights(self, cmd: dict) -> None:
    if self.role is None: raise errors.RoleNotConfigured("LoadWeights before ConfigureRole")
    from pyruntime.gguf import read_header
    from pyruntime.model import StageModel
    from pyruntime.source import resolve_model
    if self.model is not None: raise errors.InvalidCommand("LoadWeights: the weights are loaded already")
    t0 = time.monotonic()
    source = arg(cmd, "model", str, None, reason=errors.ModelLoadFailed)  # None: the default model
    cache_dir = arg(cmd, "cache_dir", str, None, reason=errors.ModelLoadFailed)
    try:
      path = resolve_model(source, cache_dir=cache_dir,
                           on_progress=lambda done, total: self.ch.emit(Event.DOWNLOAD_PROGRESS, stage=self.index, bytes=done, total=total))
      self.header = read_header(path)
    except errors.PyruntimeError: raise
    except Exception as e: raise errors.ModelLoadFailed(f"{show(source, 200)}: {type(e).__name__}: {e}") from e  # noqa: BLE001
    r = self.role
    graphs = None
    if r["graph_cache"]:
      from pyruntime.graph_cache import GraphCache, graph_dir
      graphs = GraphCache(graph_dir(cache_dir), warn=lambda text: self.ch.emit(Event.STAGE_WARNING, stage=self.index, message=text))
    try:
      self.model = StageModel.load(path, r["start"], r["end"], device=self.device, max_context=r["max_context"], slots=r["slots"],
                                   boundary_dtype=r["boundary_dtype"], weights=r["weights"], decode=r["decode"], graph_cache=graphs)
    except errors.PyruntimeError: raise
    except Exception as e: raise Fatal("ModelLoadFailed", f"{type(e).__name__}: {e}", traceback=traceback.format_exc()) from e
    m = self.model
    # the batched decode serves dense blocks; the other families run tinygrad's own decode, one stream at a time (which
    # keeps streams in flight exact trivially)
    if not m.batched: self.decode_mode = "reference"
    if r["prefix_blocks"] and (states := m.position_states()) is not None:
      from pyruntime.kv_blocks import KVBlocks
      self.blocks = KVBlocks(states, r["prefix_blocks"], r["block_size"])
    # the prefix cache may keep a decoded position only where a decode row has a prompt row's bits (the rows path)
    cache = {"blocks": self.blocks.blocks, "block_size": self.blocks.block_size, "bytes_per_token": self.blocks.bytes_per_token,
             "decoded_positions": m.batched} if self.blocks is not None else None
    self.ch.emit(Event.WEIGHTS_LOADED, stage=self.index, elapsed_s=round(time.monotonic() - t0, 4), path=str(path), arch=m.arch,
                 num_blocks=m.num_blocks, start=m.start, end=m.end, is_head=m.is_head, is_tail=m.is_tail, dim=m.dim,
                 vocab_size=m.vocab_size, context_length=m.context_length, resident_bytes=m.resident_bytes,
                 boundary=m.boundary.to_dict(), family=m.family, batched=m.batched, prefix_cache=cache)
    # the graphs a request needs (with warmup: every decode window) ready before the first request, from the graph
    # cache when it has them: a stream never waits on a capture, and what a new process prepares shows while it does
    t0 = time.monotonic()
    shapes = m.warm_up(every_window=r["warmup"], on_graph=lambda kind, what, seconds, cached: self.ch.emit(
      Event.GRAPH_PREPARING if what == "preparing" else Event.GRAPH_READY, stage=self.index, graph=kind, seconds=round(seconds, 3),
      cached=cached))
    m.on_capture = self.on_capture  # from now on a capture happens mid-flight: say so (the launcher's stall rule)
    self.ch.emit(Event.WARMED_UP, stage=self.index, batch_shapes=shapes, shape_ms={str(k): round(v, 2) for k, v in m.shape_ms.items()},
                 elapsed_s=round(time.monotonic() - t0, 3), graph_cache=graphs.stats if graphs is not None else None)

  def install_ring(self, cmd: dict) -> None:
    if self.model is None: raise errors.WeightsNotLoaded("InstallRing before LoadWeights")
    if self.arena is not None: raise errors.InvalidCommand("InstallRing: the rings are installed already (UninstallRing first)")
    from pyruntime.ring import Arena
    name, ingress, egress = arg(cmd, "arena", str), arg_int(cmd, "ingress", hi=1 << 16), arg_int(cmd, "egress", hi=1 << 16)
    mode = arg(cmd, "mode", str, "loop")
    if mode not in ("loop", "step"): raise errors.InvalidCommand(f"InstallRing: mode must be 'loop' or 'step', not {show(mode)}")
    if ingress == egress: raise errors.InvalidCommand(f"InstallRing: ingress and egress are both ring {ingress}")
    if (upstream := arg(cmd, "ingress_boundary", dict, None)) is not None:
      try: self.model.boundary.check_ingress(upstream)
      except errors.PyruntimeError: raise
      except Exception as e: raise errors.BoundarySchemaMismatch(f"not a stage boundary description: {show(upstream, 200)}") from e  # noqa: BLE001
    self.arena = Arena.attach(name)
    try:
      for i in (ingress, egress):
        if i >= self.arena.ring_count: raise errors.InvalidCommand(f"InstallRing: arena {name} has rings 0..{self.arena.ring_count - 1}, not {i}")
      self.reader = self.arena.reader(ingress)
      self.writer = self.arena.writer(egress)
    except BaseException:
      self.close_rings()
      raise
    self.ch.emit(Event.RING_INSTALLED, stage=self.index, arena=name, ingress=ingress, egress=egress, mode=mode)
    self.looping = mode == "loop"

  def uninstall_ring(self, cmd: dict) -> None:
    self.close_rings()
    self.looping = False
    self.ch.emit(Event.RING_UNINSTALLED, stage=self.index)

  def close_rings(self) -> None:
    for side in (self.writer, self.reader):
      if side is not None:
        try: side.close()
        except errors.PyruntimeError: pass
    if self.arena is not None: self.arena.close()
    self.reader = self.writer = self.arena = None

  # --- the data path ----------------------------------------------------------------------------
  # A loop turn takes what waits on the ingress ring (all of it, up to a bound: records of many streams), then runs
  # one step: every stream with a decode token waiting, as one batch, then one prefill chunk of the oldest stream
  # still prefilling. So a long prompt delays the running streams by at most one chunk per step, and streams join
  # and leave the batch at every step.
  def poll_ring(self) -> None:
    ready = self.ready()
    self.take_ingress(0.0 if ready else COMMAND_POLL_S if not self.gathering else min(COMMAND_POLL_S, self.gather_left()))
    if self.looping and self.ready(): self.run_step()

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
    (mixed_step) instead of costing a pass over the weights of its own; on tinygrad's path it runs at once."""
    if not self.has_work(): self.gathering = None; return False
    rows, wanted = sum(1 for st in self.streams.values() if st.next_is_decode()), -(-self.decoding() // self.micro_batches)
    if rows >= wanted: return True
    if any(st.pending and not st.next_is_decode() for st in self.streams.values()) and (self.decode_mode != "batched" or not wanted):
      return True
    if self.gathering is None: self.gathering = time.monotonic()
    return self.gather_left() <= 0

  def gather_left(self) -> float:
    """A round trip of the pipeline brings the missing rows: wait up to a few of this stage's steps for them."""
    budget = min(GATHER_MAX_S, max(GATHER_MIN_S, GATHER_STEPS * self.step_s))
    return budget - (time.monotonic() - self.gathering) if self.gathering is not None else budget

  def take_ingress(self, timeout: float) -> None:
    """Read what the ring holds now (waiting up to `timeout` for the first record, and for the rest of a MORE group)."""
    t0 = time.monotonic()
    for n in range(MAX_TAKE):
      try: rec = self.reader.read(timeout=timeout)
      except (errors.RingTimeout, errors.WouldBlock): break
      except errors.RingClosed:  # upstream finished in order: pass the close on and stop looping
        self.looping = False
        self.writer.close()
        self.ch.emit(Event.DATA_LOOP_STOPPED, stage=self.index)
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
      elif (st := self.streams.get(stream_id)) is not None: st.failed = True; st.pending.clear()
      return self.writer.write(rec.object_id, rec.payload, rec.flags & ~FLAG_MORE)
    if (st := self.streams.get(stream_id)) is None:
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
      return self.fail_stream(stream_id, st, e)
    if not st.pending: st.waiting_since = rec.sequence  # decode rows are taken oldest first
    st.pending.append((pos, x.copy()))  # the ring space is released right after: keep our own copy
    st.position += len(x)

  def fail_stream(self, stream_id: int, st: Stream, e: errors.PyruntimeError) -> None:
    """This stream alone ends: the error goes down the pipeline to the launcher; the others run on."""
    st.failed = True
    st.pending.clear()
    self.stats["stream_errors"] += 1
    self.writer.write(object_id(stream_id, 0), error_payload(self.index, e.code, str(e), self.writer.spec.alignment), FLAG_ERROR)

  def open_stream(self, stream_id: int, info: dict) -> None:
    slot = info.get("slot")
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.model.slots:
      raise errors.SlotInvalid(f"stream {stream_id} asks for KV slot {slot!r}; this stage has {self.model.slots}")
    if any(s.slot == slot for s in self.streams.values()):
      raise errors.SlotInvalid(f"stream {stream_id} asks for KV slot {slot}, which another open stream holds")
    if stream_id in self.streams: raise errors.SlotInvalid(f"stream {stream_id} is opened twice")
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
      self.model.set_position(slot, cached)
    if self.model.is_tail:
      from pyruntime.params import SamplingParams
      from pyruntime.sampling import Sampler
      if not info.get("identity"): raise errors.ResultIdentityMissing(f"stream {stream_id} opened without a request identity")
      st.sampler = Sampler(SamplingParams.from_dict(info.get("sampling", {})), self.model.vocab_size, self.model.device)
      st.history, st.end_ids, st.logits = list(info.get("history", [])), frozenset(info.get("end_ids", [])), bool(info.get("logits"))
      st.history_base = len(st.history)
      if info.get("grammar"):
        from pyruntime.grammar import Constraint
        st.constraint = Constraint(self.await_grammar(stream_id), self._tok(), self.model.vocab_size)
    self.streams[stream_id] = st

  def save_blocks(self, stream_id: int, info: dict) -> None:
    """A CACHE record: fill the named blocks from the stream's slot. Positions the launcher has answers for are computed
    here, even if the stream failed since (its slot is kept until the CLOSE)."""
    if self.blocks is None: raise errors.PrefixBlocksInvalid(f"stream {stream_id}: a CACHE record, but this stage keeps no blocks")
    if (st := self.streams.get(stream_id)) is None: raise errors.StreamNotOpen(f"a CACHE record names stream {stream_id}, which is not open")
    self.blocks.save(st.slot, info.get("save"), self.model.position(st.slot))

  def close_stream(self, stream_id: int) -> None:
    self.grammars.pop(stream_id, None)
    if (st := self.streams.pop(stream_id, None)) is not None: self.model.reset_slot(st.slot)

  def set_grammar(self, cmd: dict) -> None:
    """SetGrammar: a structured stream's grammar, before its OPEN (the tail only)."""
    stream, grammar = arg_int(cmd, "stream", hi=1 << 32), arg(cmd, "grammar", str)
    if self.model is None or not self.model.is_tail: raise errors.InvalidCommand("SetGrammar goes to the tail stage")
    if len(self.grammars) >= 4 * self.model.slots: self.grammars.pop(next(iter(self.grammars)))  # a stream whose OPEN never came
    self.grammars[stream] = grammar

  def await_grammar(self, stream_id: int) -> str:
    """The stream's grammar: its SetGrammar left the launcher before the OPEN did, but the control channel and the rings
    race; until it is here, other commands wait their turn (in order) and only SetGrammar lines run."""
    deadline = time.monotonic() + GRAMMAR_WAIT_S
    while stream_id not in self.grammars:
      try: item = self.command_queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty: raise errors.GrammarMissing(f"no SetGrammar for stream {stream_id} within {GRAMMAR_WAIT_S:.0f} s of its OPEN") from None
      if _command_name(item) == Command.SET_GRAMMAR: self.dispatch(item)
      else: self.deferred.append(item)
    return self.grammars[stream_id]

  def beat(self, force: bool = False, capturing: bool = False) -> None:
    """A Heartbeat: what this loop has done (steps finished, records taken), whether work waits here, and what it does
    now. Sent from the thread that does the work, so a stopped or deadlocked loop goes quiet (docs/control-channel.md,
    "Stalls")."""
    now = time.monotonic()
    if not force and (now - self.beat_t < HEARTBEAT_S or not self.looping): return
    self.beat_t = now
    # tokens and busy_s (rows computed, seconds computing and emitting, since the start) give the operator's view a
    # stage's busy fraction and rows per step between two beats (pyruntime/metrics.py)
    self.ch.emit(Event.HEARTBEAT, stage=self.index, steps=self.steps_run, records=self.records_taken, busy=self.has_work(),
                 doing=self.doing if isinstance(self.doing, str) else _step_text(*self.doing), slowest_s=round(self.slowest_step_s, 4),
                 capturing=capturing, tokens=self.stats["tokens"],
                 busy_s=round(self.stats["compute_s"] + self.stats["emit_s"], 4))

  def on_capture(self, graph: str) -> None:
    """A graph is captured now (not prepared at load: a decode window first used, say): the launcher allows a capture's
    time, not a step's, until the next Heartbeat."""
    self.doing = f"capturing the {graph} graph"
    self.beat(force=True, capturing=True)

  def run_step(self) -> None:
    t0 = time.monotonic()
    self.step()
    dt = time.monotonic() - t0
    self.steps_run += 1
    self.slowest_step_s = max(self.slowest_step_s, dt)
    self.doing = "waiting for records"

  def step(self) -> None:
    self.gathering = None
    decode = sorted(((sid, st) for sid, st in self.streams.items() if st.next_is_decode()), key=lambda x: x[1].waiting_since)
    # micro-batches: with stages on devices of their own, a step takes at most 1/micro_batches of the streams, so the
    # groups alternate between stages and every stage computes at once (stages sharing one CPU gain nothing by that)
    cap = -(-len(self.streams) // self.micro_batches)
    prefill = next(((sid, st) for sid, st in self.streams.items() if st.pending and not st.next_is_decode()), None)
    # on the rows path a prompt's chunk rides in the decode step's pass over the weights (the same bits either way)
    self.doing = (min(cap, len(decode)), prefill[0] if prefill else None)  # formatted only when a Heartbeat goes out
    self.beat()
    if decode and prefill and self.decode_mode == "batched": return self.mixed_step(decode[:cap], *prefill)
    if decode: self.decode_step(decode[:cap])
    if prefill: self.prefill_chunk(*prefill)

  def decode_step(self, rows: list[tuple[int, Stream]]) -> None:
    t0 = time.monotonic()
    items = [(sid, st, *st.pending.popleft()) for sid, st in rows]
    if self.decode_mode == "reference":
      # each result aliases the stage's output buffers (and its router logits): emit it before the next forward
      t1 = t0  # t1 - t0: the forwards' time
      for i, (sid, st, pos, x) in enumerate(items):
        tf = time.monotonic()
        out = self.model.forward(st.slot, x, pos, prefill=False)
        t1 += time.monotonic() - tf
        self.emit(sid, st, pos, 1, out, FLAG_MORE if i < len(items) - 1 else 0)
      t2 = time.monotonic()
    else:
      batch = self.model.forward_batch([st.slot for _, st, _, _ in items], np.concatenate([x for *_, x in items]),
                                       [pos for _, _, pos, _ in items])
      outs = self.model.batch_rows(batch, [st.slot for _, st, _, _ in items])
      t1 = time.monotonic()
      # the step's records become visible together (one publishing store, one wake-up of the reader): the next stage
      # and the launcher take a MORE group as a whole anyway, so publishing each row would only wake them per row
      last = len(items) - 1
      for i, ((sid, st, pos, _), out) in enumerate(zip(items, outs, strict=True)):
        self.emit(sid, st, pos, 1, out, FLAG_MORE if i < last else 0, publish=i == last)
      t2 = time.monotonic()
    n = len(items)
    self.step_s = 0.8 * self.step_s + 0.2 * (t2 - t0) if self.step_s else t2 - t0
    self.stats.update(records=self.stats["records"] + n, tokens=self.stats["tokens"] + n, decode_steps=self.stats["decode_steps"] + 1,
                      decode_rows=self.stats["decode_rows"] + n, max_batch=max(self.stats["max_batch"], n),
                      compute_s=self.stats["compute_s"] + t1 - t0, emit_s=self.stats["emit_s"] + t2 - t1)

  def next_chunk(self, st: Stream) -> tuple[int, np.ndarray]:
    """The next piece of `st`'s prompt to compute: (its first position, its rows), sized by prefill_size."""
    pos, x = st.pending[0]
    n = len(x) if st.is_verify(pos) else min(len(x), self.prefill_size(st))  # drafted rows go whole: each needs its answer
    if n == len(x): st.pending.popleft()
    else: st.pending[0] = (pos + n, x[n:])
    return pos, x[:n]

  def mixed_step(self, rows: list[tuple[int, Stream]], psid: int, pst: Stream) -> None:
    """One decode step with a prompt chunk in the same pass (StageModel.forward_mixed): the decode rows go out as
    decode_step sends them, then the chunk's record as prefill_chunk sends it. The chunk's share of the step's time
    sizes the next chunk."""
    t0 = time.monotonic()
    items = [(sid, st, *st.pending.popleft()) for sid, st in rows]
    pos, x = self.next_chunk(pst)
    slots = [st.slot for _, st, _, _ in items]
    verify = self.model.is_tail and pst.is_verify(pos)
    dec, pre = self.model.forward_mixed(slots, np.concatenate([r for *_, r in items]), [p for _, _, p, _ in items], pst.slot, x, pos,
                                        every_row=verify)
    outs = self.model.mixed_rows(dec, slots)
    self.model.synchronize()
    t1 = time.monotonic()
    last = len(items) - 1
    for i, ((sid, st, p, _), out) in enumerate(zip(items, outs, strict=True)):
      self.emit(sid, st, p, 1, out, FLAG_MORE if i < last else 0, publish=i == last)
    n = len(x)
    if verify: self.emit_rows(psid, pst, pos, pre)
    elif not self.model.is_tail or pos + n == pst.prompt_tokens: self.emit(psid, pst, pos, n, pre, 0)
    t2 = time.monotonic()
    # the chunk's share: what the step took beyond a decode step of the same window (every slot), timed at warm-up
    decode_s = self.model.shape_ms.get(self.model.slots, 1e3 * self.step_s) / 1e3
    self.note_prefill(n, max(1e-4, t1 - t0 - decode_s))
    # while prompts keep coming every step is mixed: the decoding streams' step without the chunk is decode_s
    self.step_s = 0.8 * self.step_s + 0.2 * decode_s if self.step_s else decode_s
    k, s = len(items), self.stats
    s.update(records=s["records"] + k + 1, tokens=s["tokens"] + k + n, decode_steps=s["decode_steps"] + 1, decode_rows=s["decode_rows"] + k,
             max_batch=max(s["max_batch"], k), prefill_chunks=s["prefill_chunks"] + 1, mixed_steps=s["mixed_steps"] + 1,
             compute_s=s["compute_s"] + t1 - t0, emit_s=s["emit_s"] + t2 - t1, prefill_s=s["prefill_s"] + max(0.0, t1 - t0 - self.step_s))

  def prefill_chunk(self, sid: int, st: Stream) -> None:
    t0 = time.monotonic()
    pos, x = self.next_chunk(st)
    n = len(x)
    verify = self.model.is_tail and st.is_verify(pos)
    out = self.model.prefill_rows(st.slot, x, pos, every_row=True) if verify else self.model.forward(st.slot, x, pos, prefill=True)
    self.model.synchronize()  # its kernels are queued, not done: the chunk's cost sizes the next one
    t1 = time.monotonic()
    if verify: self.emit_rows(sid, st, pos, out)
    elif not self.model.is_tail or pos + n == st.prompt_tokens: self.emit(sid, st, pos, n, out, 0)
    t2 = time.monotonic()
    self.note_prefill(n, t1 - t0)
    self.stats.update(records=self.stats["records"] + 1, tokens=self.stats["tokens"] + n, prefill_chunks=self.stats["prefill_chunks"] + 1,
                      compute_s=self.stats["compute_s"] + t1 - t0, emit_s=self.stats["emit_s"] + t2 - t1,
                      prefill_s=self.stats["prefill_s"] + t2 - t0)

  def prefill_size(self, st: Stream) -> int:
    """Tokens of `st`'s next prefill chunk: the model's largest chunk when no stream decodes here or prefill_share is 0;
    beside decoding streams, as many tokens as cost about `prefill_share` of their step (on the rows path: what the
    chunk adds to the step it rides in), judged by the last chunk (the smallest chunk until a step and a chunk were
    timed). A chunk that came in under that grows by at least one token: a chunk's fixed cost (on a GPU, most of it)
    makes a per-token figure from a small chunk too dear, and the sizes must still find the right one. On tinygrad's
    path a prompt that fits in one chunk goes whole (its 32 tokens cost about a step)."""
    chunk, unit = self.model.max_chunk, self.model.min_chunk
    if not self.prefill_share or not self.decoding(): return chunk
    if unit == 1 and (st.prompt_tokens or 0) <= chunk: return chunk
    # on the rows path the head sizes a prompt's chunks and the stages after it compute them as they come (cut again,
    # a chunk would ride in several steps of theirs)
    if unit > 1 and not self.model.is_head: return chunk
    if not (self.step_s and self.last_prefill): return unit
    n, seconds = self.last_prefill
    target = self.prefill_share * self.step_s
    fit = int(n * target / seconds) if seconds > 0 else chunk
    if unit > 1:  # timed as what it added to its step (mixed_step), not in a lull: what fits, in whole units of rows
      return max(unit, min(chunk, fit) // unit * unit)
    # growing: at least one token more, at most twice as many (one quick chunk, timed in a lull, must not bring a
    # chunk that costs many steps); shrinking: to what fits at the last chunk's cost
    return max(1, min(chunk, max(n + 1, min(fit, 2 * n)) if seconds < target else fit))

  def note_prefill(self, n: int, seconds: float) -> None: self.last_prefill = (n, seconds)

  def emit(self, sid: int, st: Stream, pos: int, n: int, out: Any, flags: int, publish: bool = True) -> None:
    """Write one result: the residual of positions [pos, pos+n), or on the tail the token (or logits) after pos+n-1.
    publish=False leaves it invisible until a later record is published (every write and publishing commit does)."""
    if not self.model.is_tail:
      span = self.writer.reserve(self.model.row_bytes * n)
      self.model.egress_into(out, span, pos)
      return self.writer.commit(object_id(sid, pos), flags, publish)
    oid = object_id(sid, pos + n - 1)
    if st.logits: return self.put(oid, out.numpy().astype("<f4", copy=False).reshape(-1), flags, publish)
    token = st.sampler.sample(out, st.history, None if st.constraint is None else st.constraint.mask())
    st.history.append(token)
    end = token in st.end_ids
    if st.constraint is not None:
      # once the answer is whole the mask allows only end tokens: the one sampled then ends the stream (ignore_eos too)
      if st.constraint.done: end = True
      else:
        try: st.constraint.take(token)
        except errors.StreamFailed as e: return self.fail_stream(sid, st, e)  # a mask lets no such token through: a bug
    self.put(oid, token.to_bytes(4, "little"), flags | (FLAG_END if end else 0), publish)

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

  # --- step-by-step driving by an outside orchestrator -------------------------------------------
  def ring_readable(self, cmd: dict) -> None:
    if self.reader is None: raise errors.RingNotInstalled("RingReadable before InstallRing")
    if self.looping: raise errors.InvalidCommand("RingReadable needs InstallRing with mode 'step'")
    if self.loaded is None:
      try: self.loaded = self.reader.read(timeout=arg_seconds(cmd, "timeout_s", 0.0))
      except (errors.WouldBlock, errors.RingTimeout):
        return self.ch.emit(Event.RING_IDLE, stage=self.index)
    r = self.loaded
    stream_id, pos = split_object_id(r.object_id)
    self.ch.emit(Event.OBJECT_LOADED, stage=self.index, object_id=r.object_id, sequence=r.sequence, extent=r.extent,
                 flags=r.flags, stream=stream_id, position=pos)

  def execute_step(self, cmd: dict) -> None:
    """Take the loaded record and compute everything it makes ready (a whole prompt, or a decode step)."""
    if self.loaded is None: raise errors.NoObjectLoaded("ExecuteStep without a record loaded by RingReadable")
    t0 = time.monotonic()
    self.take(self.loaded)
    while self.has_work(): self.run_step()
    self.ch.emit(Event.STEP_EXECUTED, stage=self.index, object_id=self.loaded.object_id, elapsed_s=round(time.monotonic() - t0, 6))

  def release_object(self, cmd: dict) -> None:
    if self.loaded is None: raise errors.NoObjectLoaded("ReleaseDeviceObject without a record loaded by RingReadable")
    seq, self.loaded = self.loaded.sequence, None
    self.reader.release()
    self.ch.emit(Event.OBJECT_RELEASED, stage=self.index, sequence=seq)

  # --- text and whole-prompt commands (tokenizer from the GGUF itself) ---------------------------
  def _tok(self) -> Any:
    if self.header is None: raise errors.WeightsNotLoaded("the tokenizer comes from the GGUF: LoadWeights first")
    if self.tokenizer is None:
      from pyruntime.tokenizer import Tokenizer
      self.tokenizer = Tokenizer.from_gguf_kv(self.header.kv)
    return self.tokenizer

  def _prompt_ids(self, cmd: dict) -> list[int]:
    tok = self._tok()
    if "token_ids" in cmd:
      if (ids := token_ids(cmd, tok.vocab_size)): return ids
      raise errors.EmptyPrompt("token_ids is empty")
    from pyruntime.chat import build_prompt_ids
    prompt, messages, raw = arg(cmd, "prompt", str, None), arg(cmd, "messages", list, None), arg(cmd, "raw", bool, False)
    if messages is not None and not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
      raise errors.InvalidOption("messages", "each message must be an object with a string 'role'")
    try: return build_prompt_ids(tok, self.header.kv, prompt=prompt, messages=messages, raw=raw)
    except errors.PyruntimeError: raise
    except Exception as e: raise errors.InvalidOption("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from e  # noqa: BLE001

  def encode_prompt(self, cmd: dict) -> None:
    self.ch.emit(Event.PROMPT_ENCODED, stage=self.index, token_ids=self._prompt_ids(cmd))

  def decode_tokens(self, cmd: dict) -> None:
    tok = self._tok()
    ids = arg(cmd, "token_ids", list, reason=errors.TokenIdInvalid)
    self.ch.emit(Event.TOKENS_DECODED, stage=self.index, text=tok.decode(ids))  # the tokenizer names an id it does not know

  def infer_prompt(self, cmd: dict) -> None:
    """The reference's whole-prompt path, for a stage that owns every block: tokens stream as events."""
    if self.model is None: raise errors.WeightsNotLoaded("InferPrompt before LoadWeights")
    if not (self.model.is_head and self.model.is_tail):
      raise errors.InvalidCommand("InferPrompt needs a stage that owns the whole model; use the rings for a split")
    from pyruntime.params import SamplingParams
    from pyruntime.sampling import Sampler
    from pyruntime.textstream import budget
    tok, ids = self._tok(), self._prompt_ids(cmd)
    n_max = budget(arg_int(cmd, "max_tokens", 256, lo=1, hi=1 << 24), self.model.context_length, len(ids))
    sampler = Sampler(SamplingParams.from_dict(arg(cmd, "sampling", dict, {})), self.model.vocab_size, self.model.device)
    slot, history, out_ids, t0 = 0, list(ids), [], time.monotonic()
    self.model.reset_slot(slot)
    x, pos, finish = np.asarray(ids, dtype=np.uint32), 0, "length"
    while len(out_ids) < n_max:
      token = sampler.sample(self.model.forward(slot, x, pos), history)
      pos += len(x)
      if not out_ids: self.ch.emit(Event.FIRST_TOKEN_READY, stage=self.index, token_id=token, ttft_s=round(time.monotonic() - t0, 4))
      if token in tok.end_ids: finish = "stop"; break
      out_ids.append(token); history.append(token)
      self.ch.emit(Event.TOKEN_PROGRESS, stage=self.index, token_id=token, completion_tokens=len(out_ids))
      x = np.asarray([token], dtype=np.uint32)
    self.model.reset_slot(slot)
    self.ch.emit(Event.PROMPT_COMPLETED, stage=self.index, prompt_token_ids=ids, token_ids=out_ids, text=tok.decode(out_ids),
                 finish_reason=finish, elapsed_s=round(time.monotonic() - t0, 4))

  def query_stats(self, cmd: dict) -> None:
    s = dict(self.stats, wall_s=time.monotonic() - self.stats["started"], open_streams=len(self.streams),
             pending_tokens=sum(len(x) for st in self.streams.values() for _, x in st.pending))
    s.pop("started")
    if self.writer is not None: s["egress_occupancy"] = self.writer.occupancy()
    if self.model is not None and self.model.expert_load is not None: s["expert_load"] = self.model.expert_load.tolist()
    if self.blocks is not None: s.update(self.blocks.stats, prefix_cache_bytes=self.blocks.nbytes if self.blocks.pools is not None else 0)
    self.ch.emit(Event.STAGE_STATS, stage=self.index, **s)

  # --- lifecycle ----------------------------------------------------------------------------------
  def die(self, f: Fatal, code: int = 3) -> None:
    if self.profile_report is not None: self.profile_report()  # os._exit skips atexit
    try:
      self.ch.emit(Event.WORKER_FATAL, stage=self.index, reason=f.reason, message=f.message, **f.extra)
      self.close_rings()
    finally:
      os._exit(code)

  def dispatch(self, line: str) -> bool:
    """Run one command line; False for ShutdownWorker. Any malformed line raises its named error (InvalidCommand, UnknownCommand, ...)."""
    if not line.strip(): return True
    try: cmd = json.loads(line)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer past the digit limit, nesting past the stack
      raise errors.InvalidCommand(f"not a JSON object: {type(e).__name__}: {show(str(e), 200)}") from None
    if not isinstance(cmd, dict): raise errors.InvalidCommand(f"a command is a JSON object, not {type(cmd).__name__}")
    name = cmd.get("command")
    if not isinstance(name, str): raise errors.InvalidCommand(f"'command' must be a string naming a command, not {show(name)}")
    if name == Command.SHUTDOWN_WORKER: return False
    if (handler := self.commands.get(name)) is None: raise errors.UnknownCommand(f"unknown command {show(name)}")
    handler(cmd)
    return True

  def collect(self) -> None:
    """Between records: the only place this process collects garbage (pyruntime/gc_policy.py); its pauses counted,
    since a step that waits on one delays every stream in it."""
    t0 = time.monotonic()
    if collect_due() < 0: return
    dt, s = time.monotonic() - t0, self.stats
    s.update(gc_collections=s["gc_collections"] + 1, gc_s=s["gc_s"] + dt, gc_max_s=max(s["gc_max_s"], dt))

  def serve(self, commands: queue.Queue) -> None:
    """Commands and records both run here, on the main thread: tinygrad's state (its kernel cache
    database among it) belongs to the thread that created it. Between records we look for commands.
    The queue holds command lines, an InvalidCommand (the reader could not read a line) or None (stdin closed)."""
    self.command_queue = commands
    while True:
      self.collect()
      self.beat()
      try:
        if self.deferred: item = self.deferred.popleft()
        elif self.looping:
          try: item = commands.get_nowait()
          except queue.Empty:
            self.poll_ring()
            continue
        else: item = commands.get()
        if item is None: break  # stdin closed: the launcher is gone
        if isinstance(item, BaseException): raise item
        if not self.dispatch(item): break
      except BaseException as e:  # noqa: BLE001 - every failure reaches the launcher by name
        self.die(fatal_from(e))
    self.close_rings()
    self.ch.emit(Event.WORKER_STOPPED, stage=self.index)


def _step_text(rows: int, chunk_of: int | None) -> str:
  """What a step does, in words, for a Heartbeat."""
  parts = [f"a step of {rows} decode rows"] if rows else []
  if chunk_of is not None: parts.append(f"a prompt chunk of stream {chunk_of}")
  return " and ".join(parts)


def _command_name(item: Any) -> str | None:
  """The command a queued line names (None: not a well-formed command line; dispatch names what is wrong with it)."""
  if not isinstance(item, str): return None
  try: cmd = json.loads(item)
  except (ValueError, RecursionError): return None
  return cmd.get("command") if isinstance(cmd, dict) else None


def read_commands(fd: int, commands: queue.Queue) -> None:
  """The control-in thread: bytes from `fd` split into lines and decoded here (strict UTF-8), so a bad line reaches
  the main thread as an InvalidCommand rather than killing this thread and leaving the stage waiting for ever. Plain os.read,
  no io buffer: a daemon thread blocked inside a BufferedReader aborts the interpreter at exit."""
  buf = b""
  try:
    while True:
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        if buf: lines = [buf]; buf = b""
        else: break
      else:
        *lines, buf = (buf + chunk).split(b"\n")
      if len(buf) > MAX_COMMAND_BYTES or any(len(raw) > MAX_COMMAND_BYTES for raw in lines):
        return commands.put(errors.InvalidCommand(f"a command line longer than {MAX_COMMAND_BYTES} bytes"))
      for raw in lines:
        try: commands.put(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
          return commands.put(errors.InvalidCommand(f"a command line that is not UTF-8: {e}"))
  except BaseException as e:  # noqa: BLE001 - reading stdin failed: the main thread ends the stage by name
    return commands.put(errors.InvalidCommand(f"cannot read the control channel: {type(e).__name__}: {e}"))
  commands.put(None)


def _die_with_parent() -> None:
  # The launcher may be killed -9; the kernel then sends us SIGTERM so we never outlive it.
  try: ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except OSError: pass


def main() -> None:
  collect_on_this_thread()  # never on tinygrad's CPU worker threads, where a collection can deadlock them
  channel = Channel()
  stage = Stage(channel)

  launcher_pid = os.getppid()  # before a dead launcher's orphans are re-parented

  def on_term(signum, frame):
    stage.close_rings()
    try:
      from pyruntime.ring import DEFAULT_PREFIX, cleanup_stale
      # a launcher killed -9 cannot unlink its arena; its orphans do it for it. Only that launcher's segments
      # ({prefix}-{pid}-...): other launchers' orphans are theirs to clean, or `pyruntime shm clean`'s
      cleanup_stale(f"{DEFAULT_PREFIX}-{launcher_pid}")
    except Exception as e:  # noqa: BLE001 - exiting regardless; stderr reaches the launcher's tail of it
      os.write(2, f"pyruntime stage: cleaning the launcher's segments on exit failed: {type(e).__name__}: {e}\n".encode())
    os._exit(128 + signum)

  signal.signal(signal.SIGTERM, on_term)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the launcher, which shuts us down in order
  _die_with_parent()
  if os.environ.get("PYRUNTIME_PROFILE"):
    from pyruntime.profiler import start_profiler
    stage.profile_report = start_profiler(channel.emit)
  commands: queue.Queue = queue.Queue()
  threading.Thread(target=read_commands, args=(0, commands), name="control-in", daemon=True).start()
  stage.serve(commands)


if __name__ == "__main__":
  main()
