"""The bridge (pyruntime/transport/bridge.py): a ring continued over TCP. In one process, on loopback: records cross unchanged,
the end closes the far ring, heartbeats keep a quiet bridge up, and a peer without the secret, of another version, or
sending garbage, truncated frames, absurd lengths or silence is named and never takes the process down."""
from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from pyruntime import errors
from pyruntime.transport import bridge
from pyruntime.transport.bridge import BridgeReceiver, BridgeSender, accept, connect, link_hello
from pyruntime.transport.ring import Arena, RingSpec, encode_header

SECRET = os.urandom(32)
HELLO = link_hello("1.0", 4, "model-abc", "ring 1 (stage 0 to stage 1)")


OPENED: list[BridgeReceiver | BridgeSender] = []  # every bridge end a test opens (receiver(), sender())


@pytest.fixture
def rings():
  with Arena.create([RingSpec(1 << 16, 4096, 4), RingSpec(1 << 16, 4096, 4)]) as a:
    yield a
    # a test that failed midway still stops its bridges' threads before the arena they read and write is unmapped
    # (a thread left in a read of an unmapped ring takes the whole worker down)
    while OPENED: OPENED.pop().close()


def receiver(*args, **kw) -> BridgeReceiver:
  OPENED.append(rx := BridgeReceiver(*args, **kw))
  return rx


def sender(*args, **kw) -> BridgeSender:
  OPENED.append(tx := BridgeSender(*args, **kw))
  return tx


def ended(rx: BridgeReceiver) -> errors.PyruntimeError | None:
  assert rx.ended.wait(10), "the receiver did not end"
  return rx.error


def test_records_cross_unchanged_and_the_end_closes_the_far_ring(rings):
  w0, r1 = rings.writer(0), rings.reader(1)
  ends = []
  rx = receiver(rings.writer(1), SECRET, HELLO, on_end=ends.append)
  tx = sender(rings.reader(0), rx.address, SECRET, HELLO, on_end=ends.append)
  sent = [(i * 7919, i % 32, os.urandom(4 * (i % 50))) for i in range(2000)]  # empty payloads too
  for oid, flags, payload in sent: w0.write(oid, payload, flags)
  for seq, (oid, flags, payload) in enumerate(sent):
    rec = r1.next_record(timeout=10)
    assert (rec.object_id, rec.flags, rec.sequence, bytes(rec.payload)) == (oid, flags, seq, payload)
  w0.close()
  with pytest.raises(errors.RingClosed): r1.next_record(timeout=10)
  assert ended(rx) is None and tx.ended.wait(10) and ends == [None, None]
  assert rx.stats()["records"] == tx.stats()["records"] == len(sent)


def test_a_quiet_bridge_stays_up_on_heartbeats(rings, monkeypatch):
  monkeypatch.setattr(bridge, "LOST_S", 0.6)
  w0, r1 = rings.writer(0), rings.reader(1)
  rx = receiver(rings.writer(1), SECRET, HELLO)
  tx = sender(rings.reader(0), rx.address, SECRET, HELLO)
  with pytest.raises(errors.RingTimeout): r1.next_record(timeout=1.5)  # 2.5 LOST_S of nothing but heartbeats
  assert not rx.ended.is_set()
  w0.write(1, b"late")
  assert bytes(r1.next_record(timeout=5).payload) == b"late"
  tx.close(); rx.close()


def test_peers_without_the_secret_or_of_another_version_are_turned_away_by_name(rings):
  rx = receiver(rings.writer(1), SECRET, HELLO)
  with pytest.raises(errors.BridgeRefused, match="BridgeAuthFailed"): connect(rx.address, os.urandom(32), HELLO)
  with pytest.raises(errors.BridgeRefused, match="BridgeMismatch: version: ours '1.0', the peer's '2.0'"):
    connect(rx.address, SECRET, {**HELLO, "version": "2.0"})
  with pytest.raises(errors.BridgeRefused, match="model"): connect(rx.address, SECRET, {**HELLO, "model": "another"})
  with socket.create_connection(rx.address) as s:  # not the protocol at all
    s.recv(24)
    s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 8)
  # the garbage's handshake ends on a thread of its own, after its sender has gone: waited for here, since one still
  # under way when the right peer gets through is hung up as BridgeTaken instead (a busy machine can make it so)
  deadline = time.monotonic() + 10
  while len(rx.stats()["refused"]) < 4 and time.monotonic() < deadline: time.sleep(0.01)
  got = sorted(r.split(":")[0] for r in rx.stats()["refused"])
  assert got == ["BridgeAuthFailed", "BridgeFrameInvalid", "BridgeMismatch", "BridgeMismatch"]
  # the listener is still there for the right peer
  sender(rings.reader(0), rx.address, SECRET, HELLO)
  rings.writer(0).write(5, b"abcd")
  assert bytes(rings.reader(1).next_record(timeout=5).payload) == b"abcd"


def _authenticated(rx: BridgeReceiver) -> socket.socket:
  return connect(rx.address, SECRET, HELLO)


FRAME = struct.Struct("<I")


@pytest.mark.parametrize("bad, error, words", [
  (FRAME.pack(1 << 30), errors.BridgeFrameInvalid, "a frame of 1073741824 bytes"),                  # absurd length
  (FRAME.pack(12) + b"x" * 12, errors.BridgeFrameInvalid, "a frame of 12 bytes"),                    # shorter than a header
  (FRAME.pack(48) + b"Z" * 48, errors.BridgeFrameInvalid, "InvalidObjectMagic"),                     # garbage header
  (FRAME.pack(48) + encode_header(1, 5, 8) + b"y" * 8, errors.BridgeFrameInvalid, "SequenceViolation"),  # out of order
  (FRAME.pack(52) + encode_header(1, 1, 8) + b"y" * 12, errors.BridgeFrameInvalid, "holds a record of 8"),  # length vs extent
  (FRAME.pack(46) + encode_header(1, 1, 6) + b"y" * 6, errors.BridgeFrameInvalid, "ObjectExtentAlignmentViolation"),
  (FRAME.pack(48) + encode_header(1, 1, 8) + b"y" * 3, errors.BridgeLost, "without the end frame"),  # truncated, then closed
  (b"", errors.BridgeLost, "nothing heard"),                                                         # silence
], ids=["absurd-length", "short-frame", "garbage-header", "out-of-order", "length-vs-extent", "misaligned", "truncated", "silent"])
def test_a_hostile_peer_gets_a_named_error_and_the_far_ring_closes(rings, monkeypatch, bad, error, words):
  monkeypatch.setattr(bridge, "LOST_S", 0.5)
  r1 = rings.reader(1)
  rx = receiver(rings.writer(1), SECRET, HELLO)
  s = _authenticated(rx)
  s.sendall(FRAME.pack(48) + encode_header(9, 0, 8) + b"good one")  # one good record first: it is delivered
  if bad: s.sendall(bad)
  if error is errors.BridgeLost and bad: s.close()
  e = ended(rx)
  assert isinstance(e, error) and words in str(e), e
  assert bytes(r1.next_record(timeout=5).payload) == b"good one"
  with pytest.raises(errors.RingClosed): r1.next_record(timeout=5)  # the stage reading the ring drains and stops
  s.close()


def test_a_lost_receiver_ends_the_sender_by_name(rings):
  lst = socket.create_server(("127.0.0.1", 0))
  def serve() -> socket.socket:
    c, _ = lst.accept()
    accept(c, SECRET, HELLO)
    return c
  import threading
  got: list[socket.socket] = []
  t = threading.Thread(target=lambda: got.append(serve()))
  t.start()
  ends: list = []
  tx = sender(rings.reader(0), lst.getsockname()[:2], SECRET, HELLO, on_end=ends.append)
  t.join(5)
  got[0].close()  # the receiving host is gone
  lst.close()
  w0 = rings.writer(0)
  assert tx.ended.wait(10)
  assert isinstance(ends[0], errors.BridgeLost) and "receiver went away" in str(ends[0])
  with pytest.raises((errors.RingClosed, errors.RingTimeout)):  # the upstream stage learns its ring is read no more
    for i in range(10_000): w0.write(i, b"x" * 4000, timeout=1)


def test_strangers_on_the_port_do_not_delay_the_right_peer(rings, monkeypatch, caplog):
  """50 silent connections and a slowloris trickling its hello a byte at a time are there first: the right peer still
  completes its handshake at once (each handshake runs on its own, against a total deadline), and each stranger is
  turned away and logged once with its address."""
  import threading
  import time
  monkeypatch.setattr(bridge, "HANDSHAKE_S", 1.5)
  w0, r1 = rings.writer(0), rings.reader(1)
  rx = receiver(rings.writer(1), SECRET, HELLO)
  idle = [socket.create_connection(rx.address) for _ in range(50)]
  stop = threading.Event()
  def slowloris() -> None:
    with socket.create_connection(rx.address) as s:
      s.recv(24)
      while not stop.is_set():
        try: s.sendall(b"\x00")  # a hello of 0 bytes, then its MAC a byte at a time
        except OSError: return
        time.sleep(0.3)
  loris = threading.Thread(target=slowloris)
  loris.start()
  try:
    time.sleep(0.3)
    t0 = time.monotonic()
    tx = sender(rings.reader(0), rx.address, SECRET, HELLO)
    w0.write(7, b"through!")
    assert bytes(r1.next_record(timeout=10).payload) == b"through!"
    assert time.monotonic() - t0 < bridge.HANDSHAKE_S  # within its own handshake's bound, not behind the strangers'
    deadline = time.monotonic() + 10
    while len(rx.stats()["refused"]) < 51 and time.monotonic() < deadline: time.sleep(0.05)
    refused = rx.stats()["refused"]
    assert len(refused) == 51, refused  # the 50 and the slowloris, each once
    kinds = sorted({r.split(":")[0] for r in refused})
    assert "BridgeBusy" in kinds and ("BridgeHandshakeTimeout" in kinds or "BridgeTaken" in kinds), refused
    assert sum("turned away" in rec.getMessage() for rec in caplog.records) == 51
    tx.close()
  finally:
    stop.set(); loris.join(5)
    for s in idle: s.close()
    rx.close()


def test_a_hello_trickled_a_byte_at_a_time_is_cut_at_the_total_deadline(rings, monkeypatch):
  import time
  monkeypatch.setattr(bridge, "HANDSHAKE_S", 1.0)
  a, b = socket.socketpair()
  try:
    def trickle() -> None:
      a.recv(24)
      for _ in range(20):
        try: a.sendall(b"\x00")
        except OSError: return
        time.sleep(0.2)
    import threading
    threading.Thread(target=trickle, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError): accept(b, SECRET, HELLO)
    assert time.monotonic() - t0 < 2.0  # the per-recv timeout alone would have let it go on for 4 s
  finally: a.close(); b.close()
