"""The launcher: spawns the stage processes, wires their rings and drives generation.

    with Launcher(stages=2) as lm:
        for ev in lm.generate("What is the capital of France?", max_tokens=32):
            if isinstance(ev, Delta): print(ev.text, end="")

Data flows one way: launcher → head ring → stage → ring → … → tail → ring → launcher. The
launcher closes the loop itself (it must see every token anyway, to decode text and apply
stop strings), so the head never waits on a token the launcher would have to cancel.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from pyruntime import errors
from pyruntime.records import ABI_VERSION, FLAG_CLOSE, FLAG_END, FLAG_OPEN, encode_json, object_id, split_object_id

POLL_S = 0.05          # how often a waiting launcher looks at its stages' health
STOP_GRACE_S = 5.0     # how long a stage gets to stop in order before it is killed
FAIL_GRACE_S = 0.5     # after a failure the survivors get SIGTERM and this long before SIGKILL


@dataclass
class Delta:
  text: str
  token_ids: list[int]


@dataclass
class Logits:
  """With `logits=True` the tail sends its float32 logits instead of a token; the launcher decodes greedily."""
  position: int
  values: np.ndarray


@dataclass
class Usage:
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int = 0

  @property
  def total_tokens(self) -> int: return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
  load_s: float
  ttft_s: float
  decode_tokens_per_s: float
  elapsed_s: float


@dataclass
class Done:
  finish_reason: str                 # "stop" | "length"
  usage: Usage
  timings: Timings
  prompt_token_ids: list[int]
  token_ids: list[int]
  text: str
  stop: str | None = None            # the stop string that ended it, if one did


@dataclass
class StageHandle:
  """One stage process and its control channel."""
  index: int
  proc: subprocess.Popen
  stderr: Any
  events: queue.Queue = field(default_factory=queue.Queue)
  fatal: dict | None = None
  info: dict = field(default_factory=dict)

  def send(self, command: str, **args: Any) -> None:
    try:
      self.proc.stdin.write(json.dumps({"command": command, **args}) + "\n")
      self.proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
      pass  # the process is gone; its reader thread reports why

  def stderr_tail(self, n: int = 2000) -> str:
    try:
      self.stderr.flush(); self.stderr.seek(0, os.SEEK_END)
      self.stderr.seek(max(0, self.stderr.tell() - n))
      return self.stderr.read().decode(errors="replace")
    except (OSError, ValueError): return ""

  def failure(self) -> errors.StageFailed | None:
    if self.fatal is not None:
      return errors.StageFailed(self.index, self.fatal.get("reason", "WorkerFatal"), self.fatal.get("message", ""))
    if (rc := self.proc.poll()) is not None:
      how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
      return errors.StageFailed(self.index, "WorkerExited", f"{how}; stderr tail: {self.stderr_tail(600).strip()}")
    return None


def recipe_digest(model: str, split: Sequence[tuple[int, int]], dtype: str, template: str) -> str:
  """Names what produced a result: model, split, boundary dtype and chat template."""
  return hashlib.sha256(json.dumps([model, [list(r) for r in split], dtype, template]).encode()).hexdigest()[:16]


class Launcher:
  def __init__(self, model: str | os.PathLike | None = None, *, stages: int = 2, split: Sequence[tuple[int, int]] | None = None,
               devices: str | Sequence[str] | None = None, boundary_dtype: str = "float32", kv_slots: int = 4,
               max_context: int | None = None, on_event: Callable[[dict], None] | None = None,
               cache_dir: str | None = None, stage_env: dict[str, str] | None = None, load_timeout_s: float = 900.0):
    if boundary_dtype not in ("float32", "float16"): raise errors.InvalidOption("boundary_dtype", "float32 or float16")
    if kv_slots < 1: raise errors.InvalidOption("kv_slots", "at least 1")
    self.model_source, self.stages_wanted, self.split_wanted = model, stages, split
    self.devices_wanted, self.boundary_dtype, self.kv_slots = devices, boundary_dtype, kv_slots
    self.max_context_wanted, self.on_event, self.cache_dir = max_context, on_event, cache_dir
    self.stage_env, self.load_timeout_s = dict(stage_env or {}), load_timeout_s
    self.events: list[dict] = []          # every event seen, in order: the plain way to look at them
    self.handles: list[StageHandle] = []
    self.arena: Any = None
    self.head: Any = None                 # writer of the head ring
    self.tail: Any = None                 # reader of the tail's egress ring
    self._lock = threading.Lock()         # one generation at a time on the rings
    self._streams = itertools.count(1)
    self._closed = False
    self._old_sigterm: Any = None
    # launcher time per token, between a token's arrival and the next write: wall, and this thread's CPU
    # (on a loaded machine the wall time includes being preempted by the stage we just woke)
    self.overhead = {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0}

  # --- start -------------------------------------------------------------------------------------
  def __enter__(self) -> "Launcher":
    self.start()
    return self

  def __exit__(self, *exc: Any) -> None: self.close()

  def start(self) -> "Launcher":
    from pyruntime.devices import parse_devices
    from pyruntime.gguf import read_header
    from pyruntime.model import suggest_split
    from pyruntime.ring import Arena, RingSpec
    from pyruntime.source import resolve_model
    from pyruntime.tokenizer import Tokenizer
    t0 = time.monotonic()
    self._install_sigterm()
    try:
      self.path = resolve_model(None if self.model_source is None else str(self.model_source), cache_dir=self.cache_dir,
                                on_progress=lambda done, total: self._event({"event": "DownloadProgress", "bytes": done, "total": total}))
      self.header = read_header(self.path)
      self.model_name = self.header.kv.get("general.name") or self.path.stem
      self.num_blocks = int(self.header.get("block_count"))
      self.split = [tuple(r) for r in (self.split_wanted or suggest_split(self.header, self.stages_wanted, by="memory"))]
      check_split(self.split, self.num_blocks)
      self.devices = parse_devices(self.devices_wanted, len(self.split))
      self.context_length = int(min(self.max_context_wanted or 1 << 62, self.header.get("context_length")))
      self.tokenizer = Tokenizer.from_gguf_kv(self.header.kv)
      self.dim = int(self.header.get("embedding_length"))
      self.vocab_size = self.tokenizer.vocab_size
      itemsize = 2 if self.boundary_dtype == "float16" else 4
      # ring i feeds stage i; ring n carries the tail's tokens back. A record must fit the whole prompt.
      ids_bytes, act_bytes = self.context_length * 4, self.context_length * self.dim * itemsize
      open_bytes = 64 + 16 * self.context_length + 4096  # the OPEN record carries the prompt ids as history
      specs = [RingSpec(capacity=_pow2(2 * (max(ids_bytes, open_bytes) + 64)), max_extent=max(ids_bytes, open_bytes), alignment=4)]
      specs += [RingSpec(capacity=_pow2(2 * (max(act_bytes, open_bytes) + 64)), max_extent=max(act_bytes, open_bytes), alignment=itemsize)
                for _ in self.split[1:]]
      tail_bytes = max(self.vocab_size * 4, open_bytes)
      specs.append(RingSpec(capacity=_pow2(4 * (tail_bytes + 64)), max_extent=tail_bytes, alignment=4))
      self.arena = Arena.create(specs)
      self._event({"event": "ArenaCreated", "name": self.arena.name, "rings": len(specs)})
      self.handles = [self._spawn(i) for i in range(len(self.split))]
      for h, (start, end), dev in zip(self.handles, self.split, self.devices, strict=True):
        h.send("InitializeWorker", device=dev, abi_version=ABI_VERSION)
        h.send("ConfigureRole", stage=h.index, start=start, end=end, slots=self.kv_slots, boundary_dtype=self.boundary_dtype,
               max_context=self.context_length)
        h.send("LoadWeights", model=str(self.path))
      for h in self.handles:  # the stages load in parallel; we just collect
        h.info = self._expect(h, "WeightsLoaded", self.load_timeout_s)
      for h in self.handles:
        upstream = self.handles[h.index - 1].info["boundary"] if h.index > 0 else None
        h.send("InstallRing", arena=self.arena.name, ingress=h.index, egress=h.index + 1, ingress_boundary=upstream)
      for h in self.handles: self._expect(h, "RingInstalled", 30)
      self.head, self.tail = self.arena.writer(0), self.arena.reader(len(self.split))
      self.template = self.header.kv.get("tokenizer.chat_template") or ""
      self.recipe = recipe_digest(self.model_name, self.split, self.boundary_dtype, self.template)
      self.load_s = time.monotonic() - t0
      self._event({"event": "LauncherReady", "load_s": round(self.load_s, 3), "split": [list(r) for r in self.split],
                   "devices": self.devices})
    except BaseException:
      self.close()
      raise
    return self

  def _spawn(self, index: int) -> StageHandle:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **self.stage_env)
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "pyruntime.stage"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=err, env=env, text=True, bufsize=1)
    h = StageHandle(index, proc, err)
    threading.Thread(target=self._pump, args=(h,), name=f"stage-{index}-events", daemon=True).start()
    self._event({"event": "StageSpawned", "stage": index, "pid": proc.pid})
    return h

  def _pump(self, h: StageHandle) -> None:
    for line in h.proc.stdout:
      try: ev = json.loads(line)
      except json.JSONDecodeError: continue
      ev.setdefault("stage", h.index)
      if ev.get("event") == "WorkerFatal": h.fatal = ev
      self._event(ev)
      h.events.put(ev)
    h.proc.wait()
    h.events.put(None)  # EOF: the process is gone

  def _event(self, ev: dict) -> None:
    self.events.append(ev)
    if self.on_event is not None:
      try: self.on_event(ev)
      except Exception: pass  # noqa: BLE001 - a watcher's bug must not break generation

  def _expect(self, h: StageHandle, name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
      try: ev = h.events.get(timeout=min(POLL_S * 4, max(0.0, deadline - time.monotonic())))
      except queue.Empty: ev = {}
      if ev is None or (ev and ev.get("event") == "WorkerFatal"):
        raise self._fail(h.failure() or errors.StageFailed(h.index, "WorkerExited"))
      if ev and ev.get("event") == name: return ev
      if (f := self._first_failure()) is not None: raise self._fail(f)
      if time.monotonic() > deadline: raise self._fail(errors.StageFailed(h.index, "Timeout", f"no {name} within {timeout:.0f} s"))

  def _first_failure(self) -> errors.StageFailed | None:
    # A dead stage makes its neighbours fail too (PeerDead, RingClosed): name the root cause.
    failures = [f for h in self.handles if (f := h.failure()) is not None]
    return min(failures, key=lambda f: f.reason in ("PeerDead", "RingClosed"), default=None)

  def _fail(self, f: errors.StageFailed) -> errors.StageFailed:
    """A stage failed: end every stage, unlink every segment, and hand back the error to raise."""
    self._event({"event": "StageFailed", "stage": f.stage, "reason": f.reason, "message": f.detail})
    self.close(grace_s=FAIL_GRACE_S)
    return f

  # --- health ------------------------------------------------------------------------------------
  def alive(self) -> list[bool]:
    return [h.proc.poll() is None and h.fatal is None for h in self.handles]

  def ring_occupancy(self) -> list[float]:
    """Fill fraction of each ring, head ingress first and the tail's egress last."""
    if self.arena is None or self._closed: return []
    states = [self.arena.state(i) for i in range(len(self.split) + 1)]
    return [(st["head"] - st["tail"]) / spec.capacity for st, spec in zip(states, self.arena.specs, strict=True)]

  def stage_stats(self, timeout: float = 10.0) -> list[dict]:
    """Each stage's counters (records, tokens, compute_s, wait_s, wall_s), asked over the control channel."""
    for h in self.handles: h.send("QueryStats")
    return [self._expect(h, "StageStats", timeout) for h in self.handles]

  # --- generation --------------------------------------------------------------------------------
  def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None, raw: bool = False) -> list[int]:
    from pyruntime.chat import build_prompt_ids
    return build_prompt_ids(self.tokenizer, self.header.kv, prompt=prompt, messages=messages, raw=raw)

  def generate(self, prompt: str | None = None, messages: list[dict] | None = None, *, raw: bool = False,
               max_tokens: int | None = 256, stop: str | Sequence[str] | None = None, logits: bool = False,
               ignore_eos: bool = False, **sampling: Any) -> Iterator[Delta | Logits | Done]:
    """Stream a completion: `Delta`s as text becomes final, then one `Done`.

    Options (SPEC §4): max_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty,
    frequency_penalty, presence_penalty, penalty_last_n, stop. Bad values raise `InvalidOption`
    naming the field before anything runs; `raw=True` skips the chat template; `ignore_eos=True`
    generates through end tokens (benchmarks: a fixed number of tokens).
    """
    from pyruntime.sampling import SamplingParams
    from pyruntime.textstream import StopStream, budget
    if self._closed or self.head is None: raise errors.LauncherClosed("the launcher is not running")
    try: params = SamplingParams(**sampling)
    except TypeError as e: raise errors.UnsupportedFeature(str(e).split("'")[1] if "'" in str(e) else "option", str(e)) from None
    params.validate()
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
      raise errors.InvalidOption("max_tokens", f"must be a positive integer, got {max_tokens!r}")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stopper = StopStream(stops)
    ids = self.prompt_ids(prompt, messages, raw)
    n_max = budget(max_tokens if max_tokens is not None else self.context_length, self.context_length, len(ids))
    end_ids = frozenset() if ignore_eos else self.tokenizer.end_ids
    return self._run(ids, n_max, params, stopper, logits, end_ids)

  def _run(self, ids: list[int], n_max: int, params: Any, stopper: Any, want_logits: bool,
           end_ids: frozenset[int]) -> Iterator[Delta | Logits | Done]:
    from pyruntime.tokenizer import IncrementalDecoder
    with self._lock:
      t0 = time.monotonic()
      stream = next(self._streams)
      opened = closed = False
      out: list[int] = []
      text: list[str] = []
      finish, stop_hit, t_first, t_last = "length", None, None, None
      try:
        info = {"slot": 0, "identity": {"request": stream, "recipe": self.recipe}, "sampling": params.to_dict(),
                "history": ids, "end_ids": sorted(end_ids), "logits": want_logits}
        self._write(object_id(stream, 0), encode_json(info, 4), FLAG_OPEN)
        opened = True
        self._write(object_id(stream, 0), np.asarray(ids, dtype="<u4"), 0)
        ack = self._read()
        if not (ack.flags & FLAG_OPEN) or split_object_id(ack.object_id)[0] != stream:
          raise errors.ResultIdentityMissing(f"the tail answered {ack.object_id:#x} before acknowledging stream {stream}")
        self.tail.release()
        decoder = IncrementalDecoder(self.tokenizer)
        while True:
          rec = self._read()
          t_got, cpu_got = time.monotonic(), time.thread_time()
          sid, pos = split_object_id(rec.object_id)
          if sid != stream or rec.flags & (FLAG_OPEN | FLAG_CLOSE):
            raise errors.ResultIdentityMissing(f"result {rec.object_id:#x} (flags {rec.flags}) does not belong to stream {stream}")
          if want_logits:
            values = rec.array("<f4").copy()
            yield Logits(pos, values)
            token = int(np.argmax(values))
            end = token in end_ids
          else:
            token, end = int(rec.array("<u4")[0]), bool(rec.flags & FLAG_END)
          self.tail.release()
          t_last = time.monotonic()
          if t_first is None: t_first = t_last
          if end: finish = "stop"; break
          out.append(token)
          safe, stop_hit = stopper.push(decoder.push(token))
          if safe:
            text.append(safe)
            yield Delta(safe, [token])
          else:
            yield Delta("", [token])  # held back (a possible stop string, or half a UTF-8 character)
          if stop_hit is not None: finish = "stop"; break
          if len(out) >= n_max: break
          self._write(object_id(stream, len(ids) + len(out) - 1), np.asarray([token], dtype="<u4"), 0)
          self.overhead["tokens"] += 1
          self.overhead["seconds"] += time.monotonic() - t_got
          self.overhead["cpu_seconds"] += time.thread_time() - cpu_got
        if stop_hit is None:
          if rest := stopper.flush(decoder.flush()):
            text.append(rest)
            yield Delta(rest, [])
          if stopper.matched is not None: finish, stop_hit = "stop", stopper.matched  # the last bytes completed a stop string
        self._close_stream(stream)
        closed = True
        elapsed = time.monotonic() - t0
        decode = (len(out) - 1) / (t_last - t_first) if len(out) > 1 and t_last > t_first else 0.0
        yield Done(finish, Usage(len(ids), len(out)), Timings(round(self.load_s, 4), round((t_first or t0) - t0, 4),
                   round(decode, 3), round(elapsed, 4)), ids, out, "".join(text), stop_hit)
      finally:
        if opened and not closed and not self._closed:
          try: self._close_stream(stream)  # a consumer that walked away: free the slot, drain what is in flight
          except errors.PyruntimeError: pass

  def _close_stream(self, stream: int) -> None:
    self._write(object_id(stream, 0), b"", FLAG_CLOSE)
    while True:  # everything of this stream still in flight arrives before the CLOSE ack
      rec = self._read()
      done = bool(rec.flags & FLAG_CLOSE) and split_object_id(rec.object_id)[0] == stream
      self.tail.release()
      if done: return

  def _write(self, oid: int, payload: Any, flags: int) -> None:
    while True:
      try: return self.head.write(oid, payload, flags, timeout=POLL_S)
      except errors.RingTimeout: pass
      except (errors.PeerDead, errors.RingClosed) as e:
        raise self._fail(self._first_failure() or errors.StageFailed(0, e.code)) from None
      if (f := self._first_failure()) is not None: raise self._fail(f)

  def _read(self) -> Any:
    while True:
      try: return self.tail.read(timeout=POLL_S)
      except errors.RingTimeout: pass
      except (errors.PeerDead, errors.RingClosed) as e:
        raise self._fail(self._first_failure() or errors.StageFailed(len(self.handles) - 1, e.code)) from None
      if (f := self._first_failure()) is not None: raise self._fail(f)

  # --- stop --------------------------------------------------------------------------------------
  def close(self, grace_s: float = STOP_GRACE_S) -> None:
    """End every stage process and unlink every segment. Safe to call twice, from any state.

    In order: close our ring sides (the stages drain and stop their loops), ShutdownWorker, and
    after `grace_s` SIGKILL. After a failure the survivors get SIGTERM at once instead.
    """
    if self._closed: return
    self._closed = True
    for side in (self.head, self.tail):
      if side is not None:
        try: side.close()
        except errors.PyruntimeError: pass
    failed = grace_s < STOP_GRACE_S
    for h in self.handles:
      if not failed: h.send("ShutdownWorker")
      elif h.proc.poll() is None: h.proc.terminate()
    deadline = time.monotonic() + grace_s
    for h in self.handles:
      try: h.proc.wait(timeout=max(0.05, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        h.proc.kill()
        h.proc.wait()
    for h in self.handles:
      for f in (h.proc.stdin, h.stderr):
        try: f.close()
        except OSError: pass
    if self.arena is not None:
      self.arena.close()
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


def check_split(split: Sequence[tuple[int, int]], num_blocks: int) -> None:
  """Ranges must be non-empty, contiguous, and cover 0..L-1 exactly once (SPEC §2)."""
  if not split: raise errors.LayerRangeInvalid("the split has no stages")
  expect = 0
  for i, (start, end) in enumerate(split):
    if start != expect:
      raise errors.LayerRangeInvalid(f"stage {i} starts at block {start}, expected {expect} (ranges must be contiguous, no overlap)")
    if end <= start: raise errors.LayerRangeInvalid(f"stage {i} range [{start}, {end}) is empty")
    expect = end
  if expect != num_blocks:
    raise errors.LayerRangeInvalid(f"the split ends at block {expect}, but the model has {num_blocks} blocks")


def parse_split(text: str) -> list[tuple[int, int]]:
  """"0:15,15:30" → [(0, 15), (15, 30)]"""
  try: return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
  except ValueError: raise errors.InvalidOption("split", f"expected START:END,START:END..., got {text!r}") from None


def _pow2(n: int) -> int: return 1 << max(12, (n - 1).bit_length())
