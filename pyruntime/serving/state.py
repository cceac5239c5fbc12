"""The server's state behind its routes (docs/serving.md): the launcher it serves with, admission (how many requests run
and how many wait), each request's job (its streams' events handed to the event loop), and the pipeline's phase:

    ok          requests are served
    recovering  a stage died; a supervisor thread closes the failed launcher and starts a new one (backoff, attempt limit)
    unavailable the pipeline is down and will not come back
    draining    shutting down: new requests get 503, running ones finish (or are ended at the grace period)

No HTTP here: the routes (server.py) read the state and answer.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from typing import Any, Callable, Protocol

from pyruntime import errors
from pyruntime.engine.events import Delta, Done
from pyruntime.options import RESTART_ATTEMPTS
from pyruntime.serving import openai_api as api
from pyruntime.serving.metrics import Metrics, StatsSampler
from pyruntime.serving.openai_api import (
  ModelNotFound,
  ServerDraining,
  ServerRecovering,
  ServerShuttingDown,
  ServiceUnavailable,
)

RESTART_BACKOFF_S = 1.0         # wait before the 2nd attempt; doubled for each further one
RESTART_BACKOFF_MAX_S = 60.0
FAILED_START_GRACE_S = 0.5      # a pipeline still starting when the server stops: its stages get this long after SIGTERM
HEALTH_POLL_S = 0.5             # how often the supervisor looks at the stages when nothing reports a failure
STABLE_S = 60.0                 # a pipeline that ran this long resets the count of consecutive restarts


class LauncherLike(Protocol):
  """What the server needs of a launcher (pyruntime.launcher.Launcher; the unit tests' FakeLauncherForUnitTests)."""
  model_name: str
  recipe: str
  context_length: int
  max_streams: int

  def submit(self, prompt: str | None = None, messages: list[dict] | None = None, *, on_event: Callable[[Any], None],
             **options: Any) -> Any: ...
  def scheduler_stats(self) -> dict: ...
  def stage_view(self) -> list[dict]: ...
  def alive(self) -> list[bool]: ...
  def serving(self) -> bool: ...
  def ring_occupancy(self) -> list[float]: ...
  def expert_load(self) -> list[list[int] | None]: ...
  def close(self) -> None: ...   # ends its stages; the server calls it on a failed launcher it replaces, and at its own end


class Job:
  """One accepted request: its streams' events (one stream per choice: OpenAI's n, a batch of prompts), handed from the
  launcher's driver thread to the request's asyncio queue as (kind, choice index, event)."""
  def __init__(self, loop: asyncio.AbstractEventLoop, admission: Admission, launcher: Any = None, choices: int = 1):
    self.loop, self.admission, self.launcher = loop, admission, launcher
    self.events: asyncio.Queue[tuple[str, int, Any]] = asyncio.Queue()
    self.streams: list[Any] = []
    self.choices = self.open_choices = choices
    self.on_finished: Callable[[Job], None] | None = None   # the server's registry of running requests
    self.accepted = time.monotonic()
    self.first = True
    self.last_token_t = 0.0
    self.ended = False
    self._end_lock = threading.Lock()

  def on_event(self, index: int, ev: Any) -> None:
    """Called by the launcher (its driver thread) with choice `index`'s events: metrics, then the request's queue.
    Never blocks."""
    m, now = self.admission.metrics, time.monotonic()
    if isinstance(ev, Delta) and ev.token_ids:
      m.completion_tokens.inc(len(ev.token_ids))
      if self.first: m.ttft.observe(now - self.accepted); self.first = False
      else: m.itl.observe(now - self.last_token_t)
      self.last_token_t = now
    elif isinstance(ev, Done) and ev.finish_reason != "cancelled":  # the server cancelled it: its client has gone
      m.done(ev, self.accepted, now)
    elif isinstance(ev, BaseException):
      m.error(ev.code if isinstance(ev, errors.PyruntimeError) else type(ev).__name__)
      self.admission.note_error(ev)
    if isinstance(ev, (Done, BaseException)):
      with self._end_lock: self.open_choices -= 1
      if self.ended or (not self.open_choices and not self.end()): return  # ended already (aborted by the server)
    try: self.loop.call_soon_threadsafe(self.events.put_nowait, ("error" if isinstance(ev, BaseException) else "event", index, ev))
    except RuntimeError: pass  # the event loop is gone (server shutting down)

  def end(self) -> bool:
    """The request is over (answered, failed or abandoned): its place is free. Idempotent: True the first time."""
    with self._end_lock:
      if self.ended: return False
      self.ended = True
    self.admission.release(self.choices)
    return True

  def cancel(self) -> None:
    """The response is over (its handler's `finally`): stop the stream if it still runs, free its place."""
    if not self.ended and self.streams:
      self.admission.metrics.cancelled.inc()
    for st in self.streams: st.cancel()  # frees the stream's slot in every stage; a no-op once it ended
    self.end()
    if self.on_finished is not None: self.on_finished(self)

  def abort(self, e: BaseException) -> None:
    """End a running request from outside (the server shuts down): the stream stops and the response ends with
    `e` (streaming: an SSE error event, then [DONE]). From any thread."""
    if not self.end(): return
    self.admission.metrics.error(e.code if isinstance(e, errors.PyruntimeError) else type(e).__name__)
    for st in self.streams:
      try: st.cancel()
      except Exception as x:  # noqa: BLE001 - a launcher that already failed has nothing left to stop
        log.debug("cancelling an aborted request's stream: %s", x)
    try: self.loop.call_soon_threadsafe(self.events.put_nowait, ("abort", -1, e))
    except RuntimeError: pass  # the event loop is gone


class Admission:
  """Streams in flight, counted as the launcher counts them (one per choice: OpenAI's n times the prompts): up to its
  `max_streams` run, `queue_size` more wait (the launcher serves them first come first served); a request whose
  streams do not fit is refused with 429 at once, one that could never fit with 400 naming `n`. So a request waits
  behind at most `queue_size` queued streams, whatever `n` the others asked for (docs/serving.md, "Admission")."""
  def __init__(self, launcher: LauncherLike, queue_size: int, metrics: Metrics, on_error: Callable[[BaseException], None]):
    if queue_size < 0: raise errors.InvalidOption("queue_size", f"must be >= 0, got {queue_size}")
    self.launcher, self.queue_size, self.metrics, self.note_error = launcher, queue_size, metrics, on_error
    self.lock = threading.Lock()
    self.in_flight = 0

  @property
  def limit(self) -> int:
    """Streams admitted at once: the running launcher's capacity (it may be a new one after a restart) and the queue."""
    return self.launcher.max_streams + self.queue_size

  def check(self, streams: int) -> None:
    """A request of `streams` streams that could never be admitted is refused by name (400)."""
    if streams > self.limit:
      raise errors.InvalidOption("n", f"the request needs {streams} streams (n times the prompts); this server runs "
                                      f"{self.launcher.max_streams} at once and queues {self.queue_size} more")

  def try_acquire(self, streams: int = 1) -> bool:
    with self.lock:
      if self.in_flight + streams > self.limit: return False
      self.in_flight += streams
      return True

  def release(self, streams: int = 1) -> None:
    with self.lock: self.in_flight -= streams


class ServerState:
  """What the app serves with: the current launcher, its admission and metrics, the requests running, and the phase:

    ok          requests are served
    recovering  a stage died: the running requests got their error, new ones get 503 (Retry-After) while a new
                pipeline starts (only with a `restart` factory; else the server stays `unavailable`)
    unavailable the pipeline is down and will not come back (no factory, or the restarts were used up)
    draining    shutting down: new requests get 503, running ones finish (or are ended at the grace period)
  """
  def __init__(self, launcher: LauncherLike, queue_size: int, *, restart: Callable[[], LauncherLike] | None = None,
               restart_attempts: int = RESTART_ATTEMPTS, restart_backoff_s: float = RESTART_BACKOFF_S,
               restart_backoff_max_s: float = RESTART_BACKOFF_MAX_S):
    if restart_attempts < 1: raise errors.InvalidOption("restart_attempts", f"must be >= 1, got {restart_attempts}")
    if not restart_backoff_s >= 0: raise errors.InvalidOption("restart_backoff_s", f"must be >= 0, got {restart_backoff_s}")
    self.launcher, self.queue_size = launcher, queue_size
    self.metrics = Metrics()
    self.metrics.expert_load = self.expert_load
    self.metrics.stage_memory = self.stage_memory
    self.last_error: dict[str, Any] | None = None
    self.admission = Admission(launcher, queue_size, self.metrics, on_error=self._note_error)
    self.created = int(time.time())
    self.model_id, self.model_names = served_model_names(launcher)
    self.lock = threading.Lock()
    self.jobs: set[Job] = set()
    self.draining = False
    self.gave_up = False
    self.restarts = 0                  # pipelines started after a failure, in all
    self.restart = restart
    self.restart_attempts, self.restart_backoff_s, self.restart_backoff_max_s = restart_attempts, restart_backoff_s, restart_backoff_max_s
    self.recovery: dict[str, Any] | None = None   # while recovering: {"attempt", "since", "next_attempt_at"}
    self._wake = threading.Event()
    self._stop = threading.Event()
    self._supervisor: threading.Thread | None = None
    self.starting: Any = None          # a launcher the supervisor is starting now: close() ends it at once
    self.sampler = StatsSampler(self.raw_view, self.metrics)  # /stats, /metrics, `pyruntime top` (pyruntime/serving/metrics.py); runs while served
    if restart is not None:
      # This thread starts every later pipeline and lives as long as the server: a stage's parent-death signal
      # follows the thread that spawned it, so a short-lived thread would take its stages down when it ends.
      self._supervisor = threading.Thread(target=self._supervise, name="pipeline-supervisor", daemon=True)
      self._supervisor.start()

  # --- phase --------------------------------------------------------------------------------------
  @property
  def phase(self) -> str:
    if self.draining: return "draining"
    if self.recovery is not None: return "recovering"
    if self.healthy(): return "ok"
    return "recovering" if self.restart is not None and not self.gave_up and not self._stop.is_set() else "unavailable"

  def unavailable(self) -> ServiceUnavailable | None:
    """Why a new request is refused now (503), or None."""
    if self.draining: return ServerDraining("the server is shutting down; retry on another instance", retry_after=5)
    phase = self.phase
    if phase == "recovering":
      self._wake.set()
      wait = 1
      if self.recovery and self.recovery.get("next_attempt_at"): wait = max(1, int(self.recovery["next_attempt_at"] - time.monotonic() + 1))
      return ServerRecovering("a stage of the pipeline failed; the server is restarting it, retry shortly", retry_after=wait)
    return None

  def failed(self, launcher: Any = None) -> None:
    """A request saw its launcher fail (StageFailed, or LauncherClosed on submit): look at once."""
    self._wake.set()

  # --- requests -----------------------------------------------------------------------------------
  def add_job(self, job: Job) -> None:
    job.on_finished = self._job_finished
    with self.lock: self.jobs.add(job)

  def _job_finished(self, job: Job) -> None:
    with self.lock: self.jobs.discard(job)

  def drain(self, grace_s: float, flush_s: float = 5.0) -> int:
    """Stop admitting; wait up to `grace_s` for the running requests to finish; end the rest (an SSE error event and
    [DONE]); wait up to `flush_s` for their responses to go out. Returns how many were ended."""
    self.draining = True
    deadline = time.monotonic() + max(0.0, grace_s)
    while time.monotonic() < deadline:
      with self.lock:
        if not self.jobs: return 0
      time.sleep(0.05)
    with self.lock: running = list(self.jobs)
    for job in running: job.abort(ServerShuttingDown(f"the server shut down before this request finished (grace period {grace_s:g} s)"))
    deadline = time.monotonic() + flush_s
    while time.monotonic() < deadline:
      with self.lock:
        if not self.jobs: break
      time.sleep(0.02)
    return len(running)

  def close(self) -> None:
    """Stop the supervisor and the current launcher (and any pipeline it is starting). Idempotent."""
    self._stop.set(); self._wake.set()
    for lm, grace in ((self.starting, FAILED_START_GRACE_S), (self.launcher, None)):
      try:
        if lm is not None: lm.close() if grace is None else lm.close(grace_s=grace)
      except Exception:  # noqa: BLE001 - closing goes on: the other launcher, the supervisor
        log.warning("closing a launcher failed", exc_info=True)
    if self._supervisor is not None and self._supervisor is not threading.current_thread():
      self._supervisor.join(timeout=60)

  # --- the supervisor -----------------------------------------------------------------------------
  def _supervise(self) -> None:
    consecutive, started = 0, time.monotonic()
    try:
      while not self._stop.is_set():
        self._wake.wait(HEALTH_POLL_S)
        self._wake.clear()
        if self._stop.is_set() or self.draining: continue
        if self.healthy(): continue
        if time.monotonic() - started > STABLE_S: consecutive = 0
        consecutive = self._recover(consecutive)
        started = time.monotonic()
        if self.gave_up: break
    finally:
      if self._stop.is_set():   # this thread spawned the current stages: end them in order before it goes
        try: getattr(self.launcher, "close", lambda: None)()
        except Exception:  # noqa: BLE001
          log.warning("closing the launcher at the supervisor's end failed", exc_info=True)

  def _recover(self, consecutive: int) -> int:
    """Close the failed launcher, then build new ones (exponential backoff) until one starts or the attempts are used."""
    old = self.launcher
    self.recovery = {"attempt": 0, "since": time.time(), "next_attempt_at": None}
    announce(f"a stage failed ({(self.last_error or {}).get('message', 'stage not alive')}); restarting the pipeline")
    try: getattr(old, "close", lambda: None)()   # it closed itself on the failure; make sure: stages ended, arena unlinked
    except Exception:  # noqa: BLE001 - the restart goes on
      log.warning("closing the failed launcher failed", exc_info=True)
    try:
      while not self._stop.is_set() and not self.draining:
        if consecutive >= self.restart_attempts:
          self.gave_up = True
          announce(f"the pipeline failed to restart {consecutive} times in a row; giving up (503 until restarted)")
          return consecutive
        delay = 0.0 if consecutive == 0 else min(self.restart_backoff_s * 2 ** (consecutive - 1), self.restart_backoff_max_s)
        consecutive += 1
        self.recovery.update(attempt=consecutive, next_attempt_at=time.monotonic() + delay)
        if delay and self._stop.wait(delay): return consecutive
        t0 = time.monotonic()
        try:
          assert self.restart is not None
          new = self.restart()
          if getattr(new, "started", True) is False:  # started here, where close() can reach it while it loads
            self.starting = new
            try:
              if self._stop.is_set(): raise errors.LauncherClosed("the server is stopping")  # close() came first
              new.start()
            finally: self.starting = None
        except Exception as e:  # noqa: BLE001 - a failed start is one failed attempt
          self._note_error(e)
          announce(f"restart attempt {consecutive} failed: {type(e).__name__}: {e}")
          continue
        if self._stop.is_set() or self.draining:
          new.close()  # type: ignore[attr-defined]
          return consecutive
        self.swap(new)
        announce(f"pipeline restarted in {time.monotonic() - t0:.1f} s (attempt {consecutive})")
        return consecutive
      return consecutive
    finally:
      self.recovery = None

  def swap(self, launcher: LauncherLike) -> None:
    with self.lock:
      self.launcher = launcher
      self.admission.launcher = launcher
      self.restarts += 1

  # --- observation --------------------------------------------------------------------------------
  def check_model(self, name: str | None) -> None:
    """ModelNotFound (404) unless a request names the served model: its id, 'default', or its display name."""
    if name is not None and name not in self.model_names: raise ModelNotFound(name, self.model_id)

  def _note_error(self, e: BaseException) -> None:
    info: dict[str, Any] = {"time": int(time.time()), "code": e.code if isinstance(e, errors.PyruntimeError) else type(e).__name__,
                            "message": str(e)}
    if isinstance(e, errors.StageFailed): info.update(stage=e.stage, reason=e.reason)
    self.last_error = info
    if isinstance(e, (errors.StageFailed, errors.LauncherClosed)): self._wake.set()

  def healthy(self) -> bool:
    """Every stage alive and the launcher able to serve (its driver running: stages alive are not enough)."""
    alive = self.alive()
    try: serving = bool(getattr(self.launcher, "serving", lambda: True)())
    except Exception: serving = False  # noqa: BLE001 - a launcher that cannot say is not healthy
    return bool(alive) and all(alive) and serving

  def alive(self) -> list[bool]:
    try: return [bool(a) for a in self.launcher.alive()]
    except Exception: return []  # noqa: BLE001 - a launcher that cannot say is not healthy

  def scheduler_stats(self) -> dict:
    try: return dict(self.launcher.scheduler_stats())
    except Exception: return {}  # noqa: BLE001 - a closed launcher runs nothing

  def occupancy(self) -> list[float]:
    try: return [float(v) for v in self.launcher.ring_occupancy()]
    except Exception: return []  # noqa: BLE001 - the arena is gone once the launcher closed

  def expert_load(self) -> list[list[int] | None]:
    try: return list(self.launcher.expert_load())
    except Exception: return []  # noqa: BLE001 - a closed or failed launcher has no stages to ask

  def stage_memory(self) -> list[dict | None]:
    try: return [s.get("memory") for s in self.launcher.stage_stats()]
    except Exception: return []  # noqa: BLE001 - a closed or failed launcher has no stages to ask

  def raw_view(self) -> dict[str, Any]:
    """The launcher's figures for the sampler (pyruntime/serving/metrics.py): scheduler, rings, stages, the server's phase."""
    lm = self.launcher
    try: stages = list(lm.stage_view())
    except Exception: stages = [{"stage": i, "alive": a} for i, a in enumerate(self.alive())]  # noqa: BLE001 - closed: none to ask
    return {**self.scheduler_stats(), "phase": self.phase, "model": lm.model_name, "restarts": self.restarts, "rings": self.occupancy(),
            "stages": stages}


log = logging.getLogger("pyruntime.server")


def announce(text: str) -> None:
  sys.stderr.write(f"pyruntime: {text}\n"); sys.stderr.flush()


def served_model_names(launcher: Any) -> tuple[str, frozenset[str]]:
  """(the model's id, every name a request may use for it).

  The id is derived from the GGUF file name (`openai_api.model_id`: lowercase, no spaces), stable
  across restarts and typeable; 'default' and the GGUF's display name (general.name, what /v1/models
  listed before) are accepted too, so older clients keep working."""
  display = str(launcher.model_name)
  path = getattr(launcher, "path", None)
  mid = api.model_id(path if path is not None else display)
  return mid, frozenset({mid, "default", display})
