"""One pipeline stage process: `python -m pyruntime.stage`.

Control is JSON lines: commands on stdin, events on stdout, logs on stderr (docs/control-channel.md). The
control channel sets the stage up, tears it down and reports errors and telemetry; once the
rings are installed the stage runs its own data loop (pyruntime/stage/dataloop.py, steered by pyruntime/stage/scheduler.py) and no
control message moves per token.
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
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from pyruntime import errors
from pyruntime.devices import nvidia_compilers, parse_device
from pyruntime.options import PREFILL_SHARE, WEIGHT_MODES
from pyruntime.protocol import ABI_VERSION, Command, Event, split_object_id
from pyruntime.stage import memory_use
from pyruntime.stage.dataloop import DataLoop
from pyruntime.stage.gc_policy import collect_due, collect_on_this_thread
from pyruntime.stage.scheduler import StageScheduler

if TYPE_CHECKING:  # what the stage holds, imported when it gets it (the control channel answers before tinygrad loads)
  from pyruntime.modelfile.gguf import GGUFHeader
  from pyruntime.stage.compute.kv_blocks import KVBlocks
  from pyruntime.stage.compute.model import StageModel
  from pyruntime.text.tokenizer import Tokenizer
  from pyruntime.transport.ring import Record

GRAMMAR_WAIT_S = 10.0  # the tail waits this long for a structured stream's SetGrammar (sent before its OPEN)
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


def role_from(cmd: dict) -> dict:
  """ConfigureRole's arguments, checked: the stage's role."""
  role = {"stage": arg_int(cmd, "stage", hi=1 << 16), "start": arg_int(cmd, "start", hi=1 << 20), "end": arg_int(cmd, "end", hi=1 << 20),
          "slots": arg_int(cmd, "slots", 4, lo=1, hi=1024), "boundary_dtype": arg(cmd, "boundary_dtype", str, "float32"),
          "max_context": arg_int(cmd, "max_context", None, lo=1, hi=1 << 24), "decode": arg(cmd, "decode", str, "batched"),
          "warmup": arg(cmd, "warmup", bool, False), "micro_batches": arg_int(cmd, "micro_batches", 1, lo=1, hi=1024),
          "weights": arg(cmd, "weights", str, "quantized"), "prefill_share": arg(cmd, "prefill_share", (int, float), PREFILL_SHARE),
          "prefix_blocks": arg_int(cmd, "prefix_blocks", 0, hi=1 << 24), "block_size": arg_int(cmd, "block_size", 16, lo=1, hi=1 << 12),
          "prefix_states": arg_int(cmd, "prefix_states", 0, hi=1 << 20),
          "graph_cache": arg(cmd, "graph_cache", bool, True), "tensor_cores": arg(cmd, "tensor_cores", bool, False)}
  from pyruntime.options import CHOICES, NUMBERS
  CHOICES["boundary_dtype"].check(role["boundary_dtype"], errors.InvalidCommand)
  CHOICES["decode"].check(role["decode"], errors.InvalidCommand)
  if role["weights"] not in WEIGHT_MODES: raise errors.InvalidCommand(f"weights must be one of {WEIGHT_MODES}, not {show(role['weights'])}")
  try: NUMBERS["prefill_share"].check(role["prefill_share"])
  except errors.InvalidOption as e: raise errors.InvalidCommand(str(e)) from None
  if role["start"] < 0 or role["end"] <= role["start"]:
    raise errors.LayerRangeInvalid(f"layer range [{role['start']}, {role['end']}) is empty or negative")
  return role


def prompt_ids(cmd: dict, tok: Any, kv: dict) -> list[int]:
  """The prompt a text command names: cmd['token_ids'], or a prompt or messages rendered by the GGUF's chat template (kv)."""
  if "token_ids" in cmd:
    if (ids := token_ids(cmd, tok.vocab_size)): return ids
    raise errors.EmptyPrompt("token_ids is empty")
  from pyruntime.text.chat import build_prompt_ids
  prompt, messages, raw = arg(cmd, "prompt", str, None), arg(cmd, "messages", list, None), arg(cmd, "raw", bool, False)
  if messages is not None and not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
    raise errors.InvalidOption("messages", "each message must be an object with a string 'role'")
  try: return build_prompt_ids(tok, kv, prompt=prompt, messages=messages, raw=raw)
  except errors.PyruntimeError: raise
  except Exception as e: raise errors.InvalidOption("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from e  # noqa: BLE001


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


class Stage:
  """The stage worker: every control command's handler (the table in __init__; docs/control-channel.md), over the model
  LoadWeights loads, the scheduler (pyruntime/stage/scheduler.py) and the data loop that moves the records
  (pyruntime/stage/dataloop.py). The commands are the stage's contract and stay together here, hence the length."""
  def __init__(self, channel: Channel) -> None:
    self.ch = channel
    self.device: str | None = None
    self.role: dict | None = None
    self.model: StageModel | None = None
    self.blocks: KVBlocks | None = None  # the prefix cache's blocks (ConfigureRole prefix_blocks, prefix_states)
    self.header: GGUFHeader | None = None
    self.tokenizer: Tokenizer | None = None
    self.sched = StageScheduler()       # set by ConfigureRole and LoadWeights; its streams are the open ones
    self.loop: DataLoop | None = None   # from LoadWeights on
    self.loaded: Record | None = None   # the record RingReadable loaded, in step mode
    self.profile_report: Callable[[], None] | None = None
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
    self.command_queue: queue.Queue = queue.Queue()  # serve()'s: await_grammar reads ahead in it
    self.deferred: collections.deque = collections.deque()  # what await_grammar read ahead, run first

  @property
  def index(self) -> int | None: return self.role["stage"] if self.role else None

  @property
  def looping(self) -> bool: return self.loop is not None and self.loop.looping

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
    if device:
      try: target = parse_device(device).target  # the renderer only: tinygrad reads "CUDA:1" as renderer "1"
      except errors.InvalidOption as e: raise errors.InvalidCommand(f"InitializeWorker: {e}") from e
      # tinygrad read DEV when it was imported (before this command); the environment is for processes this one starts.
      # Without its own default, tinygrad finds one by opening every backend in turn (Device.DEFAULT) the first time a
      # tensor names no device (the blocks' constructors): PoCL's OpenCL in every CPU stage (~50 MB), the first GPU
      # backend that answers in a GPU host's stages (model.resolve_device sets DEV only for a device naming a renderer)
      from tinygrad.helpers import DEV
      os.environ["DEV"] = DEV.value = target
    nvidia_compilers()
    self.device = device
    self.ch.emit(Event.WORKER_READY, pid=os.getpid(), device=device, abi_version=ABI_VERSION)

  def configure(self, cmd: dict) -> None:
    role = role_from(cmd)
    self.sched.decode_mode, self.sched.micro_batches, self.sched.prefill_share = role["decode"], role["micro_batches"], float(role["prefill_share"])
    self.role = role
    self.ch.emit(Event.ROLE_CONFIGURED, **role)

  def load_weights(self, cmd: dict) -> None:
    if self.role is None: raise errors.RoleNotConfigured("LoadWeights before ConfigureRole")
    from pyruntime.modelfile.gguf import read_header
    from pyruntime.modelfile.source import resolve_model
    from pyruntime.stage.compute.model import StageModel
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
      from pyruntime.stage.compute.graph_cache import GraphCache, graph_dir
      graphs = GraphCache(graph_dir(cache_dir), warn=lambda text: self.ch.emit(Event.STAGE_WARNING, stage=self.index, message=text))
    try:
      self.model = StageModel.load(path, r["start"], r["end"], device=self.device, max_context=r["max_context"], slots=r["slots"],
                                   boundary_dtype=r["boundary_dtype"], weights=r["weights"], decode=r["decode"],
                                   tensor_cores=r["tensor_cores"], graph_cache=graphs)
    except errors.PyruntimeError: raise
    except Exception as e: raise Fatal("ModelLoadFailed", f"{type(e).__name__}: {e}", traceback=traceback.format_exc()) from e
    m = self.start_data_path(self.model)
    if m.is_tail:  # the structured-output bridge, built now rather than on the first grammar's step (every stream's)
      from pyruntime.text.grammar import vocabulary
      vocabulary(self._tok())
    # the prefix cache may keep a decoded position only where a decode row has a prompt row's bits (the rows path)
    b = self.blocks
    cache = {"blocks": b.blocks, "block_size": b.block_size, "bytes_per_token": b.bytes_per_token, "decoded_positions": m.batched,
             "states": b.snapshots, "state_bytes": b.state_bytes} if b is not None else None
    self.ch.emit(Event.WEIGHTS_LOADED, stage=self.index, elapsed_s=round(time.monotonic() - t0, 4), path=str(path), arch=m.arch,
                 num_blocks=m.num_blocks, start=m.start, end=m.end, is_head=m.is_head, is_tail=m.is_tail, dim=m.dim,
                 vocab_size=m.vocab_size, context_length=m.context_length, resident_bytes=m.resident_bytes,
                 boundary=m.boundary.to_dict(), family=m.family, batched=m.batched, prefix_cache=cache)
    self.warm_up(m, graphs)

  def start_data_path(self, m: StageModel) -> StageModel:
    """What the loaded model decides: the scheduler's decode mode and chunk bounds, the prefix cache's blocks, the data loop."""
    # the batched decode serves every family; decode="reference" runs tinygrad's own decode, one stream at a time (which
    # keeps streams in flight exact trivially)
    if not m.batched: self.sched.decode_mode = "reference"
    self.sched.max_chunk, self.sched.min_chunk, self.sched.is_head = m.max_chunk, m.min_chunk, m.is_head
    self.sched.prompt_rows_in_window = m.prompt_rows_in_window
    if self.role["prefix_blocks"] and (states := m.position_states()) is not None:
      from pyruntime.stage.compute.kv_blocks import KVBlocks
      self.blocks = KVBlocks(states, self.role["prefix_blocks"], self.role["block_size"], m.recurrent_states(), self.role["prefix_states"])
      if self.blocks.recurrent: m.on_boundary, m.boundary_every = self.blocks.mark, self.blocks.block_size
    self.loop = DataLoop(self.ch.emit, self.index, m, self.blocks, self.sched, self.stats, self.constraint)
    return m

  def warm_up(self, m: StageModel, graphs: Any) -> None:
    """The graphs a request needs (with warmup: every decode window) ready before the first request, from the graph cache
    when it has them: a stream never waits on a capture, and what a new process prepares shows while it does."""
    t0 = time.monotonic()
    shapes = m.warm_up(every_window=self.role["warmup"], on_graph=lambda kind, what, seconds, cached: self.ch.emit(
      Event.GRAPH_PREPARING if what == "preparing" else Event.GRAPH_READY, stage=self.index, graph=kind, seconds=round(seconds, 3),
      cached=cached))
    m.on_capture = self.loop.on_capture  # from now on a capture happens mid-flight: say so (the launcher's stall rule)
    self.ch.emit(Event.WARMED_UP, stage=self.index, batch_shapes=shapes, shape_ms={str(k): round(v, 2) for k, v in m.shape_ms.items()},
                 elapsed_s=round(time.monotonic() - t0, 3), graph_cache=graphs.stats if graphs is not None else None)

  def install_ring(self, cmd: dict) -> None:
    if self.model is None: raise errors.WeightsNotLoaded("InstallRing before LoadWeights")
    if self.loop.arena is not None: raise errors.InvalidCommand("InstallRing: the rings are installed already (UninstallRing first)")
    name, ingress, egress = arg(cmd, "arena", str), arg_int(cmd, "ingress", hi=1 << 16), arg_int(cmd, "egress", hi=1 << 16)
    mode = arg(cmd, "mode", str, "loop")
    if mode not in ("loop", "step"): raise errors.InvalidCommand(f"InstallRing: mode must be 'loop' or 'step', not {show(mode)}")
    if ingress == egress: raise errors.InvalidCommand(f"InstallRing: ingress and egress are both ring {ingress}")
    if (upstream := arg(cmd, "ingress_boundary", dict, None)) is not None:
      try: self.model.boundary.check_ingress(upstream)
      except errors.PyruntimeError: raise
      except Exception as e: raise errors.BoundarySchemaMismatch(f"not a stage boundary description: {show(upstream, 200)}") from e  # noqa: BLE001
    self.loop.install(name, ingress, egress)
    self.ch.emit(Event.RING_INSTALLED, stage=self.index, arena=name, ingress=ingress, egress=egress, mode=mode)
    self.loop.looping = mode == "loop"

  def uninstall_ring(self, cmd: dict) -> None:
    self.close_rings()
    if self.loop is not None: self.loop.looping = False
    self.ch.emit(Event.RING_UNINSTALLED, stage=self.index)

  def close_rings(self) -> None:
    if self.loop is not None: self.loop.close_rings()

  def set_grammar(self, cmd: dict) -> None:
    """SetGrammar: a structured stream's grammar, before its OPEN (the tail only)."""
    stream, grammar = arg_int(cmd, "stream", hi=1 << 32), arg(cmd, "grammar", str)
    if self.model is None or not self.model.is_tail: raise errors.InvalidCommand("SetGrammar goes to the tail stage")
    grammars = self.loop.grammars
    if len(grammars) >= 4 * self.model.slots: grammars.pop(next(iter(grammars)))  # a stream whose OPEN never came
    grammars[stream] = grammar

  def constraint(self, stream_id: int) -> Any:
    """The grammar matcher of a structured stream the data loop opens."""
    from pyruntime.text.grammar import Constraint
    return Constraint(self.await_grammar(stream_id), self._tok(), self.model.vocab_size)

  def await_grammar(self, stream_id: int) -> str:
    """The stream's grammar: its SetGrammar left the launcher before the OPEN did, but the control channel and the rings
    race; until it is here, other commands wait their turn (in order) and only SetGrammar lines run."""
    deadline = time.monotonic() + GRAMMAR_WAIT_S
    while stream_id not in self.loop.grammars:
      try: item = self.command_queue.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty: raise errors.GrammarMissing(f"no SetGrammar for stream {stream_id} within {GRAMMAR_WAIT_S:.0f} s of its OPEN") from None
      if _command_name(item) == Command.SET_GRAMMAR: self.dispatch(item)
      else: self.deferred.append(item)
    return self.loop.grammars[stream_id]

  # --- step-by-step driving by an outside orchestrator -------------------------------------------
  def ring_readable(self, cmd: dict) -> None:
    if self.loop is None or self.loop.reader is None: raise errors.RingNotInstalled("RingReadable before InstallRing")
    if self.looping: raise errors.InvalidCommand("RingReadable needs InstallRing with mode 'step'")
    if self.loaded is None:
      try: self.loaded = self.loop.reader.read(timeout=arg_seconds(cmd, "timeout_s", 0.0))
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
    self.loop.take(self.loaded)
    while self.sched.has_work(): self.loop.run_step()
    self.ch.emit(Event.STEP_EXECUTED, stage=self.index, object_id=self.loaded.object_id, elapsed_s=round(time.monotonic() - t0, 6))

  def release_object(self, cmd: dict) -> None:
    if self.loaded is None: raise errors.NoObjectLoaded("ReleaseDeviceObject without a record loaded by RingReadable")
    seq, self.loaded = self.loaded.sequence, None
    self.loop.reader.release()
    self.ch.emit(Event.OBJECT_RELEASED, stage=self.index, sequence=seq)

  # --- text and whole-prompt commands (tokenizer from the GGUF itself) ---------------------------
  def _tok(self) -> Any:
    if self.header is None: raise errors.WeightsNotLoaded("the tokenizer comes from the GGUF: LoadWeights first")
    if self.tokenizer is None:
      from pyruntime.text.tokenizer import Tokenizer
      self.tokenizer = Tokenizer.from_gguf_kv(self.header.kv)
    return self.tokenizer

  def _prompt_ids(self, cmd: dict) -> list[int]: return prompt_ids(cmd, self._tok(), self.header.kv)

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
    from pyruntime.stage.compute.sampling import Sampler
    from pyruntime.text.textstream import budget
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
    s = dict(self.stats, wall_s=time.monotonic() - self.stats["started"], open_streams=len(self.sched.streams),
             pending_tokens=sum(len(x) for st in self.sched.streams.values() for _, x in st.pending))
    s.pop("started")
    if self.loop is not None and self.loop.writer is not None: s["egress_occupancy"] = self.loop.writer.occupancy()
    if self.model is not None and self.model.expert_load is not None: s["expert_load"] = self.model.expert_load.tolist()
    pool = self.blocks.nbytes if self.blocks is not None and self.blocks.pools is not None else 0
    if self.blocks is not None: s.update(self.blocks.stats, prefix_cache_bytes=pool)
    s["memory"] = memory_use.breakdown(self.model, pool)  # where this process's memory goes (pyruntime/stage/memory_use.py)
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
    """Between records: the only place this process collects garbage (pyruntime/stage/gc_policy.py); its pauses counted,
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
      if self.loop is not None: self.loop.beat()
      try:
        if self.deferred: item = self.deferred.popleft()
        elif self.looping:
          try: item = commands.get_nowait()
          except queue.Empty:
            self.loop.poll()
            continue
        else: item = commands.get()
        if item is None: break  # stdin closed: the launcher is gone
        if isinstance(item, BaseException): raise item
        if not self.dispatch(item): break
      except BaseException as e:  # noqa: BLE001 - every failure reaches the launcher by name
        self.die(fatal_from(e))
    self.close_rings()
    self.ch.emit(Event.WORKER_STOPPED, stage=self.index)


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
      from pyruntime.transport.ring import DEFAULT_PREFIX, cleanup_stale
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
    from pyruntime.stage.profiler import start_profiler
    stage.profile_report = start_profiler(channel.emit)
  commands: queue.Queue = queue.Queue()
  threading.Thread(target=read_commands, args=(0, commands), name="control-in", daemon=True).start()
  stage.serve(commands)
  # stopped in order (rings closed, WorkerStopped sent): nothing is left to write, and the interpreter's teardown of a
  # loaded model (tinygrad's atexit hooks, every buffer and graph collected) took ~0.3 s of every close
  if stage.profile_report is not None: stage.profile_report()
  sys.stdout.flush(); sys.stderr.flush()
  os._exit(0)

