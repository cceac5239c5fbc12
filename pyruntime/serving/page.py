"""The page `pyruntime serve` shows at `/` (docs/page.md), and the guard in front of the page and the API.

The page is three static files shipped in the package (pyruntime/web: no CDN, no build step); it talks to the
server's own routes only (/v1/chat/completions, /stats), which a Content-Security-Policy of `default-src 'self'`
enforces in the browser. The guard refuses what a browser can be made to send from elsewhere: a request whose Host
is not this server's (DNS rebinding: a foreign name resolving to 127.0.0.1) and one whose Origin is not the page's
own (a cross-site request); with an API key, the API, /stats and /metrics need `Authorization: Bearer KEY` (OpenAI's
clients send it), while the page's static shell (which holds no data) and /health stay open.
"""
from __future__ import annotations

import hmac
import json
import pathlib
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

WEB = pathlib.Path(__file__).parent / "web"
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/page.js": ("page.js", "text/javascript; charset=utf-8"),
         "/page.css": ("page.css", "text/css; charset=utf-8")}
CSP = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
SECURITY_HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer")]
OPEN_PATHS = frozenset({*FILES, "/health"})  # no key needed: the page's shell and the load balancer's probe
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def routes() -> list[Route]:
  def serve_file(name: str, media: str) -> Any:
    async def endpoint(request: Request) -> Response:
      return Response((WEB / name).read_bytes(), media_type=media, headers={"cache-control": "no-cache"})
    return endpoint
  return [Route(path, serve_file(name, media), methods=["GET"]) for path, (name, media) in FILES.items()]


def allowed_hosts(bind_host: str, extra: list[str] | None = None) -> frozenset[str] | None:
  """The Host names this server answers to: loopback names and the address it is bound to, and `extra`; None (no
  check) when it listens on every address and no names were given (it cannot know its public names)."""
  extra = [h.lower() for h in extra or []]
  if bind_host in ("0.0.0.0", "::", "") and not extra: return None
  return frozenset({*LOOPBACK, bind_host.lower(), *extra})


def _host_name(host: str) -> str:
  """The name part of a Host header, lowercased; the whole value when what follows the name is not a port (so
  `[::1]evil.example` or `localhost:x` is no allowed name)."""
  host = host.strip().lower()
  if host.startswith("["):
    if (end := host.find("]")) < 0: return host
    name, rest = host[:end + 1], host[end + 1:]
  elif host.count(":") == 1: name, rest = host.split(":")[0], host[host.index(":"):]
  else: name, rest = host, ""
  return name if not rest or (rest[0] == ":" and rest[1:].isdigit()) else host


class Guard:
  """ASGI middleware: Host and Origin checks, the API key, and the security headers on every response."""

  def __init__(self, app: Any, api_key: str | None = None, hosts: frozenset[str] | None = None):
    self.app, self.api_key, self.hosts = app, api_key, hosts

  async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http": return await self.app(scope, receive, send)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    host = headers.get("host", "")
    refusal = None
    if self.hosts is not None and _host_name(host) not in self.hosts:
      refusal = (403, "host_not_allowed", f"this server does not answer to the host {host[:100]!r} (pyruntime serve --allowed-host)")
    elif (origin := headers.get("origin")) is not None and origin != f"{scope.get('scheme', 'http')}://{host}":
      refusal = (403, "cross_origin_refused", f"a request from the origin {origin[:100]!r} is refused: only this server's own page may call it")
    elif self.api_key is not None and scope.get("path") not in OPEN_PATHS and not self._key_ok(headers.get("authorization", "")):
      refusal = (401, "invalid_api_key", "this server needs an API key: send 'Authorization: Bearer KEY'")
    if refusal is not None: return await self._refuse(send, *refusal)

    async def with_headers(message: dict) -> None:
      if message["type"] == "http.response.start": message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
      await send(message)
    await self.app(scope, receive, with_headers)

  def _key_ok(self, authorization: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    # headers arrive decoded as latin-1: their bytes back, against the key's UTF-8 bytes (a non-ASCII key can match)
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key.encode())

  @staticmethod
  async def _refuse(send: Any, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}).encode()
    extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra, *SECURITY_HEADERS]})
    await send({"type": "http.response.body", "body": body})
