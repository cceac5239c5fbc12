"""The HTTP plumbing under the server's routes: ASGI middleware (each request counted by route and final status; a
body's size and time limits, answered with 413 and 408 before a route reads it), uvicorn's configuration (with the
request-head timeout its h11 protocol lacks), the listening socket (a port in use named before anything loads), and
running uvicorn in a thread (`BackgroundServer`: tests and embedding) or draining on SIGTERM (`draining_server`).
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Awaitable, Callable

import anyio
from starlette.responses import JSONResponse

from pyruntime import errors
from pyruntime.options import TIMEOUT_KEEP_ALIVE, TIMEOUT_REQUEST_HEAD
from pyruntime.serving.metrics import Metrics
from pyruntime.serving.openai_api import (
  RequestTimeout,
  RequestTooLarge,
  error_body,
  render_json,
)
from pyruntime.serving.state import ServerState, announce

CLIENT_CLOSED = 499   # nginx's status for "the client closed the request"; only ever seen in /metrics


class JSONBody(JSONResponse):
  """Every JSON answer of the server, rendered by openai_api.render_json (a client's lone surrogate comes back as its
  escape, never a 500)."""
  def render(self, content: Any) -> bytes: return render_json(content).encode()



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
  data = render_json(body).encode()
  await send({"type": "http.response.start", "status": status,
              "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), (b"connection", b"close")]})
  await send({"type": "http.response.body", "body": data, "more_body": False})


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
      announce(f"signal {sig}: draining: no new requests; {len(state.jobs)} running get up to {grace_s:g} s to finish")
      self.drain_thread = threading.Thread(target=self._drain, name="drain", daemon=True)
      self.drain_thread.start()

    def _drain(self) -> None:
      try:
        if (ended := state.drain(grace_s)): announce(f"ended {ended} request(s) still running after {grace_s:g} s")
      finally:
        self.should_exit = True

  return DrainingServer(config)
