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
limit), then swaps it in; meanwhile /health says `recovering` and requests get 503 + Retry-After
(the server's state and its phases: state.py). Draining (`httpd.draining_server`, what `serve`
runs): SIGTERM stops admission (503), waits up to a grace period for running requests, ends the
rest with an SSE error event and [DONE], then lets uvicorn exit. The HTTP plumbing under the
routes (limits, timeouts, uvicorn) is httpd.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyruntime import errors
from pyruntime.engine.events import Delta, Done
from pyruntime.options import MAX_BODY_BYTES, RESTART_ATTEMPTS, TIMEOUT_REQUEST_BODY, ServeOptions
from pyruntime.serving import openai_api as api
from pyruntime.serving import page, responses_api
from pyruntime.serving.httpd import (
  CLIENT_CLOSED,
  CountRequests,
  JSONBody,
  LimitRequestBody,
  draining_server,
  listen_socket,
  run_until_disconnect,
  uvicorn_config,
)
from pyruntime.serving.metrics import CONTENT_TYPE
from pyruntime.serving.openai_api import (
  CHAT,
  COMPLETION,
  MalformedRequest,
  ModelNotFound,
  QueueFull,
  ServerRecovering,
  ServiceUnavailable,
  error_body,
  parse_json,
  parse_request,
  sse,
)
from pyruntime.serving.responses_api import RESPONSES
from pyruntime.serving.state import RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S, Job, LauncherLike, ServerState


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
      try: await self.events(chunk, lambda: closed)
      except Exception as e:  # noqa: BLE001 - a chunk that cannot be built: the stream ends with an error event, never a cut
        self.job.cancel()
        for c in self.shaper.error_chunks(e): await chunk(sse(c))
        await chunk(self.shaper.done_marker)
      await out({"type": "http.response.body", "body": b"", "more_body": False})
      finished = not closed

    # The server answers receive() with http.disconnect as soon as the last body message is sent, so a
    # disconnect seen after a complete response is the response's own end, not the client leaving.
    try: gone = (await run_until_disconnect(receive, body) or closed) and not finished
    finally: self.job.cancel()
    if gone: scope.setdefault("state", {})["pyruntime_status"] = CLIENT_CLOSED

  async def events(self, chunk: Callable[[bytes], Awaitable[None]], closed: Callable[[], bool]) -> None:
    """The job's events as chunks, until its end, its error or the client's leaving."""
    for c in self.shaper.first_chunks(self.job.choices): await chunk(sse(c))
    dones: dict[int, Done] = {}
    while not closed():
      kind, index, ev = await self.job.events.get()
      if kind in ("error", "abort"):
        for c in self.shaper.error_chunks(ev): await chunk(sse(c))
        if kind == "abort": await chunk(self.shaper.done_marker)   # the server ended it: a clean end of the stream, not a cut
        return
      if isinstance(ev, Delta):
        for c in self.shaper.delta_chunks(index, ev): await chunk(sse(c))
      elif isinstance(ev, Done):
        dones[index] = ev
        for c in self.shaper.final_chunks(index, ev): await chunk(sse(c))
        if len(dones) == self.job.choices:
          if self.shaper.include_usage: await chunk(sse(self.shaper.usage_chunk([dones[i] for i in range(len(dones))])))
          await chunk(self.shaper.done_marker)
          return


def _error(e: BaseException, kind: str | None = None, headers: dict[str, str] | None = None) -> JSONBody:
  status, body = error_body(e, kind)
  return JSONBody(body, status_code=status, headers=headers)


def _unavailable(e: ServiceUnavailable, kind: str | None = None) -> JSONBody:
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
  try: state.admission.check(req.choices)
  except errors.InvalidOption as e: return _error(e, kind)
  job = Job(asyncio.get_running_loop(), state.admission, launcher, req.choices)
  if not state.admission.try_acquire(req.choices): return _error(QueueFull(state.admission.queue_size), kind, headers={"retry-after": "1"})
  state.add_job(job)
  if (refused := await _submit(state, launcher, job, req, kind)) is not None: return refused
  tokenizer = getattr(launcher, "tokenizer", None)
  if kind == RESPONSES: shaper = responses_api.ResponsesShaper(req, body, state.model_id, tokenizer)
  else: shaper = api.shaper_for(req, state.model_id, launcher.recipe, tokenizer)
  if req.stream: return SSEResponse(state, job, shaper, kind)
  return await _collect(request, job, shaper, kind)


async def _submit(state: ServerState, launcher: LauncherLike, job: Job, req: Any, kind: str) -> JSONBody | None:
  """Start the job's stream on the launcher; the error answer if it cannot start. Validation, tokenisation and the
  context check run off the event loop: one request never stalls the others."""
  try:
    await run_in_threadpool(_submit_streams, launcher, job, req)
    return None
  except Exception as e:  # noqa: BLE001
    job.cancel()
    if kind == RESPONSES and isinstance(e, (errors.InvalidOption, errors.UnsupportedFeature)): e = responses_api.own_names(e, req.origins)
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
  return JSONBody(shaper.response([dones[i] for i in range(job.choices)]))


def _health(state: ServerState) -> JSONBody:
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
  return JSONBody(body, status_code=200 if phase == "ok" else 503, headers=headers)


async def _http_error(request: Request, exc: Exception) -> JSONBody:
  assert isinstance(exc, HTTPException)
  code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
  message = f"Unknown request URL: {request.method} {request.url.path}" if exc.status_code == 404 else \
            f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else str(exc.detail)
  return JSONBody({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                      status_code=exc.status_code, headers=exc.headers)


def create_app(launcher: Any, *, queue_size: int = ServeOptions.queue_size, max_body_bytes: int = MAX_BODY_BYTES,
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

  async def models(request: Request) -> JSONBody:
    return JSONBody(api.models_list(state.model_id, state.created, state.launcher.context_length))

  async def model(request: Request) -> JSONBody:
    try: state.check_model(request.path_params["model"])
    except ModelNotFound as e: return _error(e)
    return JSONBody(api.model_card(state.model_id, state.created, state.launcher.context_length))

  async def health(request: Request) -> JSONBody: return _health(state)

  async def metrics(request: Request) -> Response:
    # off the event loop: a mixture-of-experts model's expert load is a round trip to each stage
    return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE)

  async def profile(request: Request) -> JSONBody:
    """Each stage's latest ProfileReport (PYRUNTIME_PROFILE; docs/stats.md), [] when the stages do not profile."""
    reports = getattr(state.launcher, "profile_reports", None)
    return JSONBody({"profiles": list(reports()) if reports is not None else []})

  async def stats(request: Request) -> JSONBody:
    """The pipeline's view and its history (docs/stats.md); `?history=0` for the latest view alone."""
    return JSONBody(state.sampler.stats(history=request.query_params.get("history", "1") not in ("0", "false")))

  async def internal_error(request: Request, exc: Exception) -> JSONBody:
    return _error(exc)

  async def tokenizer_route(request: Request) -> JSONBody:
    """/tokenize, /detokenize (vLLM's), /tokenizer_info: off the event loop, a long text holds the interpreter a while."""
    lm, path = state.launcher, request.url.path
    try:
      if path == "/tokenizer_info": return JSONBody(api.tokenizer_info(lm.tokenizer, lm.context_length))
      body = parse_json(await request.body())
      state.check_model(api.model_of(body))
      if path == "/tokenize": return JSONBody(await run_in_threadpool(api.tokenize, body, lm))
      return JSONBody(await run_in_threadpool(api.detokenize, body, lm.tokenizer))
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


def serve(o: ServeOptions, make_launcher: Callable[[], Any]) -> int:
  """`pyruntime serve`: load the stages (in this, the main thread: their parent-death signal follows the
  spawning thread), then run uvicorn here until SIGTERM / Ctrl-C (which drain first), then stop every stage.
  `make_launcher` builds an unstarted Launcher from the command line (cli.py), the first one and every restart's:
  a pipeline whose stage dies is rebuilt by the server's supervisor thread (see create_app's `restart`). `o` was
  checked when it was made (ServeOptions)."""
  sock = listen_socket(o.host, o.port)  # before loading: a port in use is one line, not half a minute of warm-up
  lm = make_launcher()
  try: lm.start()
  except BaseException:
    sock.close()
    raise
  state: ServerState | None = None
  try:
    app = create_app(lm, queue_size=o.queue_size, max_body_bytes=o.max_body_bytes, timeout_request_body=o.timeout_request_body,
                     restart=make_launcher if o.restart_attempts > 0 else None, restart_attempts=max(1, o.restart_attempts),
                     api_key=o.api_key, allowed_hosts=page.allowed_hosts(o.host, list(o.allowed_host)))
    state = app.state.pyruntime
    if o.host not in ("127.0.0.1", "localhost", "::1") and not o.api_key:
      sys.stderr.write(f"pyruntime: serving on {o.host}, beyond this host, without --api-key: there is no authentication\n")
    sys.stderr.write(f"pyruntime: {lm.model_name} (model id {state.model_id!r}) on {len(lm.split)} stages "
                     f"{json.dumps([list(r) for r in lm.split])}, context {lm.context_length}: http://{o.host}:{o.port}/v1, the page at "
                     f"http://{o.host}:{o.port}/\n")
    sys.stderr.flush()
    config = uvicorn_config(app, host=o.host, port=o.port, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=o.timeout_keep_alive, timeout_request_head=o.timeout_request_head)
    draining_server(config, state, o.shutdown_grace).run(sockets=[sock])
  finally:
    if state is not None: state.close()
    lm.close()
    sock.close()
  return 0
