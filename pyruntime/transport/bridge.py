"""A ring continued on another host: MO01 records carried unchanged over TCP (docs/hosts.md).

Where two neighbouring stages run on different hosts, the upstream host's ring has a `BridgeSender` as its reader and
the downstream host's ring a `BridgeReceiver` as its writer; each stage still sees a plain ring. Frames on the wire:

    u32 length, little-endian, then `length` bytes:
      0            a heartbeat: the sender is alive and its ring is empty
      0xFFFFFFFF   the end: the ring was closed in order upstream; the receiver closes its side in turn
      40 + extent  one MO01 record, header and payload exactly as they were in the upstream ring

A receiver judges every record as a ring's consumer does (magic, header, extent within the ring's max_extent and
alignment, the next sequence) and hears from its sender at least every HEARTBEAT_S; silence for LOST_S, a closed
connection without the end frame, or a bad frame ends the bridge with a named error (`on_end`). Before any record,
the connecting side proves it holds the pipeline's secret (HMAC-SHA256 over the listener's nonce and its hello, so
the secret never crosses the wire) and both sides' hellos (package version, ring ABI, model identity, which link)
must agree. A peer that fails that is turned away by name and the listener waits for the right one.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Callable

from pyruntime import errors
from pyruntime.transport.ring import HEADER_LEN, Reader, Writer, check_header, encode_header, record_size

HEARTBEAT_S = 0.25      # a sender with nothing to send says it is alive this often
LOST_S = 2.0            # a receiver that hears nothing for this long declares its peer lost (well inside the 5 s bound)
HANDSHAKE_S = 5.0       # a peer gets this long, in all, to prove itself
MAX_PENDING = 16        # handshakes under way at once on a listener; one more turns the oldest away
MAX_REFUSED = 100       # refusals a receiver remembers (stats); each is logged once
BATCH = 64              # records a sender takes from its ring per send
MAGIC = b"PYRTBRG1"     # the listener's greeting, then a 16-byte nonce
HEARTBEAT, END = 0, 0xFFFFFFFF
_U32 = struct.Struct("<I")
MAX_HELLO = 1 << 16
log = logging.getLogger("pyruntime.bridge")


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
  buf = bytearray(n)
  _recv_into(sock, memoryview(buf), deadline)
  return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
  """Fill `view`; with a `deadline` (monotonic) the whole read must end by then, however the peer trickles its bytes."""
  got = 0
  while got < len(view):
    if deadline is not None:
      if (left := deadline - time.monotonic()) <= 0: raise TimeoutError("the peer did not finish its handshake in time")
      sock.settimeout(left)
    k = sock.recv_into(view[got:])
    if k == 0: raise ConnectionResetError("the peer closed the connection")
    got += k


def _send_parts(sock: socket.socket, parts: list) -> None:
  """sendmsg until every byte of `parts` is out (it may send fewer)."""
  parts = [memoryview(p).cast("B") for p in parts]
  while parts:
    sent = sock.sendmsg(parts[:512])  # IOV_MAX is 1024 on Linux
    while sent and sent >= len(parts[0]):
      sent -= len(parts[0])
      parts.pop(0)
    if sent: parts[0] = parts[0][sent:]


def _send_json(sock: socket.socket, obj: dict) -> None:
  body = json.dumps(obj).encode()
  sock.sendall(_U32.pack(len(body)) + body)


def _recv_json(sock: socket.socket) -> dict:
  (n,) = _U32.unpack(_recv_exact(sock, 4))
  if n > MAX_HELLO: raise errors.BridgeFrameInvalid(f"a handshake message of {n} bytes (at most {MAX_HELLO})")
  try: obj = json.loads(_recv_exact(sock, n))
  except ValueError as e: raise errors.BridgeFrameInvalid(f"a handshake message that is not JSON: {e}") from None
  if not isinstance(obj, dict): raise errors.BridgeFrameInvalid("a handshake message that is not a JSON object")
  return obj


def _mac(secret: bytes, nonce: bytes, hello: bytes) -> bytes:
  return hmac.new(secret, nonce + hello, hashlib.sha256).digest()


def mismatch(ours: dict, theirs: dict) -> str:
  """What two hellos disagree on, in words ("" when they agree): every key either side names."""
  keys = sorted(set(ours) | set(theirs))
  return "; ".join(f"{k}: ours {ours.get(k)!r}, the peer's {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k))


def connect(address: tuple[str, int], secret: bytes, hello: dict, timeout: float = HANDSHAKE_S) -> socket.socket:
  """Open a bridge to a listener: prove the secret, compare hellos. BridgeRefused names why it was turned away."""
  sock = socket.create_connection(address, timeout=timeout)
  try:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a decode step's record is small and waited for
    greeting = _recv_exact(sock, len(MAGIC) + 16)
    if greeting[:len(MAGIC)] != MAGIC: raise errors.BridgeRefused(f"{address} is not a pyruntime bridge (greeting {greeting[:8]!r})")
    body = json.dumps(hello, sort_keys=True).encode()
    sock.sendall(_U32.pack(len(body)) + body + _mac(secret, greeting[len(MAGIC):], body))
    answer = _recv_json(sock)
    if not answer.get("ok"): raise errors.BridgeRefused(f"{answer.get('error')}: {answer.get('message')}")
    sock.settimeout(None)
    return sock
  except BaseException:
    sock.close()
    raise


def accept(sock: socket.socket, secret: bytes, hello: dict, timeout: float | None = None) -> dict:
  """The listener's half of the handshake on a new connection, done within `timeout` seconds in all (TimeoutError
  after); returns the peer's hello. BridgeAuthFailed (no secret), BridgeMismatch (another version, ABI, model or link)
  or BridgeFrameInvalid (not the protocol); the peer is told why."""
  timeout = HANDSHAKE_S if timeout is None else timeout
  deadline = time.monotonic() + timeout
  sock.settimeout(timeout)
  nonce = os.urandom(16)
  sock.sendall(MAGIC + nonce)
  (n,) = _U32.unpack(_recv_exact(sock, 4, deadline))
  if n > MAX_HELLO: raise errors.BridgeFrameInvalid(f"a hello of {n} bytes (at most {MAX_HELLO})")
  body, mac = _recv_exact(sock, n, deadline), _recv_exact(sock, 32, deadline)
  if not hmac.compare_digest(mac, _mac(secret, nonce, body)):
    _send_json(sock, {"ok": False, "error": "BridgeAuthFailed", "message": "the peer does not hold this pipeline's secret"})
    raise errors.BridgeAuthFailed("a peer without this pipeline's secret was turned away")
  try: theirs = json.loads(body)
  except ValueError: theirs = None
  if not isinstance(theirs, dict): raise errors.BridgeFrameInvalid("a hello that is not a JSON object")
  if why := mismatch(hello, theirs):
    _send_json(sock, {"ok": False, "error": "BridgeMismatch", "message": why})
    raise errors.BridgeMismatch(why)
  _send_json(sock, {"ok": True})
  sock.settimeout(None)
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return theirs


class BridgeReceiver:
  """The downstream end of a bridge: listens on `bind` (the node's own address, a port the kernel picks), takes the one
  peer that passes the handshake, and writes its records into `writer`. `on_end(error)` is called once when the bridge
  ends (None: the upstream ring was closed in order); the writer is closed then, so the stage reading it drains and stops."""

  def __init__(self, writer: Writer, secret: bytes, hello: dict, bind: str = "127.0.0.1",
               on_end: Callable[[errors.PyruntimeError | None], None] | None = None, name: str = "bridge"):
    self.writer, self.secret, self.hello, self.on_end, self.name = writer, secret, hello, on_end, name
    self.listener = socket.create_server((bind, 0))
    self.listener.settimeout(HEARTBEAT_S)
    self.address: tuple[str, int] = self.listener.getsockname()[:2]
    self.refused: list[str] = []     # named errors of the peers turned away
    self.records = self.bytes = 0
    self.error: errors.PyruntimeError | None = None
    self.ended = threading.Event()
    self._conn: socket.socket | None = None
    self._stop = False
    self.thread = threading.Thread(target=self._run, name=f"{name}-receiver", daemon=True)
    self.thread.start()

  def _run(self) -> None:
    error: errors.PyruntimeError | None = None
    try:
      self._conn = self._accept()
      if self._conn is not None: self._pump(self._conn)
    except errors.PyruntimeError as e: error = e
    except (OSError, struct.error) as e:
      error = errors.BridgeLost(f"{self.name}: the sender went away ({type(e).__name__}: {e})")
    finally:
      self._finish(error)

  def _accept(self) -> socket.socket | None:
    """The one peer that proves itself. Connections are taken as they come and each shakes hands in a thread of its
    own against a total deadline (HANDSHAKE_S), at most MAX_PENDING at once (one more turns the oldest away): silent,
    slow and wrong peers cannot delay the right one. The first to pass wins; the listener closes then."""
    lock, won = threading.Lock(), threading.Event()
    pending: dict[socket.socket, Any] = {}   # connection -> its address, oldest first
    hung: dict[socket.socket, str] = {}      # connections we ended -> why
    winner: list[socket.socket] = []

    def handshake(conn: socket.socket, addr: Any) -> None:
      try: accept(conn, self.secret, self.hello)
      except (errors.PyruntimeError, OSError, struct.error) as e:
        with lock:
          pending.pop(conn, None)
          why = hung.pop(conn, None)
        self._refuse(addr, why or (f"BridgeHandshakeTimeout: no whole handshake within {HANDSHAKE_S:g} s" if isinstance(e, TimeoutError)
                                   else f"{getattr(e, 'code', type(e).__name__)}: {e}"))
        conn.close()
        return
      with lock:
        pending.pop(conn, None)
        if winner or self._stop:
          conn.close()
          return
        winner.append(conn)
      won.set()
      try: self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept below: one peer per bridge
      except OSError: pass

    while not self._stop and not won.is_set():
      try: conn, addr = self.listener.accept()
      except TimeoutError: continue
      except OSError:
        if self._stop or won.is_set(): break
        raise
      with lock:
        if len(pending) >= MAX_PENDING:  # the oldest has had the most time: it goes
          oldest = next(iter(pending))
          del pending[oldest]
          hung[oldest] = "BridgeBusy: more handshakes under way than a listener takes; the oldest was turned away"
          _hang_up(oldest)
        pending[conn] = addr
      threading.Thread(target=handshake, args=(conn, addr), name=f"{self.name}-handshake", daemon=True).start()
    self.listener.close()
    with lock:
      for conn in pending:
        hung[conn] = "BridgeTaken: the bridge has its peer" if winner else "BridgeClosed: the bridge closed"
        _hang_up(conn)
      pending.clear()
    return winner[0] if winner else None

  def _refuse(self, addr: Any, why: str) -> None:
    log.warning("%s: turned away %s: %s", self.name, addr, why)
    if len(self.refused) < MAX_REFUSED: self.refused.append(why)

  def _pump(self, conn: socket.socket) -> None:
    conn.settimeout(LOST_S)
    spec, w = self.writer.spec, self.writer
    seq = 0
    head = bytearray(4 + HEADER_LEN)
    try:
      while True:
        _recv_into(conn, memoryview(head)[:4])
        (n,) = _U32.unpack_from(head)
        if n == HEARTBEAT: continue
        if n == END: return
        if n < HEADER_LEN or n - HEADER_LEN > spec.max_extent:
          raise errors.BridgeFrameInvalid(f"{self.name}: a frame of {n} bytes (a record is 40 header bytes and at most "
                                          f"{spec.max_extent} payload bytes)")
        _recv_into(conn, memoryview(head)[4:])
        try: oid, _, extent, flags = check_header(memoryview(head)[4:], record_size(n - HEADER_LEN), spec.max_extent, spec.alignment, seq)
        except errors.RecordError as e: raise errors.BridgeFrameInvalid(f"{self.name}: {e}") from None
        if extent != n - HEADER_LEN:
          raise errors.BridgeFrameInvalid(f"{self.name}: a frame of {n} bytes holds a record of {extent} payload bytes")
        _recv_into(conn, self._reserve(extent))
        w.commit(oid, flags)
        seq += 1
        self.records, self.bytes = self.records + 1, self.bytes + n
    except TimeoutError:
      raise errors.BridgeLost(f"{self.name}: nothing heard from the sender for {LOST_S:g} s") from None
    except (ConnectionError, OSError) as e:
      if self._stop: return
      raise errors.BridgeLost(f"{self.name}: the sender's connection ended without the end frame ({e})") from None

  def _reserve(self, extent: int) -> memoryview:
    while True:
      try: return self.writer.reserve(extent, timeout=HEARTBEAT_S)
      except errors.RingTimeout:
        if self._stop: raise errors.BridgeLost(f"{self.name}: closed while waiting for ring space") from None

  def _finish(self, error: errors.PyruntimeError | None) -> None:
    self.error = None if self._stop else error
    # told first: the stage reading the ring learns of the close at once, and whoever it tells asks why
    if self.on_end is not None and not self._stop: self.on_end(self.error)
    for f in (self.writer.close, self.listener.close, *((self._conn.close,) if self._conn else ())):
      try: f()
      except (OSError, errors.PyruntimeError): pass
    self.ended.set()

  def close(self) -> None:
    """Stop listening and receiving (the pipeline is shutting down): no `on_end`."""
    self._stop = True
    for s in (self.listener, self._conn):
      if s is not None:
        try: s.shutdown(socket.SHUT_RDWR)
        except OSError: pass
        try: s.close()
        except OSError: pass
    self.thread.join(2 * HEARTBEAT_S + 1)

  def stats(self) -> dict:
    return {"records": self.records, "bytes": self.bytes, "refused": list(self.refused), "address": list(self.address),
            "ended": self.ended.is_set(), "error": None if self.error is None else f"{self.error.code}: {self.error}"}


class BridgeSender:
  """The upstream end: takes every record of `reader`'s ring and sends it to a receiver at `address`, a heartbeat when
  the ring is quiet, the end frame when the ring is closed in order. A dead upstream process (PeerDead) or a lost
  receiver ends it without the end frame, so the receiver reports the loss."""

  def __init__(self, reader: Reader, address: tuple[str, int], secret: bytes, hello: dict,
               on_end: Callable[[errors.PyruntimeError | None], None] | None = None, name: str = "bridge"):
    self.reader, self.on_end, self.name = reader, on_end, name
    self.sock = connect(tuple(address), secret, hello)  # type: ignore[arg-type]
    self.records = self.bytes = 0
    self.error: errors.PyruntimeError | None = None
    self._stop = False
    self.ended = threading.Event()
    self.thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
    self.thread.start()

  def _run(self) -> None:
    error: errors.PyruntimeError | None = None
    try: self._pump()
    except errors.RingClosed: self._send_end()
    except errors.PeerDead as e: error = e  # the stage writing the ring died: its own exit says so, not a lost peer
    except OSError as e:
      if not self._stop: error = errors.BridgeLost(f"{self.name}: the receiver went away ({type(e).__name__}: {e})")
    finally:
      self.error = error
      if self.on_end is not None and not self._stop: self.on_end(error)
      try: self.sock.close()
      except OSError: pass
      try: self.reader.close()
      except errors.PyruntimeError: pass
      self.ended.set()

  def _pump(self) -> None:
    beat = _U32.pack(HEARTBEAT)
    r, sock = self.reader, self.sock
    while not self._stop:
      try: batch = r.read_many(BATCH, timeout=HEARTBEAT_S)
      except errors.RingTimeout:
        sock.sendall(beat)
        continue
      parts, n = [], 0
      for i in range(len(batch)):
        extent = int(batch.extent[i])
        parts.append(_U32.pack(HEADER_LEN + extent) + encode_header(int(batch.object_id[i]), int(batch.sequence[i]), extent, int(batch.flags[i])))
        if extent: parts.append(batch.payload(i))
        n += HEADER_LEN + extent
      _send_parts(sock, parts)
      r.release()
      self.records, self.bytes = self.records + len(batch), self.bytes + n

  def _send_end(self) -> None:
    try: self.sock.sendall(_U32.pack(END))
    except OSError: pass

  def close(self) -> None:
    self._stop = True
    try: self.sock.shutdown(socket.SHUT_RDWR)
    except OSError: pass
    self.thread.join(2 * HEARTBEAT_S + 1)

  def stats(self) -> dict:
    return {"records": self.records, "bytes": self.bytes, "ended": self.ended.is_set(),
            "error": None if self.error is None else f"{self.error.code}: {self.error}"}


def _hang_up(conn: socket.socket) -> None:
  """End a connection another thread may be reading: shutdown wakes its recv, which close alone would not."""
  try: conn.shutdown(socket.SHUT_RDWR)
  except OSError: pass


def link_hello(version: str, abi: int, model: str, link: str) -> dict[str, Any]:
  """What both ends of a bridge must agree on before any record flows."""
  return {"version": version, "abi": abi, "model": model, "link": link}
