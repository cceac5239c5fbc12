"""`pyruntime serve`: an OpenAI-compatible HTTP server over one `Launcher` (docs/serving.md).

    app = create_app(launcher, queue_size=16)     # a Starlette app; uvicorn runs it

Requests are validated on arrival (`openai_api.parse_request`, then `launcher.submit`, which
tokenizes and checks the context before anything runs), so a bad request is answered at once.
A valid request becomes a `Job` (up to max_streams run, queue_size more wait, then 429); the
launcher's driver thread hands each event to the request's asyncio queue with
`loop.call_soon_threadsafe`. A client that goes away cancels its stream. An error ends that
request only (a 500, or an SSE error event once streaming has begun).

Healing (`create_app(..., restart=factory)`): a supervisor thread watches the stages; when one
dies it closes the failed launcher and builds a new one with the factory (backoff, attempt
limit), then swaps it in; meanwhile /health says `recovering` and requests get 503 + Retry-After.
Draining (`draining_server`, what `serve` runs): SIGTERM stops admission (503), waits up to a
grace period for running requests, ends the rest with an SSE error event and [DONE], then lets
uvicorn exit.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Protocol

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyruntime import errors
from pyruntime.engine.events import Delta, Done
from pyruntime.serving import openai_api as api
from pyruntime.serving import page, responses_api
from pyruntime.serving.metrics import CONTENT_TYPE, Metrics, Sampler
from pyruntime.serving.metrics import parse_expert_load as parse_expert_load  # `inspect --server` reads a server's expert load back
from pyruntime.serving.openai_api import (
  CHAT,
  COMPLETION,
  MalformedRequest,
  ModelNotFound,
  QueueFull,
  RequestTimeout,
  RequestTooLarge,
  ServerDraining,
  ServerRecovering,
  ServerShuttingDown,
  ServiceUnavailable,
  error_body,
  parse_json,
  parse_request,
  sse,
)
from pyruntime.serving.responses_api import RESPONSES

CLIENT_CLOSED = 499   # nginx's status for "the client closed the request"; only ever seen in /metrics

# Limits on what one client may hold (`pyruntime serve` options; see serve()).
MAX_BODY_BYTES = 4 << 20        # a request body beyond this is refused with 413 (read and dropped up to DRAIN_FACTOR times it)
TIMEOUT_REQUEST_HEAD = 10.0     # seconds from connecting (or from the first byte of a keep-alive request) to a complete head
TIMEOUT_REQUEST_BODY = 60.0     # seconds for the whole body, once the head is in
TIMEOUT_KEEP_ALIVE = 5.0        # seconds an idle keep-alive connection is kept
SHUTDOWN_GRACE_S = 30.0         # on SIGTERM, how long running requests may take to finish before they are ended
RESTART_ATTEMPTS = 5            # consecutive failed attempts to restart the pipeline before the server gives up (503 for good)
RESTART_BACKOFF_S = 1.0         # wait before the 2nd attempt; doubled for each further one
RESTART_BACKOFF_MAX_S = 60.0
FAILED_START_GRACE_S = 0.5      # a pipeline still starting when the server stops: its stages get this long after SIGTERM
HEALTH_POLL_S = 0.5             # how often the supervisor looks at the stages when nothing reports a failure
STABLE_S = 60.0                 # a pipeline that ran this long resets the count of consecutive restarts


# --- admission and streams ----------------------------------------------------------------------------
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
    self.admission.release()
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
  """Requests in flight: up to the launcher's `max_streams` run, `queue_size` more wait (the launcher serves them first
  come first served); past that a request is refused with 429 at once."""
  def __init__(self, launcher: LauncherLike, queue_size: int, metrics: Metrics, on_error: Callable[[BaseException], None]):
    if queue_size < 0: raise errors.InvalidOption("queue_size", f"must be >= 0, got {queue_size}")
    self.launcher, self.queue_size, self.metrics, self.note_error = launcher, queue_size, metrics, on_error
    self.limit = int(getattr(launcher, "max_streams", 1)) + queue_size
    self.lock = threading.Lock()
    self.in_flight = 0

  def try_acquire(self) -> bool:
    with self.lock:
      if self.in_flight >= self.limit: return False
      self.in_flight += 1
      return True

  def release(self) -> None:
    with self.lock: self.in_flight -= 1



# --- HTTP ------------------------------------------------------------------------------------------
async def run_until_disconnect(receive: Callable[[], Awaitable[dict]], body: Callable[[], Awaitable[None]]) -> bool:
  """Run `body` until it returns or the client disconnects (then it is cancelled); True when the client went away."""
  gone = False
  async with anyio.create_task_group() as tg:
    async def watch() -> None:
      nonlocal gone
      while (await receive())["type"] != "http.disconnect": pass
      gone = True
      tg.cancel_scope.cancel()
    tg.start_soon(watch)
    await body()
    tg.cancel_scope.cancel()
  return gone


class SSEResponse:
  """A server-sent-events response fed by a job; always watches for the client going away."""
  def __init__(self, state: "ServerState", job: Job, shaper: Any, kind: str):
    self.state, self.job, self.shaper, self.kind = state, job, shaper, kind
    self.status_code = 200

  async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
    closed = finished = False

    async def out(message: dict) -> None:
      nonlocal closed
      if closed: return
      try: await send(message)
      except OSError: closed = True   # a server that reports a closed connection by raising (ASGI spec >= 2.4)

    async def chunk(data: bytes) -> None: await out({"type": "http.response.body", "body": data, "more_body": True})

    async def body() -> None:
      nonlocal finished
      await out({"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                             (b"x-accel-buffering", b"no")]})
      for c in self.shaper.first_chunks(self.job.choices): await chunk(sse(c))
      dones: dict[int, Done] = {}
      while not closed:
        kind, index, ev = await self.job.events.get()
        if kind in ("error", "abort"):
          for c in self.shaper.error_chunks(ev): await chunk(sse(c))
          if kind == "abort": await chunk(self.shaper.done_marker)   # the server ended it: a clean end of the stream, not a cut
          break
        if isinstance(ev, Delta):
          for c in self.shaper.delta_chunks(index, ev): await chunk(sse(c))
        elif isinstance(ev, Done):
          dones[index] = ev
          for c in self.shaper.final_chunks(index, ev): await chunk(sse(c))
          if len(dones) == self.job.choices:
            if self.shaper.include_usage: await chunk(sse(self.shaper.usage_chunk([dones[i] for i in range(len(dones))])))
            await chunk(self.shaper.done_marker)
            break
      await out({"type": "http.response.body", "body": b"", "more_body": False})
      finished = not closed

    # The server answers receive() with http.disconnect as soon as the last body message is sent, so a
    # disconnect seen after a complete response is the response's own end, not the client leaving.
    try: gone = (await run_until_disconnect(receive, body) or closed) and not finished
    finally: self.job.cancel()
    if gone: scope.setdefault("state", {})["pyruntime_status"] = CLIENT_CLOSED


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
    self.sampler = Sampler(self.raw_view, self.metrics)  # /stats, /metrics, `pyruntime top` (pyruntime/serving/metrics.py); runs while served
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
    _log(f"a stage failed ({(self.last_error or {}).get('message', 'stage not alive')}); restarting the pipeline")
    try: getattr(old, "close", lambda: None)()   # it closed itself on the failure; make sure: stages ended, arena unlinked
    except Exception:  # noqa: BLE001 - the restart goes on
      log.warning("closing the failed launcher failed", exc_info=True)
    try:
      while not self._stop.is_set() and not self.draining:
        if consecutive >= self.restart_attempts:
          self.gave_up = True
          _log(f"the pipeline failed to restart {consecutive} times in a row; giving up (503 until restarted)")
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
          _log(f"restart attempt {consecutive} failed: {type(e).__name__}: {e}")
          continue
        if self._stop.is_set() or self.draining:
          new.close()  # type: ignore[attr-defined]
          return consecutive
        self.swap(new)
        _log(f"pipeline restarted in {time.monotonic() - t0:.1f} s (attempt {consecutive})")
        return consecutive
      return consecutive
    finally:
      self.recovery = None

  def swap(self, launcher: LauncherLike) -> None:
    with self.lock:
      self.launcher = launcher
      self.admission.launcher = launcher
      self.admission.limit = int(getattr(launcher, "max_streams", 1)) + self.queue_size
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

  def raw_view(self) -> dict[str, Any]:
    """The launcher's figures for the sampler (pyruntime/serving/metrics.py): scheduler, rings, stages, the server's phase."""
    lm = self.launcher
    try: stages = list(lm.stage_view())
    except Exception: stages = [{"stage": i, "alive": a} for i, a in enumerate(self.alive())]  # noqa: BLE001 - closed: none to ask
    return {**self.scheduler_stats(), "phase": self.phase, "model": lm.model_name, "restarts": self.restarts, "rings": self.occupancy(),
            "stages": stages}


log = logging.getLogger("pyruntime.server")


def _log(text: str) -> None:
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


def _error(e: BaseException, kind: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
  status, body = error_body(e, kind)
  return JSONResponse(body, status_code=status, headers=headers)


def _unavailable(e: ServiceUnavailable, kind: str | None = None) -> JSONResponse:
  return _error(e, kind, headers={"retry-after": str(e.retry_after)})


async def _generate(state: ServerState, request: Request, kind: str) -> Any:
  """One completion request: parse, admit, submit, then stream (SSE) or collect the answer."""
  try:
    body = parse_json(await request.body())
    req = responses_api.parse(body) if kind == RESPONSES else parse_request(body, kind)
    state.check_model(req.model)
  except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-shaped answer
    return _error(e, kind)
  if (refused := state.unavailable()) is not None: return _unavailable(refused, kind)
  launcher = state.launcher
  job = Job(asyncio.get_running_loop(), state.admission, launcher, req.choices)
  if not state.admission.try_acquire(): return _error(QueueFull(state.admission.queue_size), kind, headers={"retry-after": "1"})
  state.add_job(job)
  if (refused := await _submit(state, launcher, job, req, kind)) is not None: return refused
  tokenizer = getattr(launcher, "tokenizer", None)
  if kind == RESPONSES: shaper = responses_api.ResponsesShaper(req, body, state.model_id, tokenizer)
  else: shaper = api.shaper_for(req, state.model_id, launcher.recipe, tokenizer)
  if req.stream: return SSEResponse(state, job, shaper, kind)
  return await _collect(request, job, shaper, kind)


async def _submit(state: ServerState, launcher: LauncherLike, job: Job, req: Any, kind: str) -> JSONResponse | None:
  """Start the job's stream on the launcher; the error answer if it cannot start. Validation, tokenisation and the
  context check run off the event loop: one request never stalls the others."""
  try:
    await run_in_threadpool(_submit_streams, launcher, job, req)
    return None
  except Exception as e:  # noqa: BLE001
    job.cancel()
    if isinstance(e, (errors.LauncherClosed, errors.StageFailed)):
      state.failed(launcher)  # it failed between our look and the submit
      if (refused := state.unavailable()) is not None: return _unavailable(refused, kind)
    if not isinstance(e, (errors.InvalidOption, errors.UnsupportedFeature, errors.ContextLengthExceeded, MalformedRequest, ModelNotFound)):
      state.metrics.error(e.code if isinstance(e, errors.PyruntimeError) else type(e).__name__)
    return _error(e, kind)


def _submit_streams(launcher: LauncherLike, job: Job, req: Any) -> None:
  """Each prompt of the request (one, or a completions batch) as a stream, or n of them: choice p * n + i is choice i of
  prompt p (OpenAI's order). A prompt refused leaves none of the request's streams running (Job.cancel)."""
  for p, prompt in enumerate(req.prompts or [None]):
    gen = dict(req.generate)
    if isinstance(prompt, str): gen["prompt"] = prompt
    elif prompt is not None: gen["prompt_ids"] = prompt
    if req.n == 1: job.streams.append(launcher.submit(**gen, on_event=functools.partial(job.on_event, p)))
    else: job.streams += launcher.submit(**gen, n=req.n, on_event=lambda i, ev, base=p * req.n: job.on_event(base + i, ev))


async def _collect(request: Request, job: Job, shaper: Any, kind: str) -> Response:
  """A non-streaming answer: wait for the stream's end (or the client's going away, which cancels it)."""
  result: dict[str, Any] = {}

  dones: dict[int, Done] = {}

  async def collect() -> None:
    while True:
      what, index, ev = await job.events.get()
      if what in ("error", "abort"): result["error"] = ev; return
      if isinstance(ev, Done):
        dones[index] = ev
        if len(dones) == job.choices: return

  try: gone = await run_until_disconnect(request.receive, collect)
  finally: job.cancel()
  if gone:
    request.scope.setdefault("state", {})["pyruntime_status"] = CLIENT_CLOSED
    return Response(status_code=CLIENT_CLOSED)
  if "error" in result:
    e = result["error"]
    # the pipeline failed before this answer started: the request can be retried, as every later one is told (503)
    if isinstance(e, (errors.StageFailed, errors.LauncherClosed)):
      return _unavailable(ServerRecovering(f"the pipeline failed before this request was answered ({e}); the server is "
                                           "restarting it, retry shortly", retry_after=1), kind)
    return _error(e, kind)
  return JSONResponse(shaper.response([dones[i] for i in range(job.choices)]))


def _health(state: ServerState) -> JSONResponse:
  """/health: the phase (200 when ok, else 503 with Retry-After), each stage's state, the scheduler's figures."""
  lm = state.launcher
  alive = state.alive()
  phase = state.phase
  split = list(getattr(lm, "split", None) or [])
  stages = [{"stage": i, "status": "alive" if a else "dead", "layers": list(split[i]) if i < len(split) else None}
            for i, a in enumerate(alive)]
  sched = state.scheduler_stats()
  body: dict[str, Any] = {"status": phase, "model": lm.model_name, "stages": stages, "queue_depth": sched.get("waiting", 0),
                          "running": sched.get("running", 0), "max_streams": sched.get("max_streams", 0),
                          "batch_size": sched.get("last_batch", 0), "mean_batch_size": round(sched.get("mean_batch", 0.0), 3),
                          "tokens_per_s": round(sched.get("tokens_per_s", 0.0), 3), "last_error": state.last_error,
                          "restarts": state.restarts}
  if (rec := state.recovery) is not None: body["recovery"] = {"attempt": rec["attempt"], "since": int(rec["since"])}
  headers = {"retry-after": str(r.retry_after)} if phase != "ok" and (r := state.unavailable()) is not None else None
  return JSONResponse(body, status_code=200 if phase == "ok" else 503, headers=headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
  assert isinstance(exc, HTTPException)
  code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
  message = f"Unknown request URL: {request.method} {request.url.path}" if exc.status_code == 404 else \
            f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else str(exc.detail)
  return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                      status_code=exc.status_code, headers=exc.headers)


def create_app(launcher: Any, *, queue_size: int = 16, max_body_bytes: int = MAX_BODY_BYTES,
               timeout_request_body: float = TIMEOUT_REQUEST_BODY, restart: Callable[[], LauncherLike] | None = None,
               restart_attempts: int = RESTART_ATTEMPTS, restart_backoff_s: float = RESTART_BACKOFF_S,
               restart_backoff_max_s: float = RESTART_BACKOFF_MAX_S, api_key: str | None = None,
               allowed_hosts: frozenset[str] | None = None) -> Starlette:
  # long (~70 lines): the routes, a few lines each, closing over one ServerState; a table more than logic
  """The OpenAI-compatible app over a started launcher (or anything with its interface), with its page at `/`.

  `api_key`: the API, /stats and /metrics need `Authorization: Bearer api_key`; `allowed_hosts`: the Host names it
  answers to (None: any); a request from a foreign Origin is refused either way (pyruntime/serving/page.py, docs/page.md).

  A body longer than `max_body_bytes` is answered 413 (request_too_large) without being read past
  the limit; one that takes longer than `timeout_request_body` seconds to arrive, 408.

  `restart`: a factory returning a new launcher, started or not (one whose `started` is False the supervisor starts,
  where closing the app can end it while it loads: `pyruntime serve` passes it so). With it the server heals: when a stage dies the running
  requests end with their error, new ones get 503 with Retry-After while a supervisor thread closes the failed
  launcher and builds a new one (the first attempt at once, then waits of `restart_backoff_s` doubling up to
  `restart_backoff_max_s`; after `restart_attempts` failures in a row it gives up). The app then owns the
  launchers: `app.state.pyruntime.close()` ends the current one."""
  if max_body_bytes < 0: raise errors.InvalidOption("max_body_bytes", f"must be >= 0, got {max_body_bytes}")
  if not timeout_request_body > 0: raise errors.InvalidOption("timeout_request_body", f"must be > 0, got {timeout_request_body}")
  state = ServerState(launcher, queue_size, restart=restart, restart_attempts=restart_attempts, restart_backoff_s=restart_backoff_s,
                      restart_backoff_max_s=restart_backoff_max_s)

  async def chat_completions(request: Request) -> Any: return await _generate(state, request, CHAT)
  async def completions(request: Request) -> Any: return await _generate(state, request, COMPLETION)
  async def responses(request: Request) -> Any: return await _generate(state, request, RESPONSES)

  async def models(request: Request) -> JSONResponse:
    return JSONResponse(api.models_list(state.model_id, state.created, state.launcher.context_length))

  async def model(request: Request) -> JSONResponse:
    try: state.check_model(request.path_params["model"])
    except ModelNotFound as e: return _error(e)
    return JSONResponse(api.model_card(state.model_id, state.created, state.launcher.context_length))

  async def health(request: Request) -> JSONResponse: return _health(state)

  async def metrics(request: Request) -> Response:
    # off the event loop: a mixture-of-experts model's expert load is a round trip to each stage
    return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE)

  async def profile(request: Request) -> JSONResponse:
    """Each stage's latest ProfileReport (PYRUNTIME_PROFILE; docs/stats.md), [] when the stages do not profile."""
    reports = getattr(state.launcher, "profile_reports", None)
    return JSONResponse({"profiles": list(reports()) if reports is not None else []})

  async def stats(request: Request) -> JSONResponse:
    """The pipeline's view and its history (docs/stats.md); `?history=0` for the latest view alone."""
    return JSONResponse(state.sampler.stats(history=request.query_params.get("history", "1") not in ("0", "false")))

  async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return _error(exc)

  async def tokenizer_route(request: Request) -> JSONResponse:
    """/tokenize, /detokenize (vLLM's), /tokenizer_info: off the event loop, a long text holds the interpreter a while."""
    lm, path = state.launcher, request.url.path
    try:
      if path == "/tokenizer_info": return JSONResponse(api.tokenizer_info(lm.tokenizer, lm.context_length))
      body = parse_json(await request.body())
      state.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
      if path == "/tokenize": return JSONResponse(await run_in_threadpool(api.tokenize, body, lm))
      return JSONResponse(await run_in_threadpool(api.detokenize, body, lm.tokenizer))
    except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI-shaped answer
      return _error(e)

  routes = [Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]), Route("/stats/profile", profile, methods=["GET"]),
            Route("/tokenize", tokenizer_route, methods=["POST"]), Route("/detokenize", tokenizer_route, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_route, methods=["GET"])]
  routes += page.routes()
  known = {r.path for r in routes if "{" not in r.path}

  @contextlib.asynccontextmanager
  async def lifespan(app: Starlette) -> Any:
    state.sampler.start()
    try: yield
    finally: state.sampler.stop()

  if api_key is not None and not api_key: raise errors.InvalidOption("api_key", "must not be empty")
  app = Starlette(routes=routes, middleware=[Middleware(page.Guard, api_key=api_key, hosts=allowed_hosts),
                                             Middleware(CountRequests, metrics=state.metrics, known=known),
                                             Middleware(LimitRequestBody, max_bytes=max_body_bytes, timeout=timeout_request_body)],
                  exception_handlers={HTTPException: _http_error, Exception: internal_error}, lifespan=lifespan)
  app.state.pyruntime = state
  return app


class CountRequests:
  """ASGI middleware: count each HTTP request by route and final status."""
  def __init__(self, app: Any, metrics: Metrics, known: set[str]):
    self.app, self.metrics, self.known = app, metrics, known

  async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] != "http": return await self.app(scope, receive, send)
    path = scope.get("path", "")
    route = path if path in self.known else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
    status = 500

    async def send_status(message: dict) -> None:
      nonlocal status
      if message["type"] == "http.response.start": status = message["status"]
      await send(message)
    try: await self.app(scope, receive, send_status)
    finally: self.metrics.request(route, scope.get("state", {}).get("pyruntime_status", status))


class LimitRequestBody:
  """ASGI middleware: read each request's body before the app sees it, refusing one longer than
  `max_bytes` (413, by its Content-Length before reading anything, else as soon as the limit is passed)
  or slower than `timeout` seconds (408). Either answer closes the connection; a body up to DRAIN_FACTOR times the
  limit is read and dropped first (for at most DRAIN_S), so the client gets the 413 rather than a reset connection.
  The app then receives the body in one message, and the client's disconnect after it."""
  def __init__(self, app: Any, max_bytes: int, timeout: float):
    self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

  async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] != "http": return await self.app(scope, receive, send)
    declared = _content_length(scope)
    if declared is not None and declared > self.max_bytes:
      if declared <= DRAIN_FACTOR * self.max_bytes: await _drain(receive, DRAIN_FACTOR * self.max_bytes)
      return await _refuse(send, RequestTooLarge(self.max_bytes, declared))
    chunks: list[bytes] = []
    size = 0
    try:
      with anyio.fail_after(self.timeout):
        while True:
          message = await receive()
          if message["type"] != "http.request":   # the client left before sending it all: nothing to answer
            return await self.app(scope, _replay([message], receive), send)
          chunk = message.get("body", b"")
          size += len(chunk)
          if size > self.max_bytes:
            if message.get("more_body", False): await _drain(receive, DRAIN_FACTOR * self.max_bytes - size)
            return await _refuse(send, RequestTooLarge(self.max_bytes))
          chunks.append(chunk)
          if not message.get("more_body", False): break
    except TimeoutError: return await _refuse(send, RequestTimeout(self.timeout))
    body = b"".join(chunks)
    del chunks
    await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


# A body over the limit is read and dropped, up to this many times the limit, before the 413: closing a connection
# with unread data in it makes the kernel reset it, and the client would see "connection reset" instead of our answer.
DRAIN_FACTOR = 4
DRAIN_S = 1.0   # what is in flight arrives within this; a client that stops sending gets its 413 then


async def _drain(receive: Callable, limit: int) -> None:
  with anyio.move_on_after(DRAIN_S):
    while limit > 0:
      message = await receive()
      if message["type"] != "http.request": return
      limit -= len(message.get("body", b""))
      if not message.get("more_body", False): return


def _content_length(scope: dict) -> int | None:
  for name, value in scope.get("headers", ()):
    if name == b"content-length":
      try: return int(value)
      except ValueError: return None   # the HTTP layer refuses a malformed one before we get here
  return None


def _replay(messages: list[dict], receive: Callable) -> Callable[[], Awaitable[dict]]:
  async def replay() -> dict:
    return messages.pop(0) if messages else await receive()
  return replay


async def _refuse(send: Callable, e: BaseException) -> None:
  status, body = error_body(e)
  data = json.dumps(body).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), (b"connection", b"close")]})
  await send({"type": "http.response.body", "body": data, "more_body": False})


# --- running it ------------------------------------------------------------------------------------
def h11_protocol_with_head_timeout(timeout_request_head: float) -> type:
  """uvicorn's h11 protocol, closing a connection that does not deliver a complete request head within
  `timeout_request_head` seconds: counted from the connection's start for its first request, and from
  the first byte of each later one (the idle time between requests is uvicorn's keep-alive timeout).
  uvicorn bounds neither: a client sending half a head, or nothing, was held for ever."""
  import h11
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class H11ProtocolWithHeadTimeout(H11Protocol):
    head_timeout = timeout_request_head
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
      super().connection_made(transport)
      self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
      super().data_received(data)
      self._watch_head()

    def on_response_complete(self) -> None:
      super().on_response_complete()
      if self.conn.trailing_data[0]: self._watch_head()   # part of a pipelined head is already here

    def connection_lost(self, exc: Exception | None) -> None:
      self._cancel_head_timer()
      super().connection_lost(exc)

    def _watch_head(self) -> None:
      """Waiting for (the rest of) a head: make sure the timer runs; the head is in: stop it."""
      if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
        if self._head_timer is None: self._arm_head_timer()
      else: self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
      self._cancel_head_timer()
      self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
      if self._head_timer is not None: self._head_timer.cancel(); self._head_timer = None

    def send_400_response(self, msg: str) -> None:
      """uvicorn's own answer to a malformed head, with the security headers every other answer carries."""
      from pyruntime.serving.page import SECURITY_HEADERS
      event = h11.Response(status_code=400, reason=b"Bad Request",
                           headers=[(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close"), *SECURITY_HEADERS])
      for ev in (event, h11.Data(data=msg.encode("ascii", "replace")), h11.EndOfMessage()): self.transport.write(self.conn.send(ev))
      self.transport.close()

    def _head_timed_out(self) -> None:
      self._head_timer = None
      if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
        self.transport.close()

  return H11ProtocolWithHeadTimeout


def uvicorn_config(app: Any, *, host: str = "127.0.0.1", port: int = 8000, timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE,
                   timeout_request_head: float = TIMEOUT_REQUEST_HEAD, **kw: Any) -> Any:
  """The uvicorn Config pyruntime serves with: the h11 protocol with a request-head timeout, and
  uvicorn's keep-alive timeout (idle time between requests on one connection)."""
  import uvicorn
  for name, v in (("timeout_keep_alive", timeout_keep_alive), ("timeout_request_head", timeout_request_head)):
    if not (isinstance(v, (int, float)) and v > 0): raise errors.InvalidOption(name, f"must be > 0 seconds, got {v!r}")
  return uvicorn.Config(app, host=host, port=port, http=h11_protocol_with_head_timeout(timeout_request_head),
                        timeout_keep_alive=timeout_keep_alive, **kw)   # type: ignore[arg-type]  # a float works (call_later)


def listen_socket(host: str, port: int) -> socket.socket:
  """A bound socket on host:port (port 0: an ephemeral one), for uvicorn to listen on; AddressInUse naming them."""
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try: sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise errors.AddressInUse(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
  return sock


class BackgroundServer:
  """uvicorn serving `app` on a loopback port (0: an ephemeral one) in a thread; for tests and embedding.

      with BackgroundServer(create_app(lm)) as srv: requests.get(srv.url + "/health")
  """
  def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", *,
               timeout_keep_alive: float = TIMEOUT_KEEP_ALIVE, timeout_request_head: float = TIMEOUT_REQUEST_HEAD):
    import uvicorn
    self.sock = listen_socket(host, port)
    self.host, self.port = host, self.sock.getsockname()[1]
    self.server = uvicorn.Server(uvicorn_config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=3,
                                                timeout_keep_alive=timeout_keep_alive, timeout_request_head=timeout_request_head))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="uvicorn", daemon=True)

  @property
  def url(self) -> str: return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> "BackgroundServer":
    self.thread.start()
    deadline = time.monotonic() + timeout
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() > deadline: raise RuntimeError("uvicorn did not start")
      time.sleep(0.01)
    return self

  def stop(self, timeout: float = 15.0) -> None:
    self.server.should_exit = True
    self.thread.join(timeout)
    self.sock.close()

  def __enter__(self) -> "BackgroundServer": return self.start()
  def __exit__(self, *exc: Any) -> None: self.stop()


def draining_server(config: Any, state: ServerState, grace_s: float) -> Any:
  """A uvicorn.Server whose first SIGTERM (or Ctrl-C) drains instead of closing the listener at once: new requests get
  503 while the running ones get up to `grace_s` seconds to finish; those still running then end with an SSE error
  event and [DONE] (a JSON error when not streaming); then uvicorn shuts down as usual. A second signal is uvicorn's
  own: exit now."""
  import uvicorn

  class DrainingServer(uvicorn.Server):
    drain_thread: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
      if self.drain_thread is not None or self.should_exit: return super().handle_exit(sig, frame)
      _log(f"signal {sig}: draining: no new requests; {len(state.jobs)} running get up to {grace_s:g} s to finish")
      self.drain_thread = threading.Thread(target=self._drain, name="drain", daemon=True)
      self.drain_thread.start()

    def _drain(self) -> None:
      try:
        if (ended := state.drain(grace_s)): _log(f"ended {ended} request(s) still running after {grace_s:g} s")
      finally:
        self.should_exit = True

  return DrainingServer(config)


def serve(args: Any, make_launcher: Callable[[], Any]) -> int:
  """`pyruntime serve`: load the stages (in this, the main thread: their parent-death signal follows the
  spawning thread), then run uvicorn here until SIGTERM / Ctrl-C (which drain first), then stop every stage.
  `make_launcher` builds an unstarted Launcher from the command line (cli.py), the first one and every restart's:
  a pipeline whose stage dies is rebuilt by the server's supervisor thread (see create_app's `restart`)."""
  queue_size = getattr(args, "queue_size", 16)
  if queue_size < 0: raise errors.InvalidOption("queue_size", f"must be >= 0, got {queue_size}")
  max_body = getattr(args, "max_body_bytes", MAX_BODY_BYTES)
  t_head, t_body = getattr(args, "timeout_request_head", TIMEOUT_REQUEST_HEAD), getattr(args, "timeout_request_body", TIMEOUT_REQUEST_BODY)
  t_keep_alive = getattr(args, "timeout_keep_alive", TIMEOUT_KEEP_ALIVE)
  grace = getattr(args, "shutdown_grace", SHUTDOWN_GRACE_S)
  attempts = getattr(args, "restart_attempts", RESTART_ATTEMPTS)
  if max_body < 0: raise errors.InvalidOption("max_body_bytes", f"must be >= 0, got {max_body}")
  for name, v in (("timeout_request_head", t_head), ("timeout_request_body", t_body), ("timeout_keep_alive", t_keep_alive)):
    if not v > 0: raise errors.InvalidOption(name, f"must be > 0 seconds, got {v}")
  if not grace >= 0: raise errors.InvalidOption("shutdown_grace", f"must be >= 0 seconds, got {grace}")
  if attempts < 0: raise errors.InvalidOption("restart_attempts", f"must be >= 0, got {attempts}")
  sock = listen_socket(args.host, args.port)  # before loading: a port in use is one line, not half a minute of warm-up
  lm = make_launcher()
  try: lm.start()
  except BaseException:
    sock.close()
    raise
  state: ServerState | None = None
  try:
    app = create_app(lm, queue_size=queue_size, max_body_bytes=max_body, timeout_request_body=t_body,
                     restart=make_launcher if attempts > 0 else None, restart_attempts=max(1, attempts),
                     api_key=getattr(args, "api_key", None), allowed_hosts=page.allowed_hosts(args.host, getattr(args, "allowed_host", None)))
    state = app.state.pyruntime
    if args.host not in ("127.0.0.1", "localhost", "::1") and not getattr(args, "api_key", None):
      sys.stderr.write(f"pyruntime: serving on {args.host}, beyond this host, without --api-key: there is no authentication\n")
    sys.stderr.write(f"pyruntime: {lm.model_name} (model id {state.model_id!r}) on {len(lm.split)} stages "
                     f"{json.dumps([list(r) for r in lm.split])}, context {lm.context_length}: http://{args.host}:{args.port}/v1, the page at "
                     f"http://{args.host}:{args.port}/\n")
    sys.stderr.flush()
    config = uvicorn_config(app, host=args.host, port=args.port, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=t_keep_alive, timeout_request_head=t_head)
    draining_server(config, state, grace).run(sockets=[sock])
  finally:
    if state is not None: state.close()
    lm.close()
    sock.close()
  return 0
